"""The daemon's import graph stays shallow: at most `MAX_LEVELS` levels of imports between the
modules of `kvtier/daemon/`, and no cycle.

A module's level is 1 when it imports no other daemon module, else one more than the highest
level among those it imports. Every import counts — at module level, inside a function, or under
`TYPE_CHECKING` — since each is a dependency a reader has to follow. Read from the source (AST),
so nothing is imported. `python -m tests.test_daemon_import_levels` prints each module's level
and the longest chain."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvtier.daemon"
MAX_LEVELS = 6


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module under kvtier/daemon (a package: its __init__)."""
    base = root / "kvtier" / "daemon"
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The daemon modules `path` imports (`from pkg import mod` names the module `pkg.mod`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            # the module itself, or the nearest enclosing daemon module (a name inside it)
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target != PACKAGE:
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods)
    return {name: imports(path, name, known) for name, path in mods.items()}


def levels(g: dict[str, set[str]]) -> dict[str, int]:
    """Each module's level; raises ValueError naming a cycle."""
    level: dict[str, int] = {}
    on_path: list[str] = []

    def visit(name: str) -> int:
        if name in level:
            return level[name]
        if name in on_path:
            cycle = [*on_path[on_path.index(name):], name]
            raise ValueError("import cycle: " + " -> ".join(cycle))
        on_path.append(name)
        level[name] = 1 + max((visit(dep) for dep in g[name]), default=0)
        on_path.pop()
        return level[name]

    for name in g:
        visit(name)
    return level


def longest_chain(g: dict[str, set[str]], level: dict[str, int]) -> list[str]:
    name = max(level, key=lambda n: (level[n], n))
    chain = [name]
    while g[name]:
        name = max(g[name], key=lambda n: (level[n], n))
        chain.append(name)
    return chain


def test_the_daemon_imports_at_most_six_levels_deep_without_cycles() -> None:
    g = graph()
    level = levels(g)
    chain = longest_chain(g, level)
    assert len(chain) <= MAX_LEVELS, " -> ".join(chain)


def test_a_cycle_and_a_deep_chain_are_found(tmp_path: Path) -> None:
    base = tmp_path / "kvtier" / "daemon"
    (base / "sub").mkdir(parents=True)
    (base / "__init__.py").write_text("")
    (base / "sub" / "__init__.py").write_text("")
    (base / "a.py").write_text("from kvtier.daemon.sub import b\n")
    (base / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvtier.daemon import c\n")
    (base / "c.py").write_text("def f():\n    from kvtier.daemon.sub.b import X\n")
    try:
        levels(graph(tmp_path))
    except ValueError as e:
        assert "kvtier.daemon.sub.b -> kvtier.daemon.c -> kvtier.daemon.sub.b" in str(e)
    else:
        raise AssertionError("the cycle a TYPE_CHECKING and a function import make was missed")
    (base / "c.py").write_text("from . import d\n")
    (base / "d.py").write_text("import os\n")
    g = graph(tmp_path)
    assert longest_chain(g, levels(g)) == [
        "kvtier.daemon.a", "kvtier.daemon.sub.b", "kvtier.daemon.c", "kvtier.daemon.d"]


def main() -> None:
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    g = graph(root)
    level = levels(g)
    for name in sorted(level, key=lambda n: (-level[n], n)):
        print(f"{level[name]:3d}  {name}")
    print("longest chain:", " -> ".join(longest_chain(g, level)))


if __name__ == "__main__":
    main()
