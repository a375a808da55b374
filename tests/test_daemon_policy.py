"""The daemon's `policy` setting reaches its prefix index: a real `kvtier serve` whose Allocate
follows the chosen policy's DRAM admission."""

from __future__ import annotations

from pathlib import Path

from kvtier.client.sync_client import Client
from tests.daemon_fixture import DaemonProc
from tests.test_daemon import LAYOUT, chain, payloads


def test_policy_flag_selects_the_dram_admission(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path, ["--policy", "vllm-reuse", "--ssd-bytes", "0"]).start()
    try:
        keys, data = chain(40, 4), payloads(4, 40)
        with Client(d.socket, layout=LAYOUT) as kv:
            # vLLM's reuse filter: nothing is stored before its keys were looked up twice
            assert kv.store(keys, data).stored == 0
            assert kv.lookup(keys).hit_blocks == 0
            assert kv.store(keys, data).stored == 0
            assert kv.lookup(keys).hit_blocks == 0
            assert kv.store(keys, data).stored == 4
            assert kv.lookup(keys).hit_blocks == 4
    finally:
        assert d.stop() == 0


def test_default_policy_stores_everything(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path, ["--ssd-bytes", "0"]).start()
    try:
        keys, data = chain(41, 4), payloads(4, 41)
        with Client(d.socket, layout=LAYOUT) as kv:
            assert kv.store(keys, data).stored == 4
            assert kv.lookup(keys).hit_blocks == 4
    finally:
        assert d.stop() == 0
