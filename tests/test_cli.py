import subprocess
import sys

from kvtier.cli import main


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: kvtier" in capsys.readouterr().out


def test_unknown_command_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "no-such-command"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
    assert "Traceback" not in proc.stderr


def _fake_venv(root, log):
    """A venv whose python records every call (an install would be one) and whose kvtier
    records its arguments."""
    import os

    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "kvtier"):
        exe = bin_dir / name
        exe.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n')
        os.chmod(exe, 0o755)


def test_help_never_changes_the_environment(tmp_path):
    """`bin/kvtier demo --help` (and any --help/--version) installs nothing: with a venv it runs
    that venv's kvtier as it is; without one it says so and creates none."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bin" / "kvtier"
    log = tmp_path / "calls.log"
    venv = tmp_path / "venv"
    _fake_venv(venv, log)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KVTIER_VENV": str(venv)}
    for args in (["demo", "--help"], ["serve", "-h"], ["--version"], ["demo", "--turns", "2",
                                                                      "--help"]):
        log.unlink(missing_ok=True)
        proc = subprocess.run([str(script), *args], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert log.read_text().splitlines() == ["kvtier " + " ".join(args)]  # no python -m pip
        assert not any(p.name.startswith(".kvtier-") for p in venv.iterdir())
    missing = tmp_path / "no-venv"
    proc = subprocess.run([str(script), "demo", "--help"], capture_output=True, text=True,
                          env={**env, "KVTIER_VENV": str(missing)}, timeout=60)
    assert proc.returncode == 2 and "no environment in" in proc.stderr
    assert not missing.exists()
    log.unlink(missing_ok=True)  # without --help the same script does install (the contrast)
    subprocess.run([str(script), "demo"], env=env, capture_output=True, timeout=60)
    assert any(line.startswith("python -m pip install") for line in log.read_text().splitlines())
