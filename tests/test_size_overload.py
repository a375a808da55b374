"""`kvtier size --overload`: a full pool's three ways out, worked by hand (issue 28 item 3)."""

import json

import pytest

from kvtier.cli import main


@pytest.fixture(autouse=True)
def no_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


def overload(capsys, *args):
    assert main(["size", "--json", "--preset", "Llama-3-8B", "--overload", "6144", *args]) == 0
    return json.loads(capsys.readouterr().out)["overload"]


def test_llama3_8b_6k_victim_default_rates(capsys):
    o = overload(capsys)
    # 6,144 tokens = 384 pages; running KV 64 x (2,048 + 256) x 131,072 B = 19,327,352,832 B
    # step (16,060,522,496 + 19,327,352,832) B / 3.35e12 B/s = 10.5635 ms
    assert o["victim_pages"] == 384
    assert o["decode_step_s"] == pytest.approx(35_387_875_328 / 3.35e12)
    # admission: ceil(384 / 160) = 3 completions, one every 512 / 64 = 8 steps: 24 steps
    #   = 0.253525 s, paid by the arriving request
    assert o["admission"]["completions_needed"] == 3
    assert o["admission"]["wait_s"] == pytest.approx(0.253525077, rel=1e-6)
    # recompute: 13,959,176,192 x 6,144 = 85,765,178,523,648 + 524,288 x 18,877,440 =
    #   9,897,215,262,720 -> 95,662,393,786,368 FLOPs / 5.934e14 = 0.16121 s
    assert o["recompute"]["prefill_flops"] == 95_662_393_786_368
    assert o["recompute"]["redo_s"] == pytest.approx(95_662_393_786_368 / 5.934e14)
    # spill: 384 x 2 MiB = 805,306,368 B / 48e9 + 200 us = 16.977 ms each way
    assert o["spill"]["bytes"] == 805_306_368
    assert o["spill"]["out_s"] == pytest.approx(0.016977216)
    assert o["spill"]["back_s"] == pytest.approx(0.016977216)


def test_stated_step_and_text(capsys):
    o = overload(capsys, "--decode-step-ms", "20")
    assert o["admission"]["wait_s"] == pytest.approx(24 * 0.020)
    assert main(["size", "--preset", "Llama-3-8B", "--overload", "6144"]) == 0
    out = capsys.readouterr().out
    assert "admission control  wait 0.254 s = ceil(384 / 160) = 3 completions" in out
    assert "p99 latency rises" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--overload", "0"], "--overload must be >= 1"),
        (["--overload", "6K"], "--overload must be a token count"),
        (["--overload", "100", "--decode-step-ms", "-1"], "--decode-step-ms must be > 0"),
    ],
)
def test_bad_overload(capsys, args, message):
    assert main(["size", "--preset", "Llama-3-8B", *args]) == 2
    assert message in capsys.readouterr().err
