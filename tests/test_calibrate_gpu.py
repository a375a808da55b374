"""GPU calibration (run with `-m gpu` on a CUDA machine): copies and bf16 prefill on the device."""

import pytest

from kvtier.daemon.rates.book import Link
from kvtier.daemon.rates.calibrate import measure_copy, measure_prefill

pytestmark = pytest.mark.gpu


def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def test_device_copy_bandwidth_is_pcie_class():
    _cuda_or_skip()
    links, info = measure_copy(256 << 20)
    assert "cuda" in info["method"]
    # any PCIe Gen3 x16 or better moves > 5 GB/s with pinned memory; host memcpy is not used
    for link in (Link.DRAM_READ, Link.DRAM_WRITE):
        assert 5e9 < links[link].bytes_per_s < 1e12
        assert 0 < links[link].latency_s < 1e-3


def test_bf16_matmul_rate_is_gpu_class():
    _cuda_or_skip()
    flops, info = measure_prefill(quick=True)
    assert info["method"] == "torch bf16 matmul (cuda)"
    assert 10e12 < flops < 2e15
