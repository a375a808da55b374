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


def test_p99_effect_per_option(capsys):
    o = overload(capsys)
    assert "more than 1% of requests pay it" in o["p99_condition"]
    ad, rc, sp = o["admission"], o["recompute"], o["spill"]
    # admission: the arriving request's TTFT waits the 24 steps, 0.253525 s
    assert "arriving request's time to first token" in ad["p99_on"]
    assert ad["p99_effect_s"] == pytest.approx(0.253525077, rel=1e-6)
    assert ad["p99_also"] == []
    # recompute: the victim waits for the same 3 completions, then redoes 0.161211 s of prefill:
    #   0.253525 + 0.161211 = 0.414736 s between two of its tokens
    assert "victim's inter-token gap" in rc["p99_on"]
    assert rc["p99_effect_s"] == pytest.approx(0.414735717, rel=1e-6)
    # the whole prompt in one step (--prefill-chunk 0): that one step of every running request
    #   is 10.5635 + 161.2110 = 171.7745 ms, x16.26 a plain decode step
    slow = rc["step_slowdown"]
    assert slow["prefill_steps"] == 1
    assert slow["shared_step_s"] == pytest.approx(0.1717745, rel=1e-5)
    assert slow["factor"] == pytest.approx(16.261, rel=1e-4)
    (running,) = rc["p99_also"]
    assert "every running request's inter-token gap" in running["on"]
    assert running["effect_s"] == pytest.approx(0.161211, rel=1e-5)
    # spill: the victim is out of the pool from its eviction until the 3 completions (0.2535 s,
    #   longer than the 16.98 ms way out), then 16.98 ms back: 0.270502 s
    assert "victim's inter-token gap" in sp["p99_on"]
    assert sp["p99_effect_s"] == pytest.approx(0.270502293, rel=1e-6)
    # and the arriving request waits for the way out before the pages are free: 16.977 ms
    (arriving,) = sp["p99_also"]
    assert "arriving request's time to first token" in arriving["on"]
    assert arriving["effect_s"] == pytest.approx(0.016977216)


def test_chunked_prefill_spreads_the_recompute(capsys):
    o = overload(capsys, "--prefill-chunk", "2048")
    slow = o["recompute"]["step_slowdown"]
    # ceil(6,144 / 2,048) = 3 shared steps, each 161.2110 / 3 = 53.7369 ms longer:
    #   10.5635 + 53.7369 = 64.3004 ms, x6.087
    assert slow["prefill_steps"] == 3
    assert o["recompute"]["p99_also"][0]["effect_s"] == pytest.approx(0.0537369, rel=1e-5)
    assert slow["shared_step_s"] == pytest.approx(0.0643004, rel=1e-5)
    assert slow["factor"] == pytest.approx(6.0870, rel=1e-4)
    # the victim's own gap is the same: it still redoes all of it
    assert o["recompute"]["p99_effect_s"] == pytest.approx(0.414735717, rel=1e-6)


def test_spill_when_the_way_out_outlasts_the_wait(capsys):
    # a 0.0001 ms step: the wait is 24 x 1e-7 s = 2.4 us, shorter than the 16.977 ms way out, so
    #   the victim's gap is out + back = 2 x 16.977216 ms = 33.954432 ms
    o = overload(capsys, "--decode-step-ms", "0.0001")
    assert o["admission"]["wait_s"] == pytest.approx(2.4e-6)
    assert o["spill"]["p99_effect_s"] == pytest.approx(0.033954432)


def test_stated_step_and_text(capsys):
    o = overload(capsys, "--decode-step-ms", "20")
    assert o["admission"]["wait_s"] == pytest.approx(24 * 0.020)
    # 0.48 s wait + 0.161211 s redo
    assert o["recompute"]["p99_effect_s"] == pytest.approx(0.641211, rel=1e-5)
    assert main(["size", "--preset", "Llama-3-8B", "--overload", "6144"]) == 0
    out = capsys.readouterr().out
    assert "admission control  wait 0.254 s = ceil(384 / 160) = 3 completions" in out
    assert "p99: the arriving request's time to first token +0.254 s" in out
    assert "p99: the victim's inter-token gap (and end-to-end) +0.415 s = re-admission wait " \
        "0.254 s (the same 3 completions) + redo 0.161 s" in out
    assert "a shared step 10.564 ms + 161.211 ms / 1 [the whole prompt in one step " \
        "(--prefill-chunk 0)] = 171.774 ms (x16.26)" in out
    assert "p99: the victim's inter-token gap (and end-to-end) +0.271 s = max(out 0.0170 s, " \
        "re-admission wait 0.254 s) + back 0.0170 s" in out
    assert "more than 1% of requests pay it" in out


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
