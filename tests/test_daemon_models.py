"""Models that share a KV layout never share blocks (real daemon, real SSD store, real restart).

vLLM-compatible keys (`KeyScheme.vllm`) carry no model: a base model and its fine-tune, both
with one layout fingerprint, produce equal keys for equal token blocks. The daemon keeps them
apart by the model id each client registers its layout with (layout id = H(model id,
fingerprint)), in DRAM, on SSD and across restarts; blocks stored before namespaces carried a
model id are dropped at start, never served.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.client.sync_client import Client, LayoutDecl
from kvtier.core.keys import root_seed
from kvtier.core.types import Tier
from kvtier.daemon.cache.namespaces import Namespace
from kvtier.daemon.cache.spec import STORE_FINGERPRINT
from kvtier.tiers.ssd.store import PutItem, SsdSpec, SsdStore
from tests.daemon_fixture import DaemonProc, daemon, ssd_blocks, wait_ssd_blocks  # noqa: F401

BLOCK = 65536
FP = b"shared-layout-fp-0001"  # one layout fingerprint, two models
BASE = LayoutDecl(FP, BLOCK, 16, model_id="org/base-7b@r1")
TUNE = LayoutDecl(FP, BLOCK, 16, model_id="org/base-7b-chat-ft@r1")
KEYS = [i.to_bytes(4, "big") + bytes(28) for i in range(4)]  # one chain, equal for both models
BASE_DATA = [bytes([0x11, i]) * (BLOCK // 2) for i in range(len(KEYS))]
TUNE_DATA = [bytes([0x22, i]) * (BLOCK // 2) for i in range(len(KEYS))]


def loaded(kv: Client) -> list[bytes]:
    with kv.load(KEYS) as got:
        return [bytes(v) for v in got.views]


def test_layout_ids_differ_by_model_and_match_root_seed() -> None:
    assert BASE.fingerprint == TUNE.fingerprint
    assert BASE.layout_id == root_seed("org/base-7b@r1", FP, "sha256_cbor")
    assert BASE.layout_id != TUNE.layout_id


@pytest.mark.parametrize("model_id", ["", "m" * 257, "é" * 129, "line\nbreak"])
def test_layout_decl_refuses_a_bad_model_id(model_id: str) -> None:
    with pytest.raises(ValueError, match="model_id"):
        LayoutDecl(FP, BLOCK, 16, model_id=model_id)


def test_layout_decl_requires_a_model_id() -> None:
    with pytest.raises(TypeError, match="model_id"):
        LayoutDecl(FP, BLOCK, 16)  # type: ignore[call-arg]


@pytest.mark.parametrize("streaming", [False, True], ids=["shm", "streaming"])
def test_models_of_one_layout_never_see_read_or_overwrite_each_other(
    daemon: DaemonProc, streaming: bool,  # noqa: F811
) -> None:
    with Client(daemon.socket, layout=BASE, streaming=streaming) as base, \
            Client(daemon.socket, layout=TUNE, streaming=streaming) as tune, \
            Client(daemon.socket, layout=BASE, streaming=streaming) as base2:
        assert base.store(KEYS, BASE_DATA).stored == len(KEYS)
        assert base2.lookup(KEYS).hit_blocks == len(KEYS)  # same model: the keys do hit
        assert tune.lookup(KEYS).hit_blocks == 0  # same layout, same keys, other model: none
        with tune.load(KEYS) as got:
            assert got.blocks == 0
        assert tune.store(KEYS, TUNE_DATA) == (len(KEYS), 0)  # its own blocks, not "skipped"
        assert loaded(base) == BASE_DATA  # never overwritten
        assert loaded(base2) == BASE_DATA
        assert loaded(tune) == TUNE_DATA
        assert tune.report_hbm("gpu0", added=KEYS) == len(KEYS)
        assert Tier.HBM not in base.lookup(KEYS, replica="gpu0").tiers
        assert base.stats().layouts == 2


def test_events_name_the_layout_id_of_each_model(daemon: DaemonProc) -> None:  # noqa: F811
    with Client(daemon.socket, layout=BASE) as base, Client(daemon.socket, layout=TUNE) as tune:
        base.store([bytes(32)], [bytes(BLOCK)])  # event 1: replay starts after it
        base.store(KEYS, BASE_DATA)
        tune.store(KEYS, TUNE_DATA)
    layouts: set[bytes] = set()
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        stub = pb_grpc.KvTierStub(ch)  # type: ignore[no-untyped-call]
        # until two layouts came (a 1 s deadline ended the replay before: on a loaded machine
        # it could end it first); a daemon that named one layout for both ends at the deadline
        stream = stub.WatchEvents(pb.WatchEventsRequest(since_sequence=1), timeout=30)
        with pytest.raises(grpc.RpcError) as exc:  # cancelled: it ends the open stream
            for ev in stream:
                if ev.HasField("stored") and KEYS[-1] in ev.stored.block_hashes:
                    layouts.add(ev.stored.layout)
                    if len(layouts) == 2:
                        stream.cancel()
        assert exc.value.code() is grpc.StatusCode.CANCELLED, layouts
    assert layouts == {BASE.layout_id, TUNE.layout_id}  # watchers can tell the models apart


def test_restart_keeps_each_models_blocks_and_drops_pre_model_id_blocks(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path / "d").start()
    try:
        with Client(d.socket, layout=BASE) as base, Client(d.socket, layout=TUNE) as tune:
            for kv, data in ((base, BASE_DATA), (tune, TUNE_DATA)):
                assert kv.store(KEYS, data).stored == len(KEYS)  # access 1
                assert kv.lookup(KEYS).hit_blocks == len(KEYS)  # access 2: admitted to SSD
            assert wait_ssd_blocks(base, 2 * len(KEYS)) == 2 * len(KEYS)
    finally:
        assert d.stop() == 0

    # What a daemon before model-id namespaces stored: "<tenant>/<fingerprint hex>".
    legacy_ns = f"default/{FP.hex()}"
    legacy = [b"\xee" + k[1:] for k in KEYS]
    store = SsdStore(SsdSpec(path=str(d.data_dir / "ssd"), capacity_bytes=64 << 20,
                             layout_fingerprint=STORE_FINGERPRINT, payload="lmdb"))
    put = store.put_many([PutItem(legacy_ns, k, legacy[i - 1] if i else None, bytes(BLOCK))
                          for i, k in enumerate(legacy)])
    assert len(put.stored) == len(legacy)
    store.close()

    d.start()
    try:
        with Client(d.socket, layout=TUNE) as tune, Client(d.socket, layout=BASE) as base, \
                Client(d.socket, layout=LayoutDecl(FP, BLOCK, 16, model_id="other")) as other:
            assert base.lookup(KEYS).tiers == [Tier.SSD] * len(KEYS)
            assert loaded(base) == BASE_DATA
            assert loaded(tune) == TUNE_DATA
            assert other.lookup(KEYS).hit_blocks == 0
            assert all(kv.lookup(legacy).hit_blocks == 0 for kv in (base, tune, other))
            assert ssd_blocks(base) == 2 * len(KEYS)  # the legacy blocks are gone
        assert "dropping 4 stored blocks of 1 namespaces without a model id" in d.log()
    finally:
        assert d.stop() == 0
    store = SsdStore(SsdSpec(path=str(d.data_dir / "ssd"), capacity_bytes=64 << 20,
                             layout_fingerprint=STORE_FINGERPRINT, payload="lmdb"))
    try:
        names = {e.ns for e in store.entries()}
    finally:
        store.close()
    assert legacy_ns not in names and len(names) == 2


def test_a_namespace_is_typed_and_keeps_its_stored_form() -> None:
    """`Namespace(tenant, layout id)` reads its parts as fields; its value (what the index and the
    stores key by) is `"<tenant>/ns2:<layout id hex>"`; only that form parses back."""
    lid = bytes(range(32))
    ns = Namespace("alice", lid)
    assert (ns.tenant, ns.layout_id) == ("alice", lid)
    assert ns == "alice/ns2:000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    assert hash(ns) == hash(str(ns))  # keys the same dict entries as the string
    back = Namespace.parse(str(ns))
    assert back == ns and back is not None and (back.tenant, back.layout_id) == ("alice", lid)
    wide = Namespace.parse(str(Namespace("a/b", lid)))  # split at the last "/", before the tag
    assert wide is not None and (wide.tenant, wide.layout_id) == ("a/b", lid)
    for other in ("alice/" + "ab" * 8,  # the pre-model-id "<tenant>/<fingerprint hex>"
                  "alice/ns2:" + "ab" * 31,  # a layout id of 31 bytes
                  "alice/ns2:" + "zz" * 32):
        assert Namespace.parse(other) is None, other
