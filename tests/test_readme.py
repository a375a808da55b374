"""Every example with deterministic output, in the README and on every documentation page
(docs/*.md; the measurement log in docs/history/ aside), runs and prints what the page shows.

How a page is read:
- An example is a ```bash block followed (after blank lines only) by a ```text block: the text
  block is what the commands print. It may be an excerpt: its lines must appear, in order, among
  the lines the block printed (stdout and stderr together). In a shown line `…` stands for any
  text (a timing, a temporary path).
- A ```bash block with no ```text block after it is run only when the line before it is
  `<!-- readme-test: run -->` (a setup step, such as starting the daemon in the background).
- An example whose output is not deterministic is marked `<!-- readme-test: skip (why) -->` on
  the line before its bash block; it is not run. Everything else with output is.
- All runnable blocks of one `## ` section of a page run in order in one bash process (so
  `kvtier serve &` in one block and `kill %1` in a later one work), in a fresh temporary
  directory that is also HOME, TMPDIR and every XDG base directory: an example writes nothing
  outside it.
- After a block that ends in `&`, the runner waits until the daemon answers on its default
  socket. `kvtier`, `bin/kvtier`, `python` and `python3` run this checkout's kvtier with this
  interpreter (commands in that directory's bin/, first on PATH); a section that names
  `synthetic_trace.jsonl` (the Mooncake trace the pages tell users to download) finds it there,
  linked from the traces beside this checkout (or $KVTIER_TRACES_DIR; the section is skipped
  when there are none). The metrics port 9464 becomes a free one; the daemon's tiers are sized
  small (KVTIER_DRAM_BYTES, KVTIER_SSD_BYTES), which changes no output shown.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(os.environ.get("KVTIER_TRACES_DIR") or ROOT.parent / "shared" / "traces")
TRACE = "synthetic_trace.jsonl"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- readme-test: (run|skip)\b.*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
DELIM = "@@readme-block-{}@@"


class Block(NamedTuple):
    code: str
    shown: list[str] | None  # None: nothing shown (a setup block)
    line: int  # where the bash block starts in README.md


class Section(NamedTuple):
    title: str
    blocks: list[Block]
    page: str = "README.md"


def parse(text: str, page: str = "README.md") -> list[Section]:
    """The runnable bash blocks of each `## ` section (see the module docstring)."""
    lines = text.splitlines()
    fences: list[tuple[str, int, int, str | None]] = []  # kind, start, end, mark before it
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            mark = MARK.match(prev)
            fences.append((m.group(1), i, end, mark.group(1) if mark else None))
            i = end + 1
        else:
            i += 1
    titles = [(n, ln) for n, ln in enumerate(lines) if ln.startswith("## ")]
    sections: dict[str, list[Block]] = {}
    for n, (kind, start, end, mark) in enumerate(fences):
        if kind != "bash" or mark == "skip":
            continue
        shown = None
        if n + 1 < len(fences) and fences[n + 1][0] == "text":
            _, tstart, tend, _ = fences[n + 1]
            if all(not ln.strip() for ln in lines[end + 1:tstart]):
                shown = lines[tstart + 1:tend]
        if shown is None and mark != "run":
            continue
        title = next((t for pos, t in reversed(titles) if pos < start), "(top)")
        sections.setdefault(title, []).append(
            Block("\n".join(lines[start + 1:end]), shown, start + 1))
    return [Section(t, b, page) for t, b in sections.items() if any(x.shown for x in b)]


def matches(shown: str, printed: str) -> bool:
    if "…" not in shown:
        return shown.rstrip() == printed.rstrip()
    pattern = ".*".join(re.escape(part) for part in shown.rstrip().split("…"))
    return re.fullmatch(pattern, printed.rstrip()) is not None


def missing(shown: list[str], printed: list[str]) -> list[str]:
    """Shown lines not printed in order (an empty list: the excerpt matches)."""
    at = 0
    for n, want in enumerate(shown):
        while at < len(printed) and not matches(want, printed[at]):
            at += 1
        if at == len(printed):
            return shown[n:]
        at += 1
    return []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


WAIT_FOR_DAEMON = (
    "for _ in $(seq 600); do {py} -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); "
    "s.connect(sys.argv[1])' \"$XDG_RUNTIME_DIR/kvtier/kvtier.sock\" 2>/dev/null && break; "
    "sleep 0.1; done"
)


def script(section: Section, port: int) -> str:
    parts = ["set -o pipefail"]
    for n, block in enumerate(section.blocks):
        code = block.code.replace("127.0.0.1:9464", f"127.0.0.1:{port}")
        parts += [f"echo {DELIM.format(n)}", code]
        if code.rstrip().endswith("&"):
            parts.append(WAIT_FOR_DAEMON.format(py=shlex.quote(sys.executable)))
    parts += [f"echo {DELIM.format(len(section.blocks))}", "wait"]
    return "\n".join(parts) + "\n"


def commands(bin_dir: Path) -> None:
    """`kvtier`, `python` and `python3` in `bin_dir`: this interpreter, this checkout's kvtier."""
    bin_dir.mkdir()
    py = shlex.quote(sys.executable)
    for name, line in (("kvtier", f"exec {py} -m kvtier \"$@\""), ("python", f'exec {py} "$@"'),
                       ("python3", f'exec {py} "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)


SECTIONS = [s for page in PAGES for s in parse(page.read_text(), page.relative_to(ROOT).as_posix())]


def test_parser_finds_the_examples() -> None:
    titles = {(s.page, s.title) for s in SECTIONS}
    for page, title in (
            ("README.md", "## What it does for you, before you deploy it"),
            ("docs/daemon.md", "## Start it, store and load, stop it"),
            ("docs/daemon.md", "## Sizes and flag names"),
            ("docs/sizing.md", "## What a model needs, and what the pool holds"),
            ("docs/simulation.md", "## A generated workload"),
            ("docs/simulation.md", "## The Mooncake trace"),
            ("docs/fleet.md", "## Routing a fleet by cache"),
            ("docs/operations.md", "## No daemon, or the wrong socket"),
            ("docs/api.md", "## Block keys")):
        assert (page, title) in titles, (page, title)
    assert sum(b.shown is not None for s in SECTIONS for b in s.blocks) >= 20


def test_matching_rules() -> None:
    assert missing(["a", "c"], ["a", "b", "c"]) == []
    assert missing(["c", "a"], ["a", "b", "c"]) == ["a"]
    assert missing(["replay …s"], ["replay 1.2 s"]) == []
    assert missing(["x"], ["x y"]) == ["x"]
    text = ("## S\n<!-- readme-test: skip (varies) -->\n```bash\nno\n```\n\n```text\nn\n```\n"
            "<!-- readme-test: run -->\n```bash\nsetup &\n```\n```bash\nyes\n```\n\n```text\n"
            "y\n```\n```bash\nalone\n```\n")
    (section,) = parse(text)
    assert [(b.code, b.shown) for b in section.blocks] == [("setup &", None), ("yes", ["y"])]


@pytest.mark.parametrize("section", SECTIONS,
                         ids=[f"{s.page}:{s.title[3:40]}" for s in SECTIONS])
def test_page_example(section: Section, tmp_path: Path) -> None:
    if TRACE in "".join(b.code for b in section.blocks):
        if not (TRACES / TRACE).is_file():
            pytest.skip(f"no {TRACE} in {TRACES}")
        (tmp_path / TRACE).symlink_to(TRACES / TRACE)
    commands(tmp_path / "bin")
    port = _free_port()
    (tmp_path / "tmp").mkdir()
    env = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONPATH": str(ROOT),
        "HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp"),
        "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "XDG_CONFIG_DIRS": str(tmp_path / "etc"), "KVTIER_METRICS": f"127.0.0.1:{port}",
        "KVTIER_DRAM_BYTES": "64MiB", "KVTIER_SSD_BYTES": "64MiB", "KVTIER_GRACE_S": "2",
    }
    proc = subprocess.run(["bash", "-c", script(section, port)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    for n, block in enumerate(section.blocks):
        printed = out.split(DELIM.format(n) + "\n", 1)[1].split(DELIM.format(n + 1), 1)[0]
        if block.shown:
            lost = missing(block.shown, printed.splitlines())
            assert not lost, (f"{section.page}:{block.line}: not printed: {lost[0]!r}\n"
                              f"printed:\n{printed}")


def test_examples_write_only_where_they_run() -> None:
    """No example writes to a fixed path outside its directory (on main: /tmp/mymodel)."""
    for section in SECTIONS:
        for block in section.blocks:
            assert not re.search(r"(?<![\w$])/tmp/", block.code), (block.line, block.code)


def section_of(page: str, title: str) -> str:
    text = (ROOT / page).read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


VLLM_EXAMPLES = [("README.md", "Use it with vLLM"), ("docs/vllm.md", "In five minutes")]
SGLANG_EXAMPLES = [("README.md", "Use it with SGLang"), ("docs/sglang.md", "In five minutes")]


@pytest.mark.parametrize(("page", "title"), VLLM_EXAMPLES)
def test_vllm_example_reaches_kvtier_serve_on_its_defaults(page: str, title: str,
                                                            tmp_path: Path) -> None:
    """The `vllm serve` example, copied as written, finds the daemon `kvtier serve` starts with
    no configuration (same user and environment): the connector's socket is serve's default
    socket. The systemd form names the unit's socket."""
    import json

    from kvtier.core.paths import default_socket
    from kvtier.daemon import config
    from kvtier.integrations.vllm.settings import ConnectorSettings

    section = section_of(page, title)
    example = section.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "vllm serve " in example
    transfer = json.loads(example.split("--kv-transfer-config '", 1)[1].split("'", 1)[0])
    assert transfer["kv_connector_module_path"] == "kvtier.integrations.vllm"
    settings = ConnectorSettings.from_extra(transfer["kv_connector_extra_config"])
    env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    engine_socket = Path(settings.socket) if settings.socket else default_socket(env)
    assert engine_socket == config.load({}, env).socket
    text = (ROOT / page).read_text()
    systemd = re.search(r'"kv_connector_extra_config": (\{"socket":\s+"[^"]+"\})', text)
    assert systemd is not None
    unit = (ROOT / "deploy" / "kvtier.service").read_text()
    assert f"KVTIER_SOCKET={json.loads(systemd.group(1))['socket']}" in unit


@pytest.mark.parametrize(("page", "title"), SGLANG_EXAMPLES)
def test_sglang_example_reaches_kvtier_serve_on_its_defaults(page: str, title: str,
                                                              tmp_path: Path) -> None:
    """The SGLang launch line, copied as written, finds the daemon `kvtier serve` starts with no
    configuration (its extra-config names no socket); the systemd form names the unit's
    socket."""
    import json

    from kvtier.core.paths import default_socket
    from kvtier.daemon import config
    from kvtier.integrations.sglang.settings import StorageSettings

    section = section_of(page, title)
    example = section.split("```bash\n", 1)[1].split("```", 1)[0]
    extra = json.loads(example.split("--hicache-storage-backend-extra-config '", 1)[1]
                       .split("'", 1)[0])
    assert extra["module_path"] == "kvtier.integrations.sglang.backend"
    # SGLang takes its own prefetch keys out before the backend sees the mapping
    backend_extra = {k: v for k, v in extra.items()
                     if k != "hicache_storage_pass_prefix_keys" and not k.startswith("prefetch_")}
    settings = StorageSettings.from_extra(backend_extra)
    env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    backend_socket = Path(settings.socket) if settings.socket else default_socket(env)
    assert backend_socket == config.load({}, env).socket
    systemd = re.search(r'`"socket": "([^"]+)"`', (ROOT / page).read_text())
    assert systemd is not None
    unit = (ROOT / "deploy" / "kvtier.service").read_text()
    assert f"KVTIER_SOCKET={systemd.group(1)}" in unit
