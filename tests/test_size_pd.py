"""`kvtier size --pd`: KV moved per request and the link that hides it, worked by hand (28.4)."""

import json

import pytest

from kvtier.cli import main
from kvtier.commands.size_pd import request_bytes
from kvtier.core.presets import get_preset


@pytest.fixture(autouse=True)
def no_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path


def pd(capsys, *args):
    assert main(["size", "--json", "--pd", *args]) == 0
    return json.loads(capsys.readouterr().out)["pd"]


def test_request_bytes_full_and_window():
    # Llama-3-8B, 8,192 tokens: 8,192 x 131,072 B = 1,073,741,824 B
    assert request_bytes(get_preset("Llama-3-8B").layout(), 8192)[0] == 1_073_741_824
    # gpt-oss-20b: 12 full layers x 2,048 B x 8,192 + 12 window layers x 2,048 B x min(8,192, 128)
    #   = 201,326,592 + 3,145,728 = 204,472,320 B
    assert request_bytes(get_preset("gpt-oss-20b").layout(), 8192)[0] == 204_472_320


def test_llama3_8b_link_at_default_and_calibrated_rates(no_data_dir, capsys):
    d = pd(capsys, "--preset", "Llama-3-8B", "--prompt-tokens", "8192")
    # FLOPs: 13,959,176,192 x 8,192 = 114,353,571,364,864 linear + 32 x 16,384 x (8,192 x 8,193
    #   / 2 = 33,558,528) = 17,594,333,528,064 attention -> 131,947,904,892,928
    assert d["prefill_flops"] == 131_947_904_892_928
    # at 0.6 x 989e12 = 5.934e14 FLOP/s: 0.222359 s; 1,073,741,824 B / 0.222359 s = 38.63 Gb/s
    seconds = 131_947_904_892_928 / 5.934e14
    assert d["hide_gbps"] == pytest.approx(1_073_741_824 * 8 / seconds / 1e9)
    assert round(d["hide_gbps"], 1) == 38.6
    assert d["hidden_by"] == ["100 Gb/s", "200 Gb/s", "400 Gb/s", "NVLink 4"]
    cal = no_data_dir / "cal.json"
    cal.write_text(json.dumps({"version": 1, "links": {}, "prefill": {"flops_per_s": 1e15}}))
    fast = pd(
        capsys, "--preset", "Llama-3-8B", "--prompt-tokens", "8192", "--calibration", str(cal)
    )
    # 1e15 FLOP/s: 0.131948 s -> 8.1376e9 B/s = 65.10 Gb/s
    assert round(fast["hide_gbps"], 2) == 65.10


def test_table_covers_presets_and_gpus(capsys):
    d = pd(capsys, "--preset", "Llama-3-8B", "--prompt-tokens", "8192")
    rows = {r["model"]: r for r in d["table"]}
    assert set(rows) >= {"Llama-3-8B", "DeepSeek-V3", "gpt-oss-120b"}
    # the H100 cell of Llama-3-8B is the same figure as the model line (TP 1, default rate)
    assert rows["Llama-3-8B"]["gbps"]["H100"] == pytest.approx(d["hide_gbps"], rel=1e-3)
    # a B200 (2.25 PF dense) needs 2250 / 989.4 times an H100's link
    ratio = rows["Llama-3-8B"]["gbps"]["B200"] / rows["Llama-3-8B"]["gbps"]["H100"]
    assert ratio == pytest.approx(2250 / 989.4)
    assert rows["Llama-3-8B"]["hidden_by"]["A100"][0] == "25 Gb/s"


def test_text(capsys):
    assert main(["size", "--preset", "Llama-3-8B", "--pd", "--prompt-tokens", "8192"]) == 0
    out = capsys.readouterr().out
    assert "KV moved per request, one rank  1,073,741,824 B = 8,192 x 131,072 B" in out
    assert "link per rank that hides it     38.6 Gb/s" in out


