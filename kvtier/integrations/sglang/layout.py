"""The kvtier layout of one SGLang rank's pages: fingerprint from the host pool's geometry and
the model shard the rank holds, model id (by default one that follows the weights:
`default_model_id`), and the planner's cost parameters.

Every TP rank builds its own backend (SGLang's `HiCacheStorageConfig`). An MHA rank holds its
heads only, so its pages are its own layout (TP rank and size in the fingerprint). An MLA
rank holds the whole latent KV: every TP rank declares the same layout and reads the pages
that the writer rank (`is_storage_writer`) stored once. With DP attention the TP rank is
attention-group local and `dp_rank` names the group; groups hold the same shard, so they
share pages too (dp_rank is not in the fingerprint). A PP stage holds its layers only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.client.decl import LayoutDecl, ModelCost
from kvtier.integrations.common import identity
from kvtier.integrations.sglang.chains import KEY_BYTES
from kvtier.integrations.sglang.pool import PageGeometry, fingerprint
from kvtier.integrations.sglang.settings import WHERE


def default_model_id(args: Mapping[str, Any] | None, model_name: str | None) -> str:
    """Whose KV the rank computes, following its weights (`integrations/common/identity.py`),
    from SGLang's resolved launch arguments `args` (`model_path`, `revision`, `load_format`,
    `random_seed`, `dtype` — "auto" follows config.json, which the weights' digest covers — and
    `quantization`). Where they were not published in this process (None), from the storage
    config's `model_name` (SGLang's model path) alone."""
    if args is None:
        if not model_name:
            raise ValueError(f"kvtier: SGLang gave no model name; set model_id in {WHERE}")
        return identity.model_id(model_name, where=WHERE)
    quant = args.get("quantization")
    return identity.model_id(
        str(args["model_path"]), load_format=str(args.get("load_format") or ""),
        seed=args.get("random_seed"), revision=args.get("revision"),
        dtype=str(args.get("dtype") or ""), quantization=str(quant) if quant else None,
        where=WHERE)


def shard(config: Any, pool: Any) -> dict[str, int]:
    """What the rank holds of the model, from `HiCacheStorageConfig` and the host pool."""
    out = {"pp_rank": int(config.pp_rank), "pp_size": int(config.pp_size),
           "start_layer": int(getattr(pool, "start_layer", 0) or 0),
           "end_layer": int(getattr(pool, "end_layer", 0) or 0),
           "dcp_rank": int(getattr(config, "dcp_rank", 0)),
           "dcp_size": int(getattr(config, "dcp_size", 1))}
    if not config.is_mla_model:
        out |= {"tp_rank": int(config.tp_rank), "tp_size": int(config.tp_size),
                "attn_cp_rank": int(getattr(config, "attn_cp_rank", 0)),
                "attn_cp_size": int(getattr(config, "attn_cp_size", 1))}
    return out


def model_cost(model_path: str | None) -> ModelCost | None:
    """The planner's cost parameters from `<model_path>/config.json`, when it is a local
    folder whose config kvtier understands (else None: Lookup answers without a plan)."""
    from kvtier.core.hfconfig import parse_config, spec_from_config

    if not model_path:
        return None
    path = Path(model_path) / "config.json"
    try:
        spec = spec_from_config(parse_config(path.read_text(encoding="utf-8"), str(path)))
    except (OSError, ValueError, json.JSONDecodeError):
        return None
    return ModelCost(active_params=float(spec.active_params), num_layers=spec.num_layers,
                     attn_dim=spec.d_attn)


def declare(geo: PageGeometry, config: Any, pool: Any, model_id: str,
            cost: ModelCost | None) -> LayoutDecl:
    return LayoutDecl(fingerprint(geo, shard(config, pool)), geo.block_bytes, geo.page_size,
                      KEY_BYTES, cost, model_id=model_id)
