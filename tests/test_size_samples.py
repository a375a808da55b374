"""`kvtier size --samples`: parallel sampling with and without sharing, worked by hand (28.2)."""

import json

import pytest

from kvtier.cli import main
from kvtier.core.errors import UsageError
from kvtier.core.presets import get_preset
from kvtier.core.sizing import parallel_sampling

LLAMA8 = get_preset("Llama-3-8B").layout()


def test_aligned_prompt():
    s = parallel_sampling(LLAMA8, 2048, 512, 8)
    # each sample alone: ceil(2,560 / 16) = 160 pages; 8 of them 1,280
    assert s.unshared_pages == 1280
    # vLLM v1: a hit stops at 2,047 tokens -> floor(2,047 / 16) = 127 shared blocks;
    #   127 + 8 x (160 - 127) = 391 pages; each child recomputes 2,048 - 127 x 16 = 16 tokens
    assert (s.shared_blocks, s.shared_pages, s.recomputed_tokens) == (127, 391, 16)
    assert round(s.saving, 5) == round(1 - 391 / 1280, 5)
    # copy-on-write: 128 shared + 8 x 32 = 384; the prompt fills its last block: no copy
    assert (s.cow_shared_blocks, s.cow_pages, s.cow_copies) == (128, 384, 0)


def test_unaligned_prompt_copies_on_first_decode_token():
    s = parallel_sampling(LLAMA8, 2010, 100, 8)
    # ceil(2,110 / 16) = 132 pages each, 1,056 alone; floor(2,009 / 16) = 125 shared:
    #   125 + 8 x 7 = 181 pages; each child recomputes 2,010 - 2,000 = 10 tokens
    assert (s.unshared_pages, s.shared_pages, s.recomputed_tokens) == (1056, 181, 10)
    # copy-on-write: 125 shared too, and 7 copies of the 10-token block at the first decode token
    assert (s.cow_shared_blocks, s.cow_pages, s.cow_copies) == (125, 181, 7)


def test_saving_fades_with_long_outputs(capsys):
    assert main(["size", "--json", "--preset", "Llama-3-8B", "--samples", "8"]) == 0
    s = json.loads(capsys.readouterr().out)["samples"]
    # saving = 7 x 127 / (8 T) with T = ceil((2,048 + O) / 16); < 10% when T >= 1,112, i.e.
    #   2,048 + O > 1,111 x 16 = 17,776 -> O >= 15,729
    assert s["saving_below_10pct_from_output"] == 15_729
    assert s["cow_copy_bytes"] == 0
    assert main(["size", "--json", "--preset", "Llama-3-8B", "--samples", "8",
                 "--prompt-tokens", "2010", "--max-output-tokens", "100"]) == 0
    s = json.loads(capsys.readouterr().out)["samples"]
    assert s["cow_copy_bytes"] == 7 * 2_097_152  # 7 blocks of 2 MiB


def test_window_groups_are_not_shared():
    oss = get_preset("gpt-oss-20b").layout()
    s = parallel_sampling(oss, 2048, 512, 4)
    # full group: 160 pages each; window group min(160, 9) = 9 each (not shared)
    # unshared 4 x 169 = 676; shared 127 + 4 x 33 + 4 x 9 = 295
    assert (s.unshared_pages, s.shared_pages) == (676, 295)


def test_text_and_bad_input(capsys):
    assert main(["size", "--preset", "Llama-3-8B", "--samples", "8"]) == 0
    out = capsys.readouterr().out
    assert "vLLM v1 prefix caching   127 shared = floor((2,048 - 1) / 16), 391 pages" in out
    assert main(["size", "--preset", "Llama-3-8B", "--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err
    with pytest.raises(UsageError):
        parallel_sampling(LLAMA8, 0, 1, 1)
