"""Weight bytes of a quantized checkpoint, from its config.json `quantization_config`. Pure.

What each method stores, and which weights vLLM 0.32 loads quantized (the rest stay in the
model dtype, 2 B: embeddings, the output head, norms, biases, routers):

    quant_method   quantized weights                         bytes per quantized weight
    fp8            attention, dense MLP, shared and routed     1, + one fp32 scale per
                   experts (Fp8LinearMethod, Fp8MoEMethod)     `weight_block_size` block (else
                                                               per tensor: not counted)
    mxfp4          routed experts only (Mxfp4MoEMethod; its    4 bits + one E8M0 byte per 32
                   linear layers are unquantized)              = 0.53125
    gptq, awq      attention, dense MLP and experts            bits / 8, + per `group_size`
                                                               group an fp16 scale and a
                                                               `bits`-wide zero point

Lists of modules left unquantized (`modules_to_not_convert`, `ignored_layers`) are not read:
the scopes above are vLLM's own. Kernel back ends may pad the expert matrices (vLLM rounds
mxfp4's hidden and intermediate sizes up for some back ends); that padding is not counted.
Another method is a `UsageError` telling the user to state the weights (`kvtier size
--weights` or `--weight-bytes-per-param`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvtier.core.errors import UsageError
from kvtier.core.hfconfig import ParamParts

UNQUANTIZED_BYTES = 2
"""The model dtype of what stays unquantized (bf16/fp16, as vLLM's dtype "auto" loads it)."""


class WeightBytes(NamedTuple):
    """All ranks' weight bytes and how they were counted (one line, for the user)."""

    bytes: int
    note: str


def weight_bytes(quant: Mapping[str, Any], parts: ParamParts, where: str) -> WeightBytes:
    """The checkpoint's weights in bytes under `quant` (a `quantization_config`); `where` names
    the file in errors."""
    method = str(quant.get("quant_method") or "").lower()
    if method == "fp8":
        quantized = parts.linear + parts.experts
        block = quant.get("weight_block_size")
        if block is None:
            per, scales, how = 1.0, 0, "per-tensor scales"
        else:
            cells = _block_cells(block, where)
            scales = 4 * math.ceil(quantized / cells)
            per, how = 1.0, f"+ a 4 B scale per {'x'.join(str(x) for x in block)} block"
        return _sum(method, quantized, per, scales, how, parts, "attention, MLP and experts")
    if method == "mxfp4":
        return _sum(method, parts.experts, 0.53125, 0, "4 bits + a 1 B scale per 32",
                    parts, "routed experts")
    if method in ("gptq", "awq"):
        bits = _int(quant, "bits", where, (2, 3, 4, 8))
        group = quant.get("group_size", 128)
        if isinstance(group, bool) or not isinstance(group, int) or group == 0 or group < -1:
            raise UsageError(f"{where}: quantization_config group_size must be a positive "
                             f"integer or -1, got {group!r}")
        quantized = parts.linear + parts.experts
        extra = 0 if group == -1 else math.ceil(quantized / group * (2 + bits / 8))
        how = f"{bits} bits" + ("" if group == -1 else f" + fp16 scale and zero per {group}")
        return _sum(method, quantized, bits / 8, extra, how, parts, "attention, MLP and experts")
    raise UsageError(
        f"{where}: quantization_config quant_method {method or quant.get('quant_method')!r} is "
        "not one kvtier size reads (fp8, mxfp4, gptq, awq); give --weights SIZE (one rank) or "
        "--weight-bytes-per-param B"
    )


def _sum(method: str, quantized: int, per: float, extra: int, how: str, parts: ParamParts,
         what: str) -> WeightBytes:
    rest = parts.total - quantized
    total = math.ceil(quantized * per) + extra + rest * UNQUANTIZED_BYTES
    note = (f"{method} (quantization_config): {quantized:,} {what} params x {per:g} B ({how})"
            f" + {rest:,} other params x {UNQUANTIZED_BYTES} B")
    return WeightBytes(total, note)


def _block_cells(block: Any, where: str) -> int:
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in block)):
        raise UsageError(f"{where}: quantization_config weight_block_size must be two positive "
                         f"integers, got {block!r}")
    return int(block[0]) * int(block[1])


def _int(quant: Mapping[str, Any], name: str, where: str, allowed: tuple[int, ...]) -> int:
    value = quant.get(name)
    if value not in allowed or isinstance(value, bool):
        raise UsageError(f"{where}: quantization_config {name} must be one of "
                         f"{', '.join(map(str, allowed))}, got {value!r}")
    return int(value)