def test_table_rows_beyond_llama_worked_by_hand(capsys):
    rows = {r["model"]: r for r in pd(capsys, "--preset", "Llama-3-8B", "--prompt-tokens",
                                        "8192")["table"]}
    # DeepSeek-V3 (MLA) on an H100, 8,192 tokens, bf16, TP 1:
    #   KV: 61 layers x (512 + 64) x 2 B = 70,272 B/token x 8,192 = 575,668,224 B
    #   linear: 2 x (36,625,618,432 - 129,280 x 7,168) = 71,397,878,784 FLOPs/token x 8,192
    #     = 584,891,422,998,528
    #   attention: 61 x 2 x 128 heads x (192 + 128) = 4,997,120 per pair x 8,192 x 8,193 / 2
    #     = 33,558,528 pairs -> 167,695,991,439,360; total 752,587,414,437,888 FLOPs
    #   at 0.6 x 989.4e12 = 5.9364e14 FLOP/s: 1.267751 s; 575,668,224 B / 1.267751 s
    #     = 454.09e6 B/s = 3.633 Gb/s: a 25 Gb/s NIC hides it
    seconds = 752_587_414_437_888 / 5.9364e14
    assert rows["DeepSeek-V3"]["gbps"]["H100"] == pytest.approx(575_668_224 * 8 / seconds / 1e9)
    assert round(rows["DeepSeek-V3"]["gbps"]["H100"], 3) == 3.633
    assert rows["DeepSeek-V3"]["hidden_by"]["H100"][0] == "25 Gb/s"
    # gpt-oss-120b (alternating sliding 128 / full) on an A100:
    #   KV: 2 x 8 heads x 64 x 2 B = 2,048 B per layer and token; 18 full layers x 8,192 tokens
    #     + 18 sliding layers x 128 tokens = 301,989,888 + 4,718,592 = 306,708,480 B
    #   linear: 2 x (5,132,849,472 - 201,088 x 2,880) = 9,107,432,064 x 8,192
    #     = 74,608,083,468,288
    #   attention: 2 x 64 x (64 + 64) = 16,384 per pair and layer; full 18 x 16,384 x 33,558,528
    #     = 9,896,812,609,536; sliding 18 x 16,384 x (128 x 129 / 2 + 8,064 x 128 = 1,040,448)
    #     = 306,840,600,576; total 84,811,736,678,400 FLOPs
    #   at 0.6 x 312e12 = 1.872e14 FLOP/s: 0.453054 s -> 676.98e6 B/s = 5.416 Gb/s
    seconds = 84_811_736_678_400 / 1.872e14
    assert rows["gpt-oss-120b"]["gbps"]["A100"] == pytest.approx(306_708_480 * 8 / seconds / 1e9)
    assert round(rows["gpt-oss-120b"]["gbps"]["A100"], 3) == 5.416
    # Llama-3-8B on a B200 (2,250 TFLOP/s dense x 0.6 = 1.35e15): 131,947,904,892,928 FLOPs in
    #   0.097739 s; 1,073,741,824 B / 0.097739 s = 87.89 Gb/s: over 25 Gb/s, under 100
    seconds = 131_947_904_892_928 / 1.35e15
    assert rows["Llama-3-8B"]["gbps"]["B200"] == pytest.approx(1_073_741_824 * 8 / seconds / 1e9)
    assert rows["Llama-3-8B"]["hidden_by"]["B200"] == ["100 Gb/s", "200 Gb/s", "400 Gb/s",
                                                       "NVLink 4"]


def test_every_gpu_peak_and_link_rate_names_its_source(capsys):
    d = pd(capsys, "--preset", "Llama-3-8B")
    assert set(d["gpu_sources"]) == set(d["gpus_tflops"])
    assert set(d["link_sources"]) == set(d["links"])
    assert "datasheet" in d["gpu_sources"]["H100"] and "1,979" in d["gpu_sources"]["H100"]
    assert "900 GB/s" in d["link_sources"]["NVLink 4"]
    assert "kvtier.daemon.rates" in d["mfu_source"]
    assert main(["size", "--preset", "Llama-3-8B", "--pd"]) == 0
    out = capsys.readouterr().out
    assert "    B200      2250 TFLOP/s  [HGX B200 datasheet: FP16/BF16 tensor 4.5 PFLOPS with " \
        "sparsity per GPU / 2]" in out
    assert "    100 Gb/s  1.25e+10 B/s  [Ethernet/InfiniBand EDR line rate / 8 bits, one " \
        "way]" in out
    assert "    NVLink 4  4.5e+11 B/s  [H100 SXM datasheet: NVLink 900 GB/s per GPU both ways " \
        "/ 2]" in out


def test_what_kvtier_moves_in_whole_blocks(capsys):
    """The bench's model (8 layers, 4 KV heads of 64, bf16, 32-token blocks): 256 KiB blocks;
    an 8,192-token prompt stores 256 of them and loads 255 (the last token is computed)."""
    d = pd(capsys, "--layers", "8", "--kv-heads", "4", "--head-dim", "64", "--params", "1e8",
           "--block-tokens", "32", "--prompt-tokens", "8192")
    k = d["kvtier"]
    assert k["block_bytes"] == 2 * 8 * 4 * 64 * 2 * 32 == 262_144
    assert (k["stored_blocks"], k["loaded_blocks"]) == (256, 255)
    assert k["stored_bytes"] == 256 * 262_144 and k["loaded_bytes"] == 255 * 262_144
    assert k["remote_write_bytes"] == 256 * (262_144 + 64)
    assert k["remote_read_bytes"] == k["loaded_bytes"]
    assert main(["size", "--pd", "--layers", "8", "--kv-heads", "4", "--head-dim", "64",
                 "--params", "1e8", "--block-tokens", "32", "--prompt-tokens", "8193"]) == 0
    assert "stored 256 blocks = 67,108,864 B, loaded 256" in capsys.readouterr().out
