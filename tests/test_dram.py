"""DRAM slot pool: allocation, accounting, pins (the lease rule), attach checks, real processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.client.mapping import DramClient
from kvtier.core.errors import UsageError
from kvtier.core.segment import DramError, SegmentHandle, StaleSegment
from kvtier.tiers.dram import DramPool, DramSpec, SlotPinned

SLOT = 64 * 1024 + 100  # not a page multiple: stride rounds up to 69632 (17 pages)


@pytest.fixture
def pool() -> Iterator[DramPool]:
    p = DramPool.create(DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", SLOT, 8))
    yield p
    p.close()


def test_geometry_mode_and_accounting(pool: DramPool) -> None:
    assert pool.slot_stride == 17 * 4096
    assert os.path.getsize(pool.path) == 4096 + 8 * 17 * 4096
    assert stat.S_IMODE(os.stat(pool.path).st_mode) == 0o600
    s = pool.stats()
    stride = 17 * 4096  # bytes count whole slots (strides): what the pool holds
    assert (s.slots_free, s.bytes_reserved, s.bytes_used) == (8, 8 * stride, 0)
    slots = pool.alloc_many(3)
    assert slots is not None and len(set(slots)) == 3
    pool.pin(slots[0])
    s = pool.stats()
    assert (s.slots_used, s.slots_free, s.slots_pinned) == (3, 5, 1)
    assert (s.bytes_used, s.bytes_free) == (3 * stride, 5 * stride)
    assert s.bytes_used + s.bytes_free == s.bytes_reserved


def test_alloc_until_full_then_free(pool: DramPool) -> None:
    got = [pool.alloc() for _ in range(8)]
    assert sorted(s for s in got if s is not None) == list(range(8))
    assert pool.alloc() is None and pool.alloc_many(1) is None
    assert pool.free(5) == 17 * 4096  # the bytes it spanned: its stride
    assert pool.alloc_many(2) is None  # all or nothing
    assert pool.alloc() == 5


def test_free_and_pin_misuse(pool: DramPool) -> None:
    with pytest.raises(DramError):
        pool.free(0)  # never allocated
    with pytest.raises(DramError):
        pool.pin(99)
    s = pool.alloc()
    assert s is not None
    with pytest.raises(DramError):
        pool.unpin(s)
    pool.free(s)
    with pytest.raises(DramError):
        pool.free(s)  # double free


def test_pinned_slot_is_never_freed_nor_rewritten(pool: DramPool) -> None:
    s = pool.alloc()
    assert s is not None
    pool.write(s, b"A" * SLOT)
    assert pool.pin(s) == 1 and pool.pin(s) == 2
    with pytest.raises(SlotPinned):
        pool.free(s)
    with pytest.raises(SlotPinned):
        pool.write(s, b"B" * 10)
    assert pool.unpin(s) == 1
    with pytest.raises(SlotPinned):
        pool.free(s)
    pool.unpin(s)
    pool.free(s)
    assert pool.alloc() == s and bytes(pool.view(s, 4)) == b"AAAA"  # freeing never wipes


def test_views_are_zero_copy(pool: DramPool) -> None:
    s = pool.alloc()
    assert s is not None
    v = pool.view(s)
    v[:3] = [1, 2, 3]
    out = bytearray(3)
    pool.read_into(s, out)
    assert out == b"\x01\x02\x03"
    with pytest.raises(DramError):
        pool.write(s, b"x" * (pool.stride_of(s) + 1))


def test_client_views_of_a_replys_offsets(pool: DramPool) -> None:
    """A client's views of several blocks at once: the bytes the pool wrote, the bounds checked
    as one view at a time would (the first offending offset named)."""
    a, b = pool.alloc_many(2) or []
    pool.view(a)[:3] = np.frombuffer(b"abc", np.uint8)
    pool.view(b)[:3] = np.frombuffer(b"xyz", np.uint8)
    client = DramClient.attach(pool.handle())
    try:
        got = client.views_at([pool.offset(b), pool.offset(a)], 3)
        assert [bytes(v) for v in got] == [b"xyz", b"abc"]
        assert client.views_at([], 3) == []
        size = 4096 + 8 * 17 * 4096  # header page + 8 strides of 17 pages
        with pytest.raises(DramError, match=f"10 bytes at offset {size - 5} are outside"):
            client.views_at([pool.offset(a), size - 5, 0], 10)
        with pytest.raises(DramError, match="10 bytes at offset 0 are outside"):
            client.views_at([0, size - 5], 10)
    finally:
        client.close()


def test_segment_name_taken_is_a_usage_error(pool: DramPool) -> None:
    with pytest.raises(UsageError):
        DramPool.create(DramSpec(pool.spec.name, SLOT, 2))
    with pytest.raises(UsageError):
        DramSpec("../etc", SLOT, 2).validate()


def test_replace_stale_gives_a_new_generation(pool: DramPool) -> None:
    old = pool.handle()
    client = DramClient.attach(old)
    newer = DramPool.create(DramSpec(pool.spec.name, SLOT, 8, replace_stale=True))
    try:
        assert newer.generation != old.generation
        assert client.is_live()  # still maps the old (now unlinked) segment, which is live
        with pytest.raises(StaleSegment):
            DramClient.attach(old)  # same name, size, but another generation
        DramClient.attach(newer.handle()).close()
    finally:
        client.close()
        newer.close()


def test_attach_checks(pool: DramPool) -> None:
    h = pool.handle()
    with pytest.raises(StaleSegment):
        DramClient.attach(h._replace(size=h.size + 4096))
    with pytest.raises(StaleSegment):
        DramClient.attach(h._replace(slot_size=h.slot_size + 1))
    with pytest.raises(StaleSegment):
        DramClient.attach(h._replace(name="kvt-test-missing"))


def test_mlock_and_huge_pages_never_crash() -> None:
    spec = DramSpec(f"kvt-test-{uuid.uuid4().hex[:12]}", 4096, 4, mlock=True, huge_pages=True)
    with DramPool.create(spec) as p:
        s = p.stats()
        assert isinstance(s.mlocked, bool) and isinstance(s.huge_pages, bool)
        assert p.data_offset == 2 << 20 and p.size % (2 << 20) == 0


def _cuda_devices() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: none usable
        return 0


def test_register_cuda_without_gpu_is_skipped(pool: DramPool) -> None:
    """Without a usable CUDA device (cupy installed or not) registration is declined; with one
    it is done (test_dram's GPU tests check what it did)."""
    with DramClient.attach(pool.handle()) as c:
        assert c.register_cuda() is (_cuda_devices() > 0)


class _FakeRuntime:
    """Stands in for cupy.cuda.runtime: records host registrations like the driver would."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.registered: dict[int, tuple[int, int]] = {}  # host ptr -> (bytes, flags)

    def hostRegister(self, ptr: int, nbytes: int, flags: int) -> None:
        if self.refuse:
            raise self.CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.registered[ptr] = (nbytes, flags)

    def hostUnregister(self, ptr: int) -> None:
        del self.registered[ptr]

    def pointerGetAttributes(self, ptr: int) -> object:
        if ptr not in self.registered:
            raise self.CUDARuntimeError("not registered")
        return types.SimpleNamespace(devicePointer=ptr + (1 << 40))


def _fake_cupy(monkeypatch: pytest.MonkeyPatch, runtime: _FakeRuntime) -> None:
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    cuda.runtime = runtime  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_register_cuda_maps_the_whole_segment_for_kernels(
    pool: DramPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = _FakeRuntime()
    _fake_cupy(monkeypatch, rt)
    with DramClient.attach(pool.handle()) as c:
        assert c.register_cuda() and c.register_cuda()  # idempotent: registered once
        ptr = c.buffer.ctypes.data
        # Portable (1) | Mapped (2): kernels need a device address for the host pages.
        assert rt.registered == {ptr: (pool.size, 3)}
        assert c.cuda_registration.device_ptr == ptr + (1 << 40)
    assert rt.registered == {}  # unregistered before unmapping


def test_register_cuda_refused_is_a_clean_false(
    pool: DramPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = _FakeRuntime(refuse=True)
    _fake_cupy(monkeypatch, rt)
    with DramClient.attach(pool.handle()) as c:
        assert c.register_cuda() is False and c.cuda_registration is None
    assert rt.registered == {}


def test_close_unlinks_and_marks_closed(pool: DramPool) -> None:
    client = DramClient.attach(pool.handle())
    s = pool.alloc()
    assert s is not None
    pool.write(s, b"keep")
    pool.close()
    assert not os.path.exists(pool.path)
    assert not client.is_live()
    assert bytes(client.view(s, 4)) == b"keep"  # the mapping outlives the file
    client.close()


CHILD = r"""
import json, sys
import numpy as np
from kvtier.core.segment import SegmentHandle
from kvtier.client.mapping import DramClient
h = SegmentHandle(*json.loads(sys.argv[1]))
slot = int(sys.argv[2])
c = DramClient.attach(h)
def fill():
    v = c.view(slot)
    return int(v[0]) if bool((v == v[0]).all()) else -1
print("attached", fill(), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "watch":
        seen = {fill() for _ in range(200)}
        print("seen", ",".join(map(str, sorted(seen))), flush=True)
    elif cmd == "read":
        print("value", fill(), flush=True)
    elif cmd == "live":
        print("live", c.is_live(), fill(), flush=True)
    elif cmd == "exit":
        break
"""


def _ask(proc: subprocess.Popen[str], cmd: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def _child(h: SegmentHandle, slot: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(list(h)), str(slot)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


def test_leased_slot_survives_daemon_reuse_attempts(pool: DramPool) -> None:
    """Another process reads a leased slot while the daemon side churns the pool."""
    s = pool.alloc()
    assert s is not None
    pool.write(s, bytes([7]) * SLOT)
    pool.pin(s)  # the lease the daemon grants the client
    proc = _child(pool.handle(), s)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "attached 7"
        # The daemon side tries to reuse it: refused while leased; other slots churn.
        with pytest.raises(SlotPinned):
            pool.free(s)
        with pytest.raises(SlotPinned):
            pool.write(s, bytes([9]) * SLOT)
        for round_ in range(20):
            others = pool.alloc_many(7)
            assert others is not None and s not in others
            for o in others:
                pool.write(o, bytes([round_]) * SLOT)
                pool.free(o)
        assert _ask(proc, "watch") == "seen 7"
        # Lease released: the slot may now be freed and reused, and the client sees new bytes.
        pool.unpin(s)
        pool.free(s)
        again = pool.alloc()
        assert again == s
        pool.write(s, bytes([9]) * SLOT)
        assert _ask(proc, "read") == "value 9"
        pool.close()
        assert _ask(proc, "live") == "live False 9"
        _ask(proc, "exit")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_client_exit_never_unlinks_the_segment(pool: DramPool) -> None:
    s = pool.alloc()
    assert s is not None
    pool.write(s, bytes([3]) * SLOT)
    proc = _child(pool.handle(), s)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "attached 3"
    _ask(proc, "exit")
    assert proc.wait(timeout=30) == 0
    assert os.path.exists(pool.path)
    with DramClient.attach(pool.handle()) as c:
        assert bool((c.view(s) == 3).all())
    assert np.asarray(pool.view(s)).sum() == 3 * SLOT


@pytest.mark.gpu
def test_cuda_registered_mapping_feeds_the_gpu(pool: DramPool) -> None:
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device")
    s = pool.alloc()
    assert s is not None
    pattern = np.random.default_rng(0).integers(0, 256, SLOT, dtype=np.uint8)
    pool.write(s, pattern)
    with DramClient.attach(pool.handle()) as c:
        assert c.register_cuda()
        assert c.cuda_registration.device_ptr  # mapped: kernels can address the slots
        on_gpu = cupy.asarray(c.view(s))
        assert bool((cupy.asnumpy(on_gpu) == pattern).all())
