"""`bench.vllm_views` (the GPU machine's vLLM-free KV views and connector base) against vLLM's
own `create_kv_cache_views` and `KVConnectorMetadata`, where vLLM is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.vllm_views import LAYOUTS, kv_views, page_bytes

torch = pytest.importorskip("torch")
kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_every_vllm_layout_is_known() -> None:
    assert {x.name: x.value for x in KVCacheLayout} == LAYOUTS


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("layers", "blocks", "heads", "tokens", "head", "dtype"), [
    (3, 5, 2, 16, 64, torch.bfloat16),
    (4, 7, 8, 32, 128, torch.float16),
    (2, 3, 1, 16, 80, torch.float32),
])
def test_views_equal_vllms(layout: str, layers: int, blocks: int, heads: int, tokens: int,
                           head: int, dtype: torch.dtype) -> None:
    spec = kvi.FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=head,
                                 dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert page_bytes(heads, tokens, head, itemsize) == spec.page_size_bytes
    vl = KVCacheLayout[layout]
    ls, bs, *_ = kvi.compute_layout_strides(spec, blocks, layers, vl)
    tensor = kvi.KVCacheTensor(size=blocks * layers * int(spec.page_size_bytes),
                               layers=[f"l{i}" for i in range(layers)], layer_stride=ls,
                               block_stride=bs)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    theirs = kvi.create_kv_cache_views(raw, spec, blocks, vl, tensor)
    ours = kv_views(raw, layers, blocks, heads, tokens, head, dtype, layout)
    assert len(ours) == len(theirs) == layers
    for a, b in zip(ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype, a.data_ptr()) == (
            b.shape, b.stride(), b.storage_offset(), b.dtype, b.data_ptr())


def test_wrong_buffer_size_is_refused() -> None:
    with pytest.raises(ValueError, match="not"):
        kv_views(torch.zeros(100, dtype=torch.int8), 1, 1, 1, 16, 64, torch.bfloat16, "LBHNC")


def test_connector_worker_imports_over_the_stand_in_base() -> None:
    """Without vLLM (forced here: the stand-in installed first), the worker side and its
    metadata import, and the metadata derives from the stand-in base."""
    code = (
        "from bench.vllm_views import BASE, install_stand_in\n"
        "install_stand_in()\n"
        "import sys\n"
        "from kvtier.integrations.vllm.metadata import KvtierMetadata\n"
        "from kvtier.integrations.vllm.worker import WorkerSide\n"
        "assert issubclass(KvtierMetadata, sys.modules[BASE].KVConnectorMetadata)\n"
        "from bench.vllm_views import connector_base\n"
        "print(connector_base(), WorkerSide.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["stand-in", "WorkerSide"]


def test_with_vllm_the_base_is_vllms() -> None:
    from bench.vllm_views import connector_base

    assert connector_base() == "vllm"


def test_vllm_loads_bench_runs_without_vllm(tmp_path: Path) -> None:
    """bench.vllm_loads with every `vllm` import refused but the stand-in base's (as on the GPU
    machine): a real daemon, the connector's worker, layer-by-layer loads."""
    out = tmp_path / "loads.json"
    code = (
        "import runpy, sys\n"
        "from bench.vllm_views import install_stand_in\n"
        "install_stand_in()\n"
        f"sys.argv = ['bench.vllm_loads', '--layers', '2', '--blocks', '4', '--repeats', '1',"
        f" '--json', {str(out)!r}]\n"
        "try:\n"
        "    runpy.run_module('bench.vllm_loads', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "real = [m for m, v in sys.modules.items() if m.startswith('vllm') and\n"
        "        getattr(v, '__file__', None)]\n"
        "print('real vllm modules:', real)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = __import__("json").loads(out.read_text())
    assert doc["connector_base"] == "stand-in"
    assert doc["summary"]["engine"]["n"] == 1
    assert "real vllm modules: []" in proc.stdout
