"""`kvtier calibrate --quick`: real measurements, the JSON file, loading it, and bad input."""

import json
import math
import subprocess
import sys

import pytest

from kvtier.cli import main
from kvtier.core.errors import UsageError
from kvtier.daemon.rates.book import Link, LinkRate, RateBook
from kvtier.daemon.rates.calibrate import (
    CONTROL_RTT_S,
    Calibration,
    calibration_path,
    load_calibration,
    load_calibration_if_present,
    measure_ssd_read,
    run_calibration,
    save_calibration,
)


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "calibrate", *args],
        capture_output=True, text=True, timeout=240, env=env,
    )


def test_quick_calibration_writes_json_the_daemon_loads(tmp_path):
    proc = _cli("--quick", "--json", "--data-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    path = calibration_path(tmp_path)
    assert out["path"] == str(path)
    on_disk = json.loads(path.read_text())
    assert on_disk["version"] == 1 and on_disk["quick"] is True
    assert set(on_disk["links"]) == {"dram_read", "dram_write", "ssd_read"}
    for entry in on_disk["links"].values():
        assert entry["bytes_per_s"] > 1e6 and 0 <= entry["latency_s"] < 1
    assert on_disk["prefill"]["flops_per_s"] > 1e8
    # the temp file of the SSD measurement is gone; only the result remains
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]

    cal = load_calibration_if_present(tmp_path)
    assert cal is not None
    assert cal.links[Link.SSD_READ].bytes_per_s == on_disk["links"]["ssd_read"]["bytes_per_s"]
    book = RateBook.from_calibration(cal)
    rates = book.snapshot()
    assert rates.ssd_bytes_per_s == on_disk["links"]["ssd_read"]["bytes_per_s"]
    assert rates.h2d_latency_s == pytest.approx(
        on_disk["links"]["dram_read"]["latency_s"] + CONTROL_RTT_S
    )
    assert rates.prefill_flops_per_s == on_disk["prefill"]["flops_per_s"]


def test_skip_and_no_save_and_default_data_dir_from_env(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_DATA_DIR", str(tmp_path / "dd"))
    assert main(["calibrate", "--quick", "--skip", "prefill", "--skip", "copy"]) == 0
    out = capsys.readouterr().out
    assert "ssd_read" in out and "prefill" not in out
    cal = load_calibration(tmp_path / "dd" / "calibration.json")
    assert set(cal.links) == {Link.SSD_READ} and cal.prefill_flops_per_s is None
    assert main(["calibrate", "--quick", "--skip", "ssd", "--skip", "prefill", "--no-save",
                 "--data-dir", str(tmp_path / "other")]) == 0
    assert not (tmp_path / "other" / "calibration.json").exists()


@pytest.mark.parametrize(
    "argv",
    [["--skip", "gpu"], ["--quick", "--frobnicate"], ["--skip", "copy", "--skip", "ssd",
                                                     "--skip", "prefill"]],
)
def test_bad_flags_exit_2(argv, tmp_path):
    proc = _cli(*argv, "--data-dir", str(tmp_path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "calibration.json").exists()


def test_data_dir_that_is_a_file_exits_2(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    proc = _cli("--quick", "--data-dir", str(f))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("kvtier calibrate: error:")
    assert f.read_text() == "x"


def test_ssd_measurement_in_an_impossible_dir_is_a_usage_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="data dir"):
        measure_ssd_read(tmp_path / "f" / "sub", 4 << 20)


def test_in_process_run_and_roundtrip(tmp_path):
    cal = run_calibration(tmp_path, quick=True, skip=("prefill",), progress=False)
    assert cal.links[Link.DRAM_READ].bytes_per_s > 1e6
    save_calibration(cal, tmp_path / "c.json")
    again = load_calibration(tmp_path / "c.json")
    assert again.links == cal.links
    assert again.prefill_flops_per_s is None
    assert again.control_rtt_s == CONTROL_RTT_S


def _doc(**over):
    doc = {
        "version": 1, "control_rtt_s": 1e-4,
        "links": {"ssd_read": {"bytes_per_s": 2e9, "latency_s": 1e-4}},
        "prefill": {"flops_per_s": 1e14},
    }
    doc.update(over)
    return doc


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "cannot read"),
        (json.dumps(_doc(version=2)), "version-1"),
        (json.dumps([1, 2]), "version-1"),
        (json.dumps(_doc(links={"nvme": {"bytes_per_s": 1, "latency_s": 0}})), "unknown link"),
        (json.dumps(_doc(links={"ssd_read": {"bytes_per_s": -1, "latency_s": 0}})), "> 0"),
        (json.dumps(_doc(links={"ssd_read": {"bytes_per_s": "fast", "latency_s": 0}})), "> 0"),
        (json.dumps(_doc(links={"ssd_read": {"bytes_per_s": 1e9}})), "latency_s"),
        (json.dumps(_doc(prefill={"flops_per_s": 0})), "flops_per_s"),
        (json.dumps(_doc(links=[])), "links"),
    ],
)
def test_malformed_files_raise_usage_error(tmp_path, content, match):
    p = tmp_path / "calibration.json"
    p.write_text(content)
    with pytest.raises(UsageError, match=match):
        load_calibration(p)


def test_missing_file():
    with pytest.raises(UsageError, match="kvtier calibrate"):
        load_calibration("/nonexistent/calibration.json")
    assert load_calibration_if_present("/nonexistent") is None


def test_seed_links_add_the_control_round_trip():
    cal = Calibration({Link.SSD_READ: LinkRate(2e9, 1e-4)}, 1e14, control_rtt_s=5e-5)
    book = RateBook.from_calibration(cal)
    assert book.latency(Link.SSD_READ) == pytest.approx(1.5e-4)
    assert book.bandwidth(Link.SSD_READ) == 2e9
    # unmeasured links keep the physics defaults
    assert book.bandwidth(Link.DRAM_READ) == 48e9
    assert math.isclose(book.prefill_flops_per_s(), 1e14)


def test_progress_bar_only_on_a_terminal(tmp_path):
    """A log (stderr to a file or pipe) gets no tqdm carriage returns; a terminal gets the bar."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    args = ["--quick", "--skip", "copy", "--skip", "prefill", "--no-save",
            "--data-dir", str(tmp_path)]
    piped = _cli(*args)
    assert piped.returncode == 0, piped.stderr
    assert "step/s" not in piped.stderr and "calibrate" not in piped.stderr  # (text mode: no \r)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    seen = b""
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier", "calibrate", *args],
                                stdout=subprocess.DEVNULL, stderr=follower)
        os.close(follower)
        while select.select([leader], [], [], 60)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(60) == 0
    finally:
        os.close(leader)
    assert b"calibrate" in seen and b"\r" in seen
