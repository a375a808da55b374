"""The documentation as a whole: the generated pages are current, every page is in the site's
navigation, no user-facing text names an internal issue or a machine, the versions the texts
name are this one, and the examples name no file a user cannot get. (Each page's examples run in
tests/test_readme.py; the site's strict build runs in bin/test: `mkdocs build --strict`.)"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from kvtier._version import __version__
from kvtier.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# the architecture page is rewritten on its own schedule; the measurement log (docs/history/) is
# a dated record kept out of the site
USER_TEXTS = [ROOT / "README.md", ROOT / "CHANGELOG.md",
              *(p for p in PAGES if p.name != "ARCHITECTURE.md")]
ISSUE = re.compile(r"\bissues? #?\d+\b|(?<![\w/.-])#\d{1,5}\b", re.I)
MACHINE = re.compile(r"\bdev-2c\b|/work/(?:main|wt|shared)\b")


def gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current() -> None:
    """docs/configuration.md and docs/grpc.md are what `python scripts/gen_docs.py` writes."""
    gen = gen_docs()
    for name, build in gen.PAGES.items():
        assert (DOCS / name).read_text() == build(), (
            f"docs/{name} is stale: run python scripts/gen_docs.py")


def test_configuration_page_has_every_setting_with_its_four_names() -> None:
    from kvtier.daemon import config, reload

    page = (DOCS / "configuration.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", page, re.M)}
    assert set(rows) == {s.name for s in config.SETTINGS}
    for s in config.SETTINGS:
        cells = [c.strip() for c in rows[s.name].strip("|").split(" | ")]
        assert cells[1] == f"`{config.env_var(s.name)}`" and cells[2] == f"`{s.flag}`"
        assert cells[4].startswith("yes") == (s.name in reload.LIVE), s.name


def test_grpc_page_lists_every_method_of_the_proto() -> None:
    proto = (ROOT / "protos" / "kvtier" / "v1" / "kvtier.proto").read_text()
    methods = re.findall(r"^\s*rpc (\w+)\(", proto, re.M)
    page = (DOCS / "grpc.md").read_text()
    assert len(methods) >= 15
    for name in methods:
        assert f"| `{name}` |" in page, name


def test_every_page_is_in_the_navigation() -> None:
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def files(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, list):
            return [f for item in nav for f in files(item)]
        if isinstance(nav, dict):
            return [f for value in nav.values() for f in files(value)]
        return []

    listed = files(cfg["nav"])
    assert sorted(listed) == sorted(p.name for p in PAGES)
    assert cfg["strict"] is True and cfg["docs_dir"] == "docs"
    assert "history/" in cfg["exclude_docs"]


def test_no_issue_numbers_or_machine_names_in_user_facing_text() -> None:
    bad = []
    for path in USER_TEXTS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in (ISSUE, MACHINE):
                m = pattern.search(line)
                if m:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_patterns_catch_what_they_are_for() -> None:
    for text in ("(issue 29)", "issue 15's renames", "see #123", "Issues #4"):
        assert ISSUE.search(text), text
    for text in ("vllm-project/vllm#22897", "gpustack/runner#251", "`#` comment", "#!/bin/sh"):
        assert not ISSUE.search(text), text
    assert MACHINE.search("on dev-2c") and MACHINE.search("/work/main/.venv/bin/python")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_names_no_issue_or_machine(command: str | None) -> None:
    args = [sys.executable, "-m", "kvtier", *([command] if command else []), "--help"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert not ISSUE.search(out.stdout) and not MACHINE.search(out.stdout), out.stdout


def test_named_versions_are_this_one() -> None:
    """A wheel, an sdist or an image the texts name is of this version (a release bumps them all:
    docs/development.md)."""
    texts = [*USER_TEXTS, *(p for p in (ROOT / "deploy").rglob("*") if p.is_file()
                            and p.suffix not in (".json", ".png"))]
    pattern = re.compile(r"kvtier(?:-vllm)?[-:](\d+\.\d+\.\d+)")
    bad = []
    for path in texts:
        for m in pattern.finditer(path.read_text()):
            if m.group(1) != __version__:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not bad, "\n".join(bad)


TRACE_URL = ("https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
             "synthetic_trace.jsonl")


def test_examples_name_no_file_a_user_cannot_get() -> None:
    """The README's simulate example replays a workload the package generates; a page's examples
    that replay the Mooncake trace say where to download it (the README's main example named
    `../shared/traces/synthetic_trace.jsonl`, a file beside the developers' checkout)."""
    readme = (ROOT / "README.md").read_text()
    simulate = re.findall(r"^(?:bin/)?kvtier simulate .*$", readme, re.M)
    assert simulate and all("--workload" in line and "--trace" not in line for line in simulate)
    for path in [ROOT / "README.md", *PAGES]:
        text = path.read_text()
        if path.name != "ARCHITECTURE.md":  # rewritten on its own schedule
            assert "../shared" not in text and "/work/" not in text, path.name
        blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
        traces = {t for b in blocks for t in re.findall(r"--trace (\S+)", b)}
        for trace in traces:
            assert trace == "synthetic_trace.jsonl", (path.name, trace)
            assert TRACE_URL in text or "simulation.md#the-mooncake-trace" in text, path.name


def test_status_says_plainly_that_the_gpu_path_has_not_run() -> None:
    for path in (ROOT / "README.md", DOCS / "index.md", DOCS / "vllm.md"):
        assert "The GPU path has not run on a GPU yet" in path.read_text(), path.name


def test_the_vllm_quickstart_is_on_the_first_screen() -> None:
    """A reader reaches "use it with vLLM" and "with SGLang" without scrolling far, and the
    README stays a front page."""
    lines = (ROOT / "README.md").read_text().splitlines()
    heads = {ln: n for n, ln in enumerate(lines) if ln.startswith("## ")}
    assert heads["## Use it with vLLM"] < 40 and heads["## Use it with SGLang"] < 75
    assert len(lines) <= 250
