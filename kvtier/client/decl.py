"""What a client declares to the daemon: its layout, for one model (`LayoutDecl`), and the model's
optional cost parameters (`ModelCost`). Re-exported by `kvtier.client.sync_client`. Pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier._proto import kvtier_pb2 as pb
from kvtier.core.errors import InvalidArgument
from kvtier.core.keys import check_model_id, layout_id
from kvtier.core.methods import PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Optional cost parameters so Lookup can return a fetch-vs-recompute plan."""

    active_params: float
    num_layers: int
    attn_dim: int
    sliding_window: int = 0


@dataclass(frozen=True, slots=True)
class LayoutDecl:
    """What the daemon must know about the blocks: declared once per connection.

    `model_id` (required, keyword-only; 1..256 UTF-8 bytes of printable text) names the weights
    whose KV the blocks hold, e.g. "org/name@revision" or `kvtier.engine.config` `model_id()`.
    The daemon keeps each (model id, layout fingerprint) apart — as `layout_id`, the id every
    request names — so a fine-tune never loads its base model's KV (or another fine-tune's) even
    with equal keys. There is deliberately no default: a shared default would merge models again.
    """

    fingerprint: bytes
    block_bytes: int
    block_tokens: int
    key_width: int = 32
    model: ModelCost | None = None
    model_id: str = field(kw_only=True)
    groups: tuple[tuple[str, int], ...] = field(default=(), kw_only=True)
    """Optional: how a block's bytes split over the engine's KV cache groups, (name, bytes)
    summing to `block_bytes` (the daemon then accounts bytes per group in Stats and metrics)."""
    layout_id: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            check_model_id(self.model_id)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        if not isinstance(self.fingerprint, bytes) or not self.fingerprint:
            raise ValueError("fingerprint must be non-empty bytes")
        if self.groups and sum(n for _, n in self.groups) != self.block_bytes:
            raise ValueError(f"the groups' bytes sum to {sum(n for _, n in self.groups)}, not "
                             f"block_bytes {self.block_bytes}")
        object.__setattr__(self, "layout_id", layout_id(self.model_id, self.fingerprint))

    @classmethod
    def from_layout(cls, layout: Any, model_id: str, *, key_width: int = 32,
                    model: ModelCost | None = None) -> LayoutDecl:
        """From a `kvtier.core.layout.KVLayout` and the id of the model whose KV it holds."""
        return cls(layout.fingerprint(), layout.block_bytes(), layout.block_tokens, key_width,
                   model, model_id=model_id)


def register_request(layout: LayoutDecl) -> pb.RegisterLayoutRequest:
    req = pb.RegisterLayoutRequest(layout=layout.fingerprint, block_bytes=layout.block_bytes,
                                   block_tokens=layout.block_tokens, key_width=layout.key_width,
                                   model_id=layout.model_id, protocol_version=PROTOCOL_VERSION,
                                   groups=[pb.LayoutGroup(name=n, block_bytes=b)
                                           for n, b in layout.groups])
    if layout.model is not None:
        m = layout.model
        req.model.CopyFrom(pb.ModelCost(active_params=m.active_params, num_layers=m.num_layers,
                                        attn_dim=m.attn_dim, sliding_window=m.sliding_window))
    return req
