"""The layer rules in `.importlinter` hold for the tree, and a wrong import breaks them with a
message that names the chain (so CI fails readably)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache", "--config", str(root / ".importlinter")], cwd=root,
        capture_output=True, text=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def _copy(tmp: Path) -> Path:
    shutil.copytree(ROOT / "kvtier", tmp / "kvtier",
                    ignore=shutil.ignore_patterns("__pycache__", "_kernels"))
    shutil.copy(ROOT / ".importlinter", tmp / ".importlinter")
    return tmp


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")


def test_core_importing_the_daemon_is_refused(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _append(root / "kvtier/core/units.py", "from kvtier.daemon import config")
    out = _lint(root)
    assert out.returncode != 0
    assert "kvtier.core.units -> kvtier.daemon.config" in out.stdout


def test_pure_layers_importing_io_are_refused(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _append(root / "kvtier/index/types.py", "import lmdb")
    out = _lint(root)
    assert out.returncode != 0
    assert "kvtier.index is not allowed to import lmdb" in out.stdout


def test_client_reaching_into_tiers_is_refused(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _append(root / "kvtier/client/decl.py", "from kvtier.tiers import dram")
    out = _lint(root)
    assert out.returncode != 0
    assert "kvtier.client is not allowed to import kvtier.tiers" in out.stdout


def test_a_cycle_between_modules_is_refused(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _append(root / "kvtier/gpu/arrays.py", "from kvtier.gpu import transfer")
    out = _lint(root)
    assert out.returncode != 0
    assert "No cycles are allowed in kvtier.gpu" in out.stdout


@pytest.mark.parametrize(("module", "line", "message"), [
    # the SGLang backend reaching into vLLM's connector (what store.py did before common/)
    ("sglang/store.py", "from kvtier.integrations.vllm import settings",
     "kvtier.integrations.sglang is not allowed to import kvtier.integrations.vllm"),
    ("vllm/worker.py", "from kvtier.integrations.sglang import chains",
     "kvtier.integrations.vllm is not allowed to import kvtier.integrations.sglang"),
    ("common/link.py", "from kvtier.integrations.vllm import settings",
     "kvtier.integrations.common is not allowed to import kvtier.integrations.vllm"),
    ("common/loads.py", "import vllm",
     "kvtier.integrations.common is not allowed to import vllm"),
], ids=["sglang->vllm", "vllm->sglang", "common->vllm connector", "common->vllm package"])
def test_engines_stay_apart_and_common_knows_no_engine(tmp_path: Path, module: str, line: str,
                                                       message: str) -> None:
    root = _copy(tmp_path)
    _append(root / "kvtier/integrations" / module, line)
    out = _lint(root)
    assert out.returncode != 0
    assert message in out.stdout, out.stdout


@pytest.mark.parametrize(("module", "line", "message"), [
    ("daemon/cache/leases.py", "import grpc", "kvtier.daemon.cache is not allowed to import grpc"),
    ("daemon/cache/leases.py", "from kvtier.daemon.rpc import guard",
     "kvtier.daemon.cache.leases -> kvtier.daemon.rpc.guard"),
    ("daemon/cache/leases.py", "from kvtier.daemon import config",
     "kvtier.daemon.cache is not allowed to import kvtier.daemon.config"),
    ("daemon/rates/book.py", "from kvtier._proto import kvtier_pb2",
     "kvtier.daemon.rates is not allowed to import kvtier._proto"),
    ("daemon/rpc/guard.py", "from kvtier.tiers import dram",
     "kvtier.daemon.rpc is not allowed to import kvtier.tiers"),
    ("daemon/rpc/guard.py", "from kvtier.daemon.cache import residency",
     "kvtier.daemon.rpc is not allowed to import kvtier.daemon.cache.residency"),
], ids=["cache->grpc", "cache->rpc", "cache->config", "rates->proto", "rpc->tiers",
        "rpc->cache internals"])
def test_the_daemons_walls_hold(tmp_path: Path, module: str, line: str, message: str) -> None:
    root = _copy(tmp_path)
    _append(root / "kvtier" / module, line)
    out = _lint(root)
    assert out.returncode != 0
    assert message in out.stdout, out.stdout
