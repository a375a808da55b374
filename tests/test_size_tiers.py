"""`kvtier size --tiers`: a hit token's worth per tier and SSD wear, worked by hand (issue 28.5)."""

import json

import pytest

from kvtier.cli import main

CAL = {
    "version": 1,
    "control_rtt_s": 0,
    "links": {
        "dram_read": {"bytes_per_s": 5e10, "latency_s": 0},
        "ssd_read": {"bytes_per_s": 1e10, "latency_s": 0},
    },
    "prefill": {"flops_per_s": 1e15},
}


@pytest.fixture
def no_data_dir(tmp_path, monkeypatch):
    """No calibration in the (empty) data dir: the planner's defaults."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path


def tiers(capsys, *args):
    assert main(["size", "--json", "--preset", "Llama-3-8B", "--tiers", *args]) == 0
    return json.loads(capsys.readouterr().out)["tiers"]


def test_worth_per_tier_from_a_calibration(no_data_dir, capsys):
    cal = no_data_dir / "calibration.json"
    cal.write_text(json.dumps(CAL))
    t = tiers(capsys, "--calibration", str(cal))
    # Llama-3-8B, 2,048-token prefix: linear 2 x (7,504,924,672 - 525,336,576) = 13,959,176,192
    #   FLOPs/token x 2,048 = 28,588,392,841,216; attention 32 layers x 2 x 32 x 256 = 16,384 per
    #   pair x 2,048 x 2,049 / 2 pairs = 1,100,048,498,688 -> 29,688,441,339,904 FLOPs
    assert t["recompute_flops"] == 29_688_441_339_904
    # / 2,048 / 1e15 FLOP/s = 14.496309248 us per token
    assert t["recompute_s_per_token"] == pytest.approx(14.496309248e-6, rel=1e-12)
    dram, ssd, remote = (t["tiers"][k] for k in ("dram", "ssd", "remote"))
    # DRAM: 131,072 B / 5e10 B/s = 2.62144 us (latency 0): worth 11.874869248 us
    assert dram["fetch_s_per_token"] == pytest.approx(2.62144e-6, rel=1e-12)
    assert dram["worth_s_per_token"] == pytest.approx(11.874869248e-6, rel=1e-9)
    assert dram["worth_it"]
    # break-even: 2.62144e-6 s x 1e15 FLOP/s x TP 1 / 2 = 1,310,720,000 active params
    assert dram["break_even_active_params"] == pytest.approx(1_310_720_000, rel=1e-12)
    # SSD: 131,072 / 1e10 = 13.1072 us + the 2.62144 us copy = 15.72864 us > 14.496: not worth it
    assert ssd["fetch_s_per_token"] == pytest.approx(15.72864e-6, rel=1e-12)
    assert not ssd["worth_it"]
    # remote (not in the file: default 1.2e9 B/s, 500 us): 109.226666.. + 2.62144 + 0.244140625
    assert remote["fetch_s_per_token"] == pytest.approx(112.092247292e-6, rel=1e-9)
    assert "calibration" in dram["rate_source"] and "default" in remote["rate_source"]


def test_default_rates_and_their_sources(no_data_dir, capsys):
    t = tiers(capsys)
    assert t["rates"]["prefill_flops_per_s"] == pytest.approx(0.6 * 989e12)
    assert t["rates"]["h2d_bytes_per_s"] == 48e9
    assert "kvtier.daemon.rates" in t["prefill_source"]
    # the data dir's calibration is used when present, as serve does
    (no_data_dir / "data" / "kvtier").mkdir(parents=True)
    (no_data_dir / "data" / "kvtier" / "calibration.json").write_text(json.dumps(CAL))
    assert tiers(capsys)["rates"]["prefill_flops_per_s"] == 1e15


def test_ssd_wear_stated_and_from_simulate(no_data_dir, capsys):
    w = tiers(capsys, "--ssd-bytes", "4TB", "--ssd-writes-per-day", "10TB")["ssd_wear"]
    # endurance 4e12 B x 1 DWPD x 365 x 5 = 7.3e15 B; at 1e13 B/day: 730 days
    assert w["endurance_bytes"] == 7.3e15 and w["days_to_endurance"] == pytest.approx(730)
    # serve's budget 4e12 B/day grants 40%, refuses 60%: the drive lasts its 1,825 days
    assert w["budget_refuses_share"] == pytest.approx(0.6)
    assert w["days_to_endurance_under_budget"] == pytest.approx(1825)
    sim = no_data_dir / "sim.json"
    sim.write_text(json.dumps({"ssd_bytes_written": 10**12}))
    w = tiers(
        capsys, "--ssd-bytes", "4TB", "--simulate-json", str(sim), "--trace-seconds", "864"
    )["ssd_wear"]
    # 1e12 B in 864 s = 1e14 B/day: 7.3e15 / 1e14 = 73 days; the budget refuses 96%
    assert w["write_bytes_per_day"] == pytest.approx(1e14)
    assert w["days_to_endurance"] == pytest.approx(73)
    assert w["budget_refuses_share"] == pytest.approx(0.96)


def test_text_names_formula_and_sources(no_data_dir, capsys):
    assert main(["size", "--preset", "Llama-3-8B", "--tiers", "--ssd-bytes", "4TB"]) == 0
    out = capsys.readouterr().out
    assert "what each tier is worth per hit token (2,048-token prefix" in out
    assert "recompute  24.429 us = 2.969e+13 FLOPs / 2,048 tokens / 5.934e+14 FLOP/s" in out
    assert "loses" in out and "NOT worth it, recompute" in out  # the remote tier at 1.2 GB/s
    assert "no write rate given" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ssd-writes-per-day", "1TB"], "needs the drive size"),
        (["--ssd-bytes", "4TB", "--simulate-json", "x.json"], "needs --trace-seconds"),
        (["--ssd-bytes", "4TB", "--simulate-json", "/nonexistent.json", "--trace-seconds", "5"],
         "cannot read"),
        (["--ssd-dwpd", "0"], "--ssd-dwpd must be > 0"),
        (["--calibration", "/nonexistent/cal.json"], "no calibration at"),
    ],
)
def test_bad_tier_options(no_data_dir, capsys, args, message):
    assert main(["size", "--preset", "Llama-3-8B", "--tiers", *args]) == 2
    assert message in capsys.readouterr().err
