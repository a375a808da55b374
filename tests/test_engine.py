"""The reference engine on its own: paged prefill from a cached prefix equals full recompute bit for
bit, decode continues identically, and the paged math matches a plain dense transformer."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from kvtier.core.errors import UsageError  # noqa: E402
from kvtier.engine import (  # noqa: E402
    Engine,
    KVPool,
    ModelConfig,
    PoolExhausted,
    Sequence,
    Transformer,
    get_config,
)

TINY = get_config("tiny")
B = TINY.block_tokens


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tokens(n: int, seed: int, vocab: int = TINY.vocab_size) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out: list[int] = torch.randint(0, vocab, (n,), generator=g).tolist()
    return out


def full(engine: Engine, prompt: list[int]) -> tuple[Sequence, torch.Tensor]:
    seq = Sequence()
    return seq, engine.prefill(seq, prompt).logits


def block_kv(engine: Engine, seq: Sequence, j: int) -> list[torch.Tensor]:
    b = seq.block_table[j]
    return [t[b].clone() for t in (*engine.pool.k, *engine.pool.v)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_from_every_cut_equals_full_recompute_bit_exact(dtype: str) -> None:
    engine = Engine(TINY.with_dtype(dtype), num_blocks=64)
    prompt = tokens(5 * B + 7, seed=1)  # 5 full blocks + a partial one
    ref_seq, ref = full(engine, prompt)
    for k in range(6):
        seq = engine.fork(ref_seq, k)
        res = engine.prefill(seq, prompt)
        assert (res.reused_tokens, res.computed_tokens) == (k * B, len(prompt) - k * B)
        assert torch.equal(res.logits, ref), f"cut at {k} blocks"
        for j in range(k, 5):
            assert all(torch.equal(a, b) for a, b in
                       zip(block_kv(engine, seq, j), block_kv(engine, ref_seq, j), strict=True))
        engine.release(seq)
    assert ref.dtype == torch.float32 and torch.isfinite(ref).all()


def test_block_kv_depends_only_on_its_prefix() -> None:
    """Block j computed inside prompts of different lengths is the same bytes: the property that
    lets one request's stored blocks serve another."""
    engine = Engine(TINY, num_blocks=64)
    base = tokens(4 * B, seed=2)
    a, _ = full(engine, base + tokens(3, seed=3))
    b, _ = full(engine, base + tokens(2 * B + 9, seed=4))
    for j in range(4):
        assert all(torch.equal(x, y) for x, y in
                   zip(block_kv(engine, a, j), block_kv(engine, b, j), strict=True))


def test_shared_system_prompt_across_requests() -> None:
    engine = Engine(TINY, num_blocks=64)
    system = tokens(3 * B, seed=5)
    first, _ = full(engine, system + tokens(11, seed=6))
    for seed in (7, 8, 9):
        prompt = system + tokens(B + seed, seed=seed)
        ref_seq, ref = full(engine, prompt)
        seq = engine.fork(first, 3)
        assert torch.equal(engine.prefill(seq, prompt).logits, ref)
        engine.release(seq)
        engine.release(ref_seq)


def test_decode_continues_identically_and_multi_turn_reuses_prefilled_blocks() -> None:
    engine = Engine(TINY, num_blocks=64)
    turn1 = tokens(2 * B + 5, seed=10)
    s1, l1 = full(engine, turn1)
    ref_seq, ref = full(engine, turn1)
    fork = engine.fork(s1, 2)
    assert torch.equal(engine.prefill(fork, turn1).logits, ref)
    out_a, steps_a = engine.greedy(fork, l1, 12)
    out_b, steps_b = engine.greedy(ref_seq, ref, 12)
    assert out_a == out_b and len(steps_a) == 11
    assert all(torch.equal(x, y) for x, y in zip(steps_a, steps_b, strict=True))
    # Turn 2 = turn 1 + reply + new user tokens; only turn 1's prefilled full blocks are reused.
    turn2 = turn1 + out_a + tokens(9, seed=11)
    _, ref2 = full(engine, turn2)
    s2 = engine.fork(s1, s1.prefilled_blocks)
    res = engine.prefill(s2, turn2)
    assert res.reused_tokens == 2 * B and torch.equal(res.logits, ref2)


