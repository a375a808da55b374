"""kvtier as the HiCache L3 of real SGLang servers (SGLang 0.5.23 from .venv-sglang, on this
CPU with the test-only shims of tests/sglang_shims/), through SGLang's dynamic backend loader
and the zero-copy v1 path. First the backend class alone in the SGLang venv
(tests/test_sglang_backend.py), then one daemon, three servers:

- A1 computes prompts and stores their pages; A2 (same model, up at the same time on the same
  daemon) serves them from kvtier: SGLang reports them as storage hits
  (`cached_tokens_details["storage"]`) and the greedy output equals A1's. A1 after
  `/flush_cache` (its L1 and L2 emptied) serves them from kvtier too.
- Negative control: B has other weights but declares A's model id, so it reads A's pages under
  the right keys: wrong bytes for B. Its output with them differs from its own recompute, so
  the output really depends on the bytes kvtier supplies.
- The daemon killed mid-run: B keeps serving (recomputes, no storage hits), with one warning;
  the restarted daemon is used again (A's pages, kept by its SSD tier).
- Shadow verification: C, B's weights under A's model id with `verify_sample` 1.0, computes the
  prompt instead of loading A's pages (its answer is its own), finds them wrong when SGLang backs
  its pages up, and the daemon quarantines them (C's computed pages are stored in their place).

Three SGLang server starts: the slowest engine test of the suite.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client.sync_client import Client, LayoutDecl
from tests.daemon_fixture import DaemonProc
from tests.support.sglang_engine import PAGE, ROOT, SglangServer, sglang_python, write_model

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

if sglang_python() is None:
    if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
        raise RuntimeError("KVTIER_REQUIRE_SGLANG=1 but no SGLang venv (scripts/venv.sh)")
    pytest.skip("no SGLang venv (.venv-sglang or $KVTIER_SGLANG_PYTHON)",
                allow_module_level=True)

MODEL_ID = "test/sglang-tiny@a"


def prompt(seed: int, n: int = 12 * PAGE + 5) -> list[int]:
    return [(i * 7919 + seed * 104729) % 1000 + 3 for i in range(n)]


def wait_pages(daemon: DaemonProc, want: int, timeout: float = 60.0) -> int:
    """Until the daemon's DRAM holds `want` blocks (SGLang writes back to L3 after the
    request); returns the count then."""
    decl = LayoutDecl(b"sglang-test-probe", 4096, PAGE, model_id="test/probe")
    with Client(daemon.socket, layout=decl) as kv:
        deadline = time.monotonic() + timeout
        while True:
            n = int(next(t.blocks for t in kv.stats().tiers if t.tier == pb.TIER_DRAM))
            if n >= want or time.monotonic() > deadline:
                return n
            time.sleep(0.2)


def wait_stat(daemon: DaemonProc, field: str, want: int, timeout: float = 60.0) -> int:
    """Until the daemon's Stats counter `field` reaches `want` (a backup, and so its
    verification, runs after the request); returns it then."""
    decl = LayoutDecl(b"sglang-test-probe", 4096, PAGE, model_id="test/probe")
    with Client(daemon.socket, layout=decl) as kv:
        deadline = time.monotonic() + timeout
        while True:
            n = int(getattr(kv.stats(), field))
            if n >= want or time.monotonic() > deadline:
                return n
            time.sleep(0.2)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("sgd") / "d",
                   ["--dram-bytes", "64MiB", "--slot-bytes", "16KiB"]).start()
    try:
        yield d
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()


def test_backend_class_in_the_sglang_venv(tmp_path: Path) -> None:
    """tests/test_sglang_backend.py (SGLang's factory builds `KvtierStorage`; both paths) in the
    SGLang venv, where SGLang imports. Its temp files (SGLang's CuTe DSL cache, ...) go to this
    test's tmp_path."""
    python = sglang_python()
    assert python is not None
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path),
           "KVTIER_NESTED_PYTEST": "1"}
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-W", "ignore", "tests/test_sglang_backend.py"],
                         cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout, run.stdout[-2000:]


def test_servers_share_pages_through_kvtier(daemon: DaemonProc, tmp_path: Path) -> None:
    model_a = write_model(tmp_path / "model-a", seed=0)
    model_b = write_model(tmp_path / "model-b", seed=1)
    # the planner (default rates: a GPU) finds recomputing this tiny model faster than any fetch
    extra = {"model_id": MODEL_ID, "retry_after_s": 1, "use_plan": False}
    prompts = [prompt(1), prompt(2)]
    with SglangServer(tmp_path / "a1", model_a, socket=daemon.socket, extra=extra) as a1:
        a1.start()
        first = [a1.generate(p) for p in prompts]
        assert all(g.storage == 0 for g in first)
        pages = sum(len(p) // PAGE for p in prompts)
        assert wait_pages(daemon, pages) >= pages
        assert "kvtier backend: rank 0/1" in a1.log()
        with SglangServer(tmp_path / "a2", model_a, socket=daemon.socket, extra=extra) as a2:
            a2.start()
            for p, want in zip(prompts, first, strict=True):
                got = a2.generate(p)
                assert got.tokens == want.tokens
                assert got.storage >= (len(p) // PAGE - 1) * PAGE, got  # all but the last page
        a1.flush()
        again = a1.generate(prompts[0])
        assert again.tokens == first[0].tokens and again.storage > 0, again

    # negative control and the daemon killed mid-run, on a server with other weights
    with SglangServer(tmp_path / "b", model_b, socket=daemon.socket, extra=extra) as b:
        b.start()
        wrong = b.generate(prompts[0])
        assert wrong.storage > 0, wrong  # A's pages, under B's (= A's) keys
        daemon.kill()
        b.flush()
        own = b.generate(prompts[0])
        assert own.storage == 0 and own.cached == 0, own
        assert own.tokens != wrong.tokens, "the output does not depend on the loaded KV"
        b.generate(prompts[1])  # still down: served, no second warning
        assert b.log().count("daemon unavailable or refusing") == 1, b.tail()
        # the restarted daemon is used again after retry_after_s; its SSD tier kept A's pages
        # (DESIGN invariant 6: a crash loses DRAM only), so B reads them again, now from SSD
        daemon.start()
        time.sleep(2)
        b.flush()
        back = b.generate(prompts[0])
        assert back.storage > 0 and back.tokens == wrong.tokens, back
        assert "reachable again" in b.log()

    with SglangServer(tmp_path / "c", model_b, socket=daemon.socket,
                      extra={**extra, "verify_sample": 1.0}) as c:
        c.start()
        checked = c.generate(prompts[0])
        assert checked.storage == 0 and checked.tokens == own.tokens, checked
        mismatched = wait_stat(daemon, "verify_mismatched_blocks", 1)
        assert mismatched >= 1, c.tail()
        assert "kvtier verify: MISMATCH" in c.log(), c.tail()
        assert wait_stat(daemon, "verify_quarantined_blocks", 1) >= 1
