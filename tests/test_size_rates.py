"""`kvtier size`: rates stated on the command line, used by --overload, --tiers and --pd, each
printed with its source; bad values are one line and exit 2. Expected values worked by hand."""

import json

import pytest

from kvtier.cli import main


@pytest.fixture(autouse=True)
def no_data_dir(tmp_path, monkeypatch):
    """No calibration in the (empty) data dir: defaults unless stated."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path


def size(capsys, *args):
    assert main(["size", "--json", "--preset", "Llama-3-8B", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_overload_spills_and_recomputes_at_the_stated_rates(capsys):
    o = size(capsys, "--overload", "6144", "--d2h-bytes-per-s", "12GB", "--h2d-bytes-per-s",
             "24GB", "--prefill-flops-per-s", "1e15")["overload"]
    # 805,306,368 B / 12e9 B/s = 67.108864 ms + 200 us latency (the default, unchanged)
    assert o["spill"]["out_s"] == pytest.approx(0.067308864)
    # / 24e9 B/s = 33.554432 ms + 200 us
    assert o["spill"]["back_s"] == pytest.approx(0.033754432)
    # 95,662,393,786,368 FLOPs / 1e15 FLOP/s = 95.662 ms
    assert o["recompute"]["redo_s"] == pytest.approx(0.095662393786368)
    assert o["recompute"]["rate_source"] == "stated: --prefill-flops-per-s 1e15"
    assert o["spill"]["rate_source"] == (
        "d2h stated: --d2h-bytes-per-s 12GB; latency 0.0002 s default; "
        "h2d stated: --h2d-bytes-per-s 24GB; latency 0.0002 s default"
    )
    # the victim's gap: max(67.309 ms out, 253.525 ms wait) + 33.754 ms back = 287.280 ms
    assert o["spill"]["p99_effect_s"] == pytest.approx(0.287279509, rel=1e-6)


def test_tiers_price_the_stated_ssd_and_remote_reads(capsys):
    t = size(capsys, "--tiers", "--ssd-read-bytes-per-s", "3GB", "--remote-read-bytes-per-s",
             "12.5GB")["tiers"]
    # SSD: 131,072 B / 3e9 = 43.690667 us + 131,072 / 48e9 = 2.730667 us + (300 + 200) us / 2,048
    #   = 0.244141 us -> 46.665474 us per token
    assert t["tiers"]["ssd"]["fetch_s_per_token"] == pytest.approx(46.665474e-6, rel=1e-7)
    # remote: 131,072 / 12.5e9 = 10.48576 us + 2.730667 + (500 + 200) us / 2,048 = 0.341797
    #   -> 13.558223 us
    assert t["tiers"]["remote"]["fetch_s_per_token"] == pytest.approx(13.558223e-6, rel=1e-7)
    assert t["tiers"]["ssd"]["rate_source"] == (
        "stated: --ssd-read-bytes-per-s 3GB; latency 0.0003 s default"
    )
    assert t["tiers"]["dram"]["rate_source"].startswith("default (4.8e+10 B/s")


def test_pd_at_a_stated_prefill_rate(capsys):
    d = size(capsys, "--pd", "--prompt-tokens", "8192", "--prefill-flops-per-s", "1e15")["pd"]
    # 131,947,904,892,928 FLOPs / 1e15 = 0.131948 s; 1,073,741,824 B / 0.131948 s = 65.10 Gb/s
    assert d["prefill_s"] == pytest.approx(0.131947904892928)
    assert round(d["hide_gbps"], 2) == 65.10
    assert d["flops_source"] == "stated: --prefill-flops-per-s 1e15"


def test_a_stated_rate_beats_the_calibration_file(no_data_dir, capsys):
    cal = no_data_dir / "cal.json"
    cal.write_text(json.dumps({"version": 1, "links": {
        "dram_read": {"bytes_per_s": 5e10, "latency_s": 1e-4}}}))
    t = size(capsys, "--tiers", "--calibration", str(cal), "--h2d-bytes-per-s",
             "25GB")["tiers"]
    # 131,072 B / 25e9 = 5.24288 us + the calibration's 100 us latency / 2,048 = 0.048828 us
    assert t["tiers"]["dram"]["fetch_s_per_token"] == pytest.approx(5.291708e-6, rel=1e-6)
    assert t["tiers"]["dram"]["rate_source"] == (
        "stated: --h2d-bytes-per-s 25GB; latency 0.0001 s calibration"
    )


def test_text_names_the_stated_source(capsys):
    assert main(["size", "--preset", "Llama-3-8B", "--tiers", "--ssd-read-bytes-per-s",
                 "3GB"]) == 0
    out = capsys.readouterr().out
    assert "[stated: --ssd-read-bytes-per-s 3GB; latency 0.0003 s default]" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tiers", "--h2d-bytes-per-s", "0"], "--h2d-bytes-per-s must be > 0, got 0"),
        (["--tiers", "--ssd-read-bytes-per-s", "fast"], "--ssd-read-bytes-per-s: cannot read"),
        (["--tiers", "--remote-read-bytes-per-s=-1GB"], "is negative"),
        (["--tiers", "--d2h-bytes-per-s", "100"], "100 without a unit would be 100 bytes"),
        (["--overload", "100", "--d2h-bytes-per-s", "20TB"], "is beyond any link"),
        (["--pd", "--prefill-flops-per-s", "0"], "--prefill-flops-per-s must be > 0"),
        (["--pd", "--prefill-flops-per-s", "lots"], "--prefill-flops-per-s must be a number"),
        (["--pd", "--prefill-flops-per-s", "nan"], "--prefill-flops-per-s must be > 0"),
        (["--pd", "--prefill-flops-per-s", "1e18"], "is beyond any GPU"),
    ],
)
def test_bad_stated_rates_are_one_line(capsys, args, message):
    assert main(["size", "--preset", "Llama-3-8B", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
