"""Test-only import stub (see tests/sglang_shims/README.md): never called on SGLang's CPU path."""

from typing import Any


def rotary_embedding(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("tests/sglang_shims: vllm._custom_ops is an import stub")
