"""What a user installs and cites: one version (kvtier/_version.py) everywhere it is shown, the
license, the changelog, the project's URLs; install instructions that never name a package index
entry kvtier does not publish; and the project's own environments taking torch's CPU build by
version, never PyPI's CUDA build. (The wheel and sdist themselves: tests/test_deploy.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvtier._version import __version__

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_has_one_source() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "kvtier._version.__version__"}
    shown = subprocess.run([sys.executable, "-m", "kvtier", "--version"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shown.returncode == 0 and shown.stdout == f"kvtier {__version__}\n", shown
    # no module spells the version out again
    for path in (ROOT / "kvtier").rglob("*.py"):
        if path.name != "_version.py" and "_proto" not in path.parts:
            assert __version__ not in path.read_text(), path


def test_changelog_starts_with_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+)", text, flags=re.M)
    assert first is not None and first.group(1) == __version__


def test_license_and_urls() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    urls = PYPROJECT["project"]["urls"]
    assert {"Homepage", "Documentation", "Changelog"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())


INSTALL = re.compile(r"pip3? install\b([^\n`]*)")


def package_targets(args: str) -> list[str]:
    """The requirement arguments of a `pip install ...` command line (options and their values,
    paths, URLs and wheel files left out)."""
    words = [w.strip("'\"") for w in args.replace("\\", " ").split()]
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in ("-r", "-c", "-e", "--index-url", "--extra-index-url", "-i", "--find-links",
                 "-f", "--constraint", "--requirement", "--editable", "-t", "--target"):
            skip = True
            continue
        if w.startswith(("-", "/", ".", "$", "http", "dist/", "*")) or ".whl" in w:
            continue
        if w in ("&&", "||", ";", "|", "#") or w.startswith("#"):
            break
        out.append(w)
    return out


def shipped_text_files() -> list[Path]:
    """What users read or run: README, the docs (not the measurement log), CHANGELOG, deploy/,
    bin/, scripts/ and the package (its messages)."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += [p for p in (ROOT / "docs").rglob("*.md") if "history" not in p.parts]
    for folder in ("deploy", "bin", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file()
                  and p.suffix not in (".json", ".png")]
    files += [p for p in (ROOT / "kvtier").rglob("*.py") if "_proto" not in p.parts]
    return files


def test_package_targets() -> None:
    assert package_targets(" kvtier") == ["kvtier"]
    assert package_targets(" 'kvtier[gpu]'") == ["kvtier[gpu]"]
    assert package_targets(" -q dist/kvtier-0.2.0-py3-none-any.whl") == []
    assert package_targets(' --no-cache-dir "${wheel}[gpu]"') == []
    assert package_targets(" 'torch==2.13.0+cpu' --extra-index-url https://x/cpu") == [
        "torch==2.13.0+cpu"]


def test_no_instruction_installs_kvtier_by_name() -> None:
    """kvtier is installed from the wheel this checkout builds: `pip install kvtier` (or
    `kvtier[extra]`) would take whatever a registry serves under that name."""
    bad = []
    for path in shipped_text_files():
        for m in INSTALL.finditer(path.read_text(errors="replace")):
            named = [t for t in package_targets(m.group(1))
                     if re.match(r"kvtier\b", t, flags=re.I)]
            if named:
                bad.append(f"{path.relative_to(ROOT)}: pip install{m.group(1)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("profile", ["demo", "test"])
@pytest.mark.parametrize("local_wheel", [True, False])
def test_environments_take_torchs_cpu_build(tmp_path: Path, profile: str,
                                            local_wheel: bool) -> None:
    """scripts/venv.sh (bin/kvtier demo, bin/test) asks pip for torch 2.13.0+cpu, a version PyPI
    does not have: a local wheel when pip's configuration has one, else PyTorch's CPU index.
    (It asked for `torch==2.13.0`, which PyPI serves as the CUDA build.)"""
    log = tmp_path / "pip.log"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    # pip stand-in: logs its arguments; without a local wheel, a torch+cpu install succeeds only
    # from an extra index
    fail = "" if local_wheel else (
        'case "$*" in *"torch==2.13.0+cpu"*) case "$*" in *extra-index-url*) ;; *) exit 1;; '
        "esac;; esac\n")
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{fail}exit 0\n')
    python.chmod(0o755)
    proc = subprocess.run(["bash", "-c", f". scripts/venv.sh && ensure_venv {profile}"],
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "KVTIER_VENV": str(venv)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    torch = [c for c in calls if "torch==" in c]
    assert torch, calls
    for call in torch:
        assert "torch==2.13.0+cpu" in call, call
    if local_wheel:
        assert len(torch) == 1 and "index-url" not in torch[0]
    else:
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in torch[-1]
