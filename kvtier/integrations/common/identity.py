"""Whose KV an engine computes: the default model id of both engines' integrations, which
follows the weights.

Blocks are shared only under equal model ids (and layouts), so the id must change whenever the
weights do, or an engine whose weights were replaced under the same name loads the KV of the
old ones (wrong from the first token, silently, and for as long as a persistent tier keeps it):

    local directory   "<dir name>@w:<digest>": a digest of the weight files read cheaply — each
                      file's name and size, config.json and quantization configs whole, every
                      safetensors header, and 16 bytes at the start, middle and end of each
                      tensor (other weight formats: 16 spans of 64 bytes spread over the file);
                      no full read. A copy of the same files elsewhere gets the same id; a
                      rewrite that changes any tensor's sampled bytes gets another.
    hub model         "<repo>@<commit>": the snapshot commit the revision resolves to in the
                      local Hugging Face cache (a branch like "main" moves; its commit does
                      not); "<repo>@<revision>" with a warning when the cache cannot say.
    dummy weights     "<name>@dummy-seed<seed>" (load format "dummy": random, from the seed).

Then "/<dtype>" (the weights' compute dtype changes every K and V) and "/q:<method>" when the
engine quantizes. The KV cache dtype, block size and shard are the layout fingerprint's, not the
id's. Each engine's adapter reads these from its own configuration (vLLM:
`integrations/vllm/layout.default_model_id`; SGLang: `integrations/sglang/layout.default_model_id`)
and the id is pinned by hand with the `model_id` key of its extra config (docs/vllm.md). Pure apart
from reading the model's files; no engine import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any

log = logging.getLogger("kvtier.integrations.common")

WEIGHTS = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|npz|msgpack|h5)$")
WHOLE = ("config.json", "quant_config.json", "quantize_config.json", "hf_quant_config.json",
         "quantization_config.json")
"""Small files read whole: they change what the weights mean (shapes, rope, quantization)."""
SAMPLE = 16
SPANS = 16
SPAN = 64
MAX_HEADER = 100 << 20
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def model_id(model: str, *, load_format: str = "", seed: Any = None, revision: str | None = None,
             dtype: str = "", quantization: str | None = None,
             where: str = "the engine's extra config") -> str:
    """The id of the KV that `model` (a local directory or a hub repo id) computes when loaded
    with these settings (module docstring). `where` names the engine's extra config in the
    warning of an unresolvable hub revision."""
    if load_format == "dummy":
        base = f"{_short(model)}@dummy-seed{seed}"
    elif Path(model).is_dir():
        base = f"{_short(Path(model).resolve().name)}@w:{weights_digest(Path(model))}"
    else:
        base = f"{model}@{hub_revision(model, revision, where)}"
    dtype = dtype.removeprefix("torch.")
    return base + (f"/{dtype}" if dtype else "") + (f"/q:{quantization}" if quantization else "")


def _short(name: str) -> str:
    return name if len(name) <= 96 else name[:64] + "~" + hashlib.sha256(
        name.encode()).hexdigest()[:16]


def weights_digest(directory: Path) -> str:
    """The cheap digest of the weight files in `directory` (module docstring), 24 hex digits."""
    h = hashlib.sha256(b"kvtier-weights-v1\0")
    names = sorted(os.listdir(directory))
    for name in names:
        path = directory / name
        if not path.is_file() or not (WEIGHTS.match(name) or name.endswith(".index.json")
                                      or name in WHOLE):
            continue
        size = path.stat().st_size
        h.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if name in WHOLE or name.endswith(".index.json"):
                h.update(f.read())
            elif name.endswith(".safetensors"):
                _safetensors(f, size, h)
            else:
                for i in range(SPANS):
                    f.seek(max(0, (size - SPAN) * i // max(SPANS - 1, 1)))
                    h.update(f.read(SPAN))
    return h.hexdigest()[:24]


def _safetensors(f: Any, size: int, h: Any) -> None:
    """The header whole, then SAMPLE bytes at each tensor's start, middle and end."""
    head = f.read(8)
    if len(head) < 8:
        h.update(head)
        return
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, MAX_HEADER):  # not a safetensors file after all: its bytes, spread
        h.update(head)
        return
    header = f.read(n)
    h.update(header)
    try:
        entries = json.loads(header)
    except ValueError:
        return
    base = 8 + n
    spans = sorted(tuple(v["data_offsets"]) for k, v in entries.items()
                   if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v)
    for lo, hi in spans:
        for at in (lo, (lo + hi) // 2, hi - SAMPLE):
            at = min(max(at, lo), max(hi - SAMPLE, lo))
            f.seek(base + at)
            h.update(f.read(min(SAMPLE, hi - lo)))


def hub_revision(repo: str, revision: str | None,
                 where: str = "the engine's extra config") -> str:
    """The commit `revision` (default "main") of hub model `repo` resolves to in the local
    Hugging Face cache; `revision` itself, with a warning, when the cache cannot say."""
    rev = revision or "main"
    if COMMIT.match(rev):
        return rev
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json", revision=rev)
    except Exception:  # no huggingface_hub, a malformed repo id: the fallback below
        found = None
    if isinstance(found, str):
        commit = Path(found).parent.name
        if COMMIT.match(commit):
            return commit
    log.warning("kvtier: cannot resolve %s@%s to a commit in the Hugging Face cache; model id "
                "%s@%s moves with the branch: pin it with model_id in %s", repo, rev, repo, rev,
                where)
    return rev
