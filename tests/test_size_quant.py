"""Quantized KV with scales by layout (core.kvquant, `size --scale-layout`), worked by hand."""

import json

import pytest

from kvtier.cli import main
from kvtier.core.errors import UsageError
from kvtier.core.kvquant import ScaleLayout, quantized_bytes
from kvtier.core.layout import DType
from kvtier.core.presets import get_preset

LLAMA8_FP8 = get_preset("Llama-3-8B").layout(dtype=DType.FP8)


@pytest.mark.parametrize(
    ("scales", "per_token", "residual"),
    [
        # 32 layers x 2 x 8 heads x 128 x 1 B = 65,536 B; scales 2 per layer outside the cache
        (ScaleLayout.PER_TENSOR, 65_536, 0),
        # + 32 x 2 x 8 x 4 B = 2,048 B of fp32 scales inline (vLLM's *_per_token_head)
        (ScaleLayout.PER_TOKEN, 67_584, 0),
        # + 32 x 2 x 8 x 128 x 4 B / 16 tokens = 16,384 B; residual 32 x 2 x 15 x 8 x 128 x 2 B
        (ScaleLayout.PER_CHANNEL, 81_920, 1_966_080),
        # keys per channel 32 x 8 x 128 x 4 / 16 = 8,192 + values per token 32 x 8 x 4 = 1,024;
        # residual keys only: 32 x 15 x 8 x 128 x 2 B = 983,040
        (ScaleLayout.K_CHANNEL_V_TOKEN, 74_752, 983_040),
    ],
)
def test_llama3_8b_fp8_by_scale_layout(scales, per_token, residual):
    q = quantized_bytes(LLAMA8_FP8, scales)
    assert q.total_bytes == per_token
    assert q.bf16_bytes == 131_072
    assert q.residual_bytes_per_sequence == residual


def test_mla_latent():
    ds = get_preset("DeepSeek-V3").layout(dtype=DType.FP8)
    # 61 layers x 576 x 1 B = 35,136 B; per token one 4 B scale per layer: + 244 B
    assert quantized_bytes(ds, ScaleLayout.PER_TENSOR).total_bytes == 35_136
    assert quantized_bytes(ds, ScaleLayout.PER_TOKEN).total_bytes == 35_136 + 244
    # per channel: 61 x 576 x 4 / 16 = 8,784 B
    assert quantized_bytes(ds, ScaleLayout.PER_CHANNEL).total_bytes == 35_136 + 8_784


def quant(capsys, *args):
    assert main(["size", "--json", "--preset", "Llama-3-8B", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_per_token_scales_are_in_the_pages(capsys):
    r = quant(capsys, "--dtype", "fp8", "--scale-layout", "per-token")
    assert r["quantized"]["bytes_per_token"] == 67_584 and r["quantized"]["in_pages"]
    # the layout carries the 4 B scales: 2 x 32 x 8 x (128 + 4) = 67,584 B/token in pages
    assert r["kv_bytes_per_token"] == 67_584
    r = quant(capsys, "--dtype", "int8", "--scale-layout", "k-channel-v-token")
    assert r["dtype"] == "int8" and r["quantized"]["bytes_per_token"] == 74_752
    assert not r["quantized"]["in_pages"] and r["kv_bytes_per_token"] == 65_536


def test_cli_bad_input(capsys):
    assert main(["size", "--preset", "Llama-3-8B", "--scale-layout", "per-token"]) == 2
    assert "needs --dtype fp8 or int8" in capsys.readouterr().err
    assert main(["size", "--preset", "Llama-3-8B", "--dtype", "fp8", "--scale-layout", "x"]) == 2
    assert "unknown scale layout 'x'" in capsys.readouterr().err
    with pytest.raises(UsageError):
        quantized_bytes(LLAMA8_FP8, ScaleLayout.PER_TOKEN, scale_bytes=0)


def test_int8_is_named_int8_everywhere() -> None:
    """Defect: `--dtype int8` sized int8 KV as fp8 and printed "fp8" in the layout line (and
    gave it fp8's fingerprint)."""
    import json
    import subprocess
    import sys

    def size(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvtier", "size", "--preset", "Llama-3-8B",
                               *args], capture_output=True, text=True, timeout=60)

    table = size("--dtype", "int8")
    assert table.returncode == 0, table.stderr
    assert "fp8" not in table.stdout
    assert "8 KV heads (8 on rank) x 128, int8, 16-token blocks" in table.stdout
    as_int8 = json.loads(size("--dtype", "int8", "--json").stdout)
    as_fp8 = json.loads(size("--dtype", "fp8", "--json").stdout)
    assert as_int8["dtype"] == "int8" and "int8" in as_int8["model"]["layers"]
    assert as_int8["kv_bytes_per_token"] == as_fp8["kv_bytes_per_token"] == 65_536  # 1 B each
    assert as_int8["fingerprint"] != as_fp8["fingerprint"]
    per_token = json.loads(size("--dtype", "int8", "--scale-layout", "per-token",
                                "--json").stdout)
    # vLLM's int8_per_token_head: a 4 B scale after each head's K and V, in the pages:
    # 2 x 32 layers x 8 heads x (128 + 4) B = 67,584 B
    assert per_token["kv_bytes_per_token"] == 67_584
