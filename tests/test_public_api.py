"""The package face: every public name imports from `kvtier`, the README and the documentation
pages use only those, and the API page's table lists exactly `kvtier.__all__`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import kvtier

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = "\n".join(p.read_text() for p in PAGES)


def _code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", TEXT, re.S)


def test_every_public_name_resolves_to_its_defining_module() -> None:
    for name in kvtier.__all__:
        value = getattr(kvtier, name)
        if name != "__version__":
            assert value.__module__.startswith("kvtier."), name
    assert sorted(dir(kvtier)) == sorted(kvtier.__all__)


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        kvtier.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_pages_code_imports_only_the_package_face() -> None:
    imports = []
    for block in _code_blocks("python") + _code_blocks("bash"):
        imports += re.findall(r"^\s*from (kvtier[\w.]*) import ([^\n#]+)", block, re.M)
    assert imports, "the pages show no kvtier imports"
    for module, names in imports:
        assert module == "kvtier", f"a page imports from {module}: use `from kvtier import ...`"
        for name in (n.strip() for n in names.split(",")):
            assert name in kvtier.__all__, f"a page imports {name}, not in kvtier.__all__"
            assert getattr(kvtier, name) is not None


def test_api_page_table_lists_exactly_all() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    section = page.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {n for row in rows for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert listed == set(kvtier.__all__) - {"__version__"}


def test_import_kvtier_loads_no_rpc_or_storage_library() -> None:
    code = ("import sys, kvtier, kvtier.core.keys, kvtier.index.prefix; "
            "print(sorted(m for m in ('grpc', 'lmdb', 'torch', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
