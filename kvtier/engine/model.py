"""The reference model's math: random weights from a seed, one forward step over a chunk of tokens.

Pure tensor code with no knowledge of blocks or sequences: each layer hands its new K/V to a
`KVSink` (the runner), which stores them and returns the K/V of every position the chunk may
attend to. Attention scores, softmax and the weighted sum run in fp32 whatever the model dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from kvtier.engine.config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVSink(Protocol):
    def exchange(self, layer: int, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the chunk's k, v [c, kv_heads, d]; return K, V [T, kv_heads, d] of positions
        0..T-1 where T = start + c (the chunk's own positions last)."""
        ...


class LayerWeights(NamedTuple):
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [c, heads, d]; cos, sin: [c, d/2] (fp32)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """GQA attention of chunk queries q [c, H, d] at positions start.. over k, v [T, KVH, d].

    Query i sees keys 0..start+i. Returns [c, H*d] in q's dtype.
    """
    c, heads, d = q.shape
    t, kv_heads, _ = k.shape
    group = heads // kv_heads
    qf = q.float().view(c, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * c, d)
    kf = k.float().permute(1, 0, 2)
    vf = v.float().permute(1, 0, 2)
    scores = torch.bmm(qf, kf.transpose(1, 2)) * (1.0 / math.sqrt(d))
    # Keys before `start` are visible to every query; only the chunk's own keys need the mask.
    future = torch.ones(c, t - start, dtype=torch.bool, device=q.device).triu(1)
    scores.view(kv_heads, group, c, t)[..., start:].masked_fill_(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, vf).view(kv_heads, group, c, d).permute(2, 0, 1, 3)
    return out.reshape(c, heads * d).to(q.dtype)


class Transformer:
    """Weights on `device` in the config's dtype; generated on CPU in fp32 from `config.seed`, so
    CPU and GPU copies (and any two processes) start from identical values."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[config.dtype]
        gen = torch.Generator().manual_seed(config.seed)
        h, d = config.hidden, config.head_dim

        def dense(out_f: int, in_f: int) -> torch.Tensor:
            w = torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)
            return w.to(self.device, self.dtype)

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(h, generator=gen)).to(self.device, self.dtype)

        self.embed = torch.randn(config.vocab_size, h, generator=gen).to(self.device, self.dtype)
        self.layers = [
            LayerWeights(
                attn_norm=norm(),
                wq=dense(config.heads * d, h),
                wk=dense(config.kv_heads * d, h),
                wv=dense(config.kv_heads * d, h),
                wo=dense(h, config.heads * d),
                mlp_norm=norm(),
                w_gate=dense(config.mlp_hidden, h),
                w_up=dense(config.mlp_hidden, h),
                w_down=dense(h, config.mlp_hidden),
            )
            for _ in range(config.layers)
        ]
        self.final_norm = norm()
        self.lm_head = dense(config.vocab_size, h)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(config.max_positions, dtype=torch.float64), inv_freq)
        self.rope_cos = angles.cos().float().to(self.device)
        self.rope_sin = angles.sin().float().to(self.device)

    def forward(self, token_ids: torch.Tensor, start: int, kv: KVSink) -> torch.Tensor:
        """Final hidden states [c, hidden] of the tokens at positions start..start+c-1."""
        cfg = self.config
        c = token_ids.shape[0]
        if start + c > cfg.max_positions:
            raise ValueError(f"position {start + c - 1} exceeds max_positions {cfg.max_positions}")
        cos = self.rope_cos[start:start + c]
        sin = self.rope_sin[start:start + c]
        x = self.embed.index_select(0, token_ids)
        for i, w in enumerate(self.layers):
            hn = rms_norm(x, w.attn_norm, cfg.norm_eps)
            q = apply_rope(F.linear(hn, w.wq).view(c, cfg.heads, cfg.head_dim), cos, sin)
            k = apply_rope(F.linear(hn, w.wk).view(c, cfg.kv_heads, cfg.head_dim), cos, sin)
            v = F.linear(hn, w.wv).view(c, cfg.kv_heads, cfg.head_dim)
            k_all, v_all = kv.exchange(i, k, v)
            x = x + F.linear(causal_attention(q, k_all, v_all, start), w.wo)
            hn = rms_norm(x, w.mlp_norm, cfg.norm_eps)
            x = x + F.linear(F.silu(F.linear(hn, w.w_gate)) * F.linear(hn, w.w_up), w.w_down)
        return x

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """fp32 logits [vocab] of one position's final hidden state [1, hidden]."""
        hn = rms_norm(hidden_last, self.final_norm, self.config.norm_eps)
        return F.linear(hn, self.lm_head).float().view(-1)
