"""The README's `kvtier size` examples run as written and print the lines shown under them."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Sizing a deployment: kvtier size"


def examples():
    text = (ROOT / "README.md").read_text()
    assert SECTION in text
    body = text.split(SECTION, 1)[1]
    body = re.split(r"^## ", body, flags=re.M)[0]
    blocks = re.findall(r"```(bash|text)\n(.*?)```", body, flags=re.S)
    pairs = []
    for i, (kind, code) in enumerate(blocks):
        if kind == "bash":
            shown = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else ""
            pairs.append((code, shown))
    return pairs


EXAMPLES = examples()


def test_section_has_examples():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize(
    ("code", "shown"), EXAMPLES, ids=[c.split("\n")[0][:60] for c, _ in EXAMPLES]
)
def test_readme_example(code, shown):
    runner = f"{shlex.quote(sys.executable)} -m kvtier"
    script = "set -o pipefail\n" + code.replace("bin/kvtier", runner)
    proc = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = (proc.stdout + proc.stderr).splitlines()
    for line in shown.splitlines():
        assert line in out, f"README line not printed: {line!r}"
    assert "Traceback" not in proc.stderr
