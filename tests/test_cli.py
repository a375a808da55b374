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
