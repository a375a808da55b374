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
