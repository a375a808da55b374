"""tests/conftest.py's guards, run on small suites in a pytest subprocess: a skip under bin/test
(KVTIER_REQUIRE_ALL=1) fails unless the machine cannot help it; files left in the system temp dir
fail the session; the summary counts the tests of each marker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import os, tempfile
import pytest

def test_runs():
    pass

@pytest.mark.vllm
def test_marked():
    pass

def test_trace_missing():
    pytest.skip("sample trace not present")

def test_no_gpu():
    pytest.skip("no CUDA device")
'''


def run(tmp: Path, files: dict[str, str], require_all: bool) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (tmp / name).write_text(text)
    (tmp / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: v\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVTIER_REQUIRE_ALL", None)
    if require_all:
        env["KVTIER_REQUIRE_ALL"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-rs", str(tmp)], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_skip_fails_under_bin_test_unless_the_machine_cannot_help_it(tmp_path: Path) -> None:
    plain = run(tmp_path, {"test_suite.py": SUITE}, require_all=False)
    assert plain.returncode == 0, plain.stdout
    assert "2 passed, 2 skipped" in plain.stdout
    strict = run(tmp_path, {"test_suite.py": SUITE}, require_all=True)
    assert strict.returncode == 1, strict.stdout
    assert "skipped under bin/test (KVTIER_REQUIRE_ALL=1)" in strict.stdout
    assert "sample trace not present" in strict.stdout
    assert "1 failed, 2 passed, 1 skipped" in strict.stdout  # the CUDA skip stays a skip
    assert "tests by marker: vllm 1 (1 passed); unmarked 3 (1 failed, 1 passed, 1 skipped)" in (
        strict.stdout), strict.stdout


def test_a_module_skipped_at_collection_fails_under_bin_test(tmp_path: Path) -> None:
    files = {"test_mod.py": 'import pytest\npytest.importorskip("kvtier_no_such_module")\n'
                            "def test_x():\n    pass\n",
             "test_other.py": "def test_y():\n    pass\n"}
    assert run(tmp_path, files, require_all=False).returncode == 0
    strict = run(tmp_path, files, require_all=True)
    assert strict.returncode != 0
    assert "could not import 'kvtier_no_such_module'" in strict.stdout


def test_files_left_in_the_system_temp_dir_fail_the_session(tmp_path: Path) -> None:
    leak = ("import socket, tempfile, os\n"
            "def test_leak():\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    s.bind(os.path.join(tempfile.gettempdir(), 'engine.sock'))\n"
            "def test_clean(tmp_path):\n"
            "    (tmp_path / 'f').write_text('x')\n")
    out = run(tmp_path, {"test_leak.py": leak}, require_all=False)
    assert out.returncode == 1, out.stdout
    assert "tests left files in the system temp dir" in out.stdout
    assert "engine.sock" in out.stdout and "2 passed" in out.stdout
    clean = run(tmp_path, {"test_leak.py": leak.replace("s.bind", "0 and s.bind")},
                require_all=False)
    assert clean.returncode == 0, clean.stdout
