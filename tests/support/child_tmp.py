"""The temp dir of an engine process a test or benchmark starts (vLLM, SGLang): its own, so
what the engine leaves there (IPC sockets, named temp files, JIT caches) goes when the process
is closed, never into the system temp dir.

    tmp = child_tmpdir(workdir)     # workdir/tmp, or a fresh dir when that path is too long
    env["TMPDIR"] = str(tmp)        # ... the child runs ...
    shutil.rmtree(tmp, ignore_errors=True)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

MAX_PATH = 60
"""Longest TMPDIR kept under workdir: engines make Unix sockets there, whose whole path (with
their own names, ~45 bytes) must stay under the 107-byte limit."""


def child_tmpdir(workdir: Path) -> Path:
    """`workdir/tmp`, unless that path is longer than MAX_PATH: then a fresh directory in the
    system temp dir. Either way the caller removes it when the child is gone."""
    own = workdir / "tmp"
    if len(str(own)) > MAX_PATH:
        own = Path(tempfile.mkdtemp(prefix="kvtier-eng-"))
    own.mkdir(parents=True, exist_ok=True)
    return own