def dense_reference(model: Transformer, prompt: list[int]) -> torch.Tensor:
    """Textbook causal transformer over the whole prompt at once (no pages, no chunks)."""
    cfg = model.config
    n, d, group = len(prompt), cfg.head_dim, cfg.heads // cfg.kv_heads
    x = model.embed[torch.tensor(prompt)].double()
    pos = torch.arange(n, dtype=torch.float64)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = torch.outer(pos, inv).cos()[:, None], torch.outer(pos, inv).sin()[:, None]

    def norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return h / torch.sqrt((h * h).mean(-1, keepdim=True) + cfg.norm_eps) * w.double()

    def rope(t: torch.Tensor) -> torch.Tensor:
        a, b = t[..., : d // 2], t[..., d // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    mask = torch.ones(n, n, dtype=torch.bool).tril()
    for w in model.layers:
        h = norm(x, w.attn_norm)
        q = rope((h @ w.wq.double().T).view(n, cfg.heads, d))
        k = rope((h @ w.wk.double().T).view(n, cfg.kv_heads, d)).repeat_interleave(group, 1)
        v = (h @ w.wv.double().T).view(n, cfg.kv_heads, d).repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        p = torch.softmax(s.masked_fill(~mask, -math.inf), -1)
        x = x + torch.einsum("hqk,khd->qhd", p, v).reshape(n, -1) @ w.wo.double().T
        h = norm(x, w.mlp_norm)
        x = x + (F.silu(h @ w.w_gate.double().T) * (h @ w.w_up.double().T)) @ w.w_down.double().T
    out: torch.Tensor = norm(x[-1], model.final_norm) @ model.lm_head.double().T
    return out


def test_paged_chunked_math_matches_a_dense_transformer() -> None:
    engine = Engine(TINY, num_blocks=64)
    prompt = tokens(3 * B + 4, seed=12)
    _, logits = full(engine, prompt)
    ref = dense_reference(engine.model, prompt)
    assert torch.allclose(logits.double(), ref, rtol=1e-4, atol=1e-4)
    # Causality and context use: the last logits depend on the first token.
    _, other = full(engine, [(prompt[0] + 1) % TINY.vocab_size, *prompt[1:]])
    assert not torch.equal(other, logits)


def test_weights_are_a_function_of_the_config() -> None:
    a, b = Transformer(TINY), Transformer(TINY)
    assert torch.equal(a.layers[1].wq, b.layers[1].wq) and torch.equal(a.lm_head, b.lm_head)
    c = Transformer(replace(TINY, seed=1))
    assert not torch.equal(a.layers[1].wq, c.layers[1].wq)
    assert TINY.model_id() == ModelConfig().model_id()
    assert TINY.model_id() != replace(TINY, seed=1).model_id()
    # 2 · layers · kv_heads · head_dim · 4 bytes = 2·2·2·16·4 = 512 bytes/token; 8 KiB per block.
    assert TINY.kv_bytes_per_token() == 512 and TINY.block_bytes() == 8192


def test_pool_allocator_check_then_commit_and_refcounts() -> None:
    pool = KVPool(TINY, num_blocks=4)
    a = pool.allocate(3)
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.share(a[:2])
    pool.free(a)
    assert pool.num_free == 2 and pool.refcount(a[0]) == 1 and pool.refcount(a[2]) == 0
    pool.free(a[:2])
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0]])
    assert pool.k[0].shape == (4, B, TINY.kv_heads, TINY.head_dim)


def test_prefill_that_cannot_fit_changes_nothing() -> None:
    engine = Engine(TINY, num_blocks=3)
    seq = Sequence()
    with pytest.raises(PoolExhausted):
        engine.prefill(seq, tokens(4 * B, seed=13))
    assert engine.pool.num_free == 3 and seq.num_tokens == 0 and seq.block_table == []


def test_bad_requests_are_rejected_with_clear_errors() -> None:
    engine = Engine(TINY, num_blocks=16)
    prompt = tokens(2 * B, seed=14)
    seq, _ = full(engine, prompt)
    with pytest.raises(ValueError, match="nothing of a"):
        engine.prefill(engine.fork(seq, 2), prompt)
    with pytest.raises(ValueError, match="not a prefix"):
        engine.prefill(engine.fork(seq, 1), tokens(3 * B, seed=15))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.prefill(Sequence(), [1, 2, TINY.vocab_size])
    with pytest.raises(ValueError, match="max_positions"):
        engine.prefill(Sequence(), [0] * (TINY.max_positions + 1))
    with pytest.raises(ValueError, match="can share"):
        engine.fork(seq, 3)
    with pytest.raises(ValueError, match="fill"):
        engine.adopt(prompt[:5], [0])


@pytest.mark.parametrize(
    ("field", "value"),
    [("heads", 3), ("head_dim", 15), ("dtype", "int8"), ("layers", 0), ("block_tokens", -1)],
)
def test_config_validation(field: str, value: object) -> None:
    with pytest.raises(UsageError, match=field if field != "heads" else "multiple"):
        replace(TINY, **{field: value})


def test_unknown_preset_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown engine model"):
        get_config("huge")


@pytest.mark.gpu
def test_resume_is_bit_exact_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = get_config("demo")
    engine = Engine(cfg, num_blocks=256, device="cuda")
    prompt = tokens(20 * cfg.block_tokens + 3, seed=16, vocab=cfg.vocab_size)
    ref_seq, ref = full(engine, prompt)
    ref_out = engine.greedy(full(engine, prompt)[0], ref, 6)
    for k in (1, 7, 20):
        seq = engine.fork(ref_seq, k)
        logits = engine.prefill(seq, prompt).logits
        assert torch.equal(logits, ref)
        out, steps = engine.greedy(seq, logits, 6)
        assert out == ref_out[0]
        assert all(torch.equal(a, b) for a, b in zip(steps, ref_out[1], strict=True))
        engine.release(seq)
    cpu_ref = Engine(cfg, num_blocks=256).prefill(Sequence(), prompt).logits
    assert torch.allclose(ref, cpu_ref, rtol=1e-3, atol=1e-3)
