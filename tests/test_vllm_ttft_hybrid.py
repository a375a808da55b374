"""`python -m bench.vllm_ttft --hybrid [gpt-oss|qwen3-next]`: the arithmetic the run is sized and
judged by (the models' layer pattern, a Gated DeltaNet layer's state, the block vLLM runs such a
model at) and its command-line errors. The engine run itself is the benchmark
(docs/benchmarks.md), not a test."""

from __future__ import annotations

import pytest

from bench.vllm_ttft import (
    first_token_agrees,
    gdn_state_bytes,
    hybrid_config,
    main,
    state_block_tokens,
)
from tests.support.hybrid_models import MODELS


def test_layer_patterns_and_heads() -> None:
    q = hybrid_config("qwen3-next", 8, 512, 9216)
    assert q["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] \
        + ["linear_attention"] * 3 + ["full_attention"]
    assert (q["num_attention_heads"], q["num_key_value_heads"]) == (8, 4)
    assert (q["linear_num_key_heads"], q["linear_num_value_heads"]) == (4, 8)
    assert q["max_position_embeddings"] == 9216
    g = hybrid_config("gpt-oss", 4, 512, 9216)
    assert g["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert g["model_type"] == "gemma3_text"


def test_state_bytes_and_the_block_vllm_picks() -> None:
    # tests/test_vllm_state.py's model (vLLM's own figure there: 3x512 bf16 + 4x64x64 float32,
    # run at 160-token blocks with 512 attention bytes a token): 3072 + 65536
    assert gdn_state_bytes(MODELS["qwen3-next"]) == 68608
    assert state_block_tokens(68608, 512) == 160  # 134 tokens -> the next multiple of 32
    # the bench's default (hidden 512): conv 3 x (2 x 4 x 64 + 8 x 64) x 2 B = 6144,
    # recurrent 8 x 64 x 64 x 4 B = 131072; 1024 attention bytes a token -> 134 -> 160
    q = hybrid_config("qwen3-next", 8, 512, 9216)
    assert gdn_state_bytes(q) == 137216
    assert state_block_tokens(137216, 1024) == 160
    assert state_block_tokens(0, 1024) == 32  # no state: the bench's 32-token blocks
    assert state_block_tokens(32 * 1024, 1024) == 32  # exactly one page's worth fits


@pytest.mark.parametrize(("argv", "message"), [
    (["--hybrid", "mamba"], "argument --hybrid: invalid choice: 'mamba' (choose from"),
    (["--hybrid", "qwen3-next", "--layers", "6"],
     "--layers must be a multiple of 4 for the qwen3-next-like shape"),
    (["--hybrid", "--layers", "3"], "--layers must be a multiple of 2 for the gpt-oss-like shape"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m bench.vllm_ttft: error: ") and message in last, last


# first-token logprobs of a miss and its hit, from a gpt-oss-like run at 8K (2026-12-02):
# the miss's top two 0.0078 apart, the hit (its last 32 tokens computed in another chunk)
# within 0.0078 of the miss everywhere but with the tie the other way round
MISS = {"token": 4025, "logprobs": {4025: -6.7624, 1254: -6.7702, 2904: -6.8483, 742: -6.9343,
                                    2921: -6.9655}}
HIT = {"token": 1254, "logprobs": {1254: -6.7702, 4025: -6.7702, 2904: -6.8483, 742: -6.9264,
                                   2921: -6.9733}}


def test_a_hit_agrees_with_its_miss_same_token_or_near_tie() -> None:
    assert first_token_agrees(MISS, MISS) == "same"
    assert first_token_agrees(MISS, HIT) == "tie"  # largest difference 0.0079 <= 0.02
    assert first_token_agrees(MISS, HIT, tolerance=0.005) == "differs"
    # logprobs within the tolerance but a token the miss scored 0.0859 below its own
    assert first_token_agrees(MISS, {**HIT, "token": 2904}) == "differs"
    # the same token, but a changed context moved the logprobs by 0.3
    moved = {"token": 4025, "logprobs": {t: v - 0.3 * (t != 4025)
                                         for t, v in MISS["logprobs"].items()}}
    assert first_token_agrees(MISS, moved) == "differs"
