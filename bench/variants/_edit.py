"""Shared helper of the variants: recompile a method of a class with its source edited."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def edited(cls: type, name: str, edits: list[tuple[str, str]], extra: dict[str, Any]) -> None:
    """Replace ``cls.name`` by its source with each (old, new) edit applied (each must match),
    compiled in the namespace of the class's module plus `extra`."""
    src = textwrap.dedent(inspect.getsource(getattr(cls, name)))
    for old, new in edits:
        if old not in src:
            raise RuntimeError(f"{cls.__name__}.{name}: {old!r} not found (the code moved)")
        src = src.replace(old, new)
    ns = dict(vars(inspect.getmodule(cls)))
    ns.update(extra)
    exec(compile(src, f"<variant {name}>", "exec"), ns)
    setattr(cls, name, ns[name])
