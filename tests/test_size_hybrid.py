"""`kvtier size` on hybrid models (issue 21 item 7): per-group KV and state, vLLM's block size for
a model with recurrent layers, what the window saves at 128K. Hand-worked numbers in comments."""

import json
import subprocess
import sys

import pytest

from kvtier.cli import main
from tests.test_hfconfig import GEMMA2_9B, LLAMA4_SCOUT, QWEN3_NEXT


def write(tmp_path, name, doc):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(doc))
    return str(d)


def size_json(capsys, *args):
    assert main(["size", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_gemma2_groups_and_window_saving(tmp_path, capsys):
    r = size_json(capsys, "--hf-config", write(tmp_path, "gemma-2-9b", GEMMA2_9B))
    h = r["hybrid"]
    assert [(g["layer"], g["layers"]) for g in h["groups"]] == [
        ("sliding(window=4096)", 21),
        ("full", 21),
    ]
    # each group 21 layers x 2 x 8 heads x 256 x 2 B = 172,032 B/token
    assert [g["kv_bytes_per_token"] for g in h["groups"]] == [172_032, 172_032]
    # at 131,072 tokens: window group min(8,192, ceil(4,095 + 1)/16 + 1) = 257 pages
    assert [g["pages_at_context"] for g in h["groups"]] == [257, 8192]
    w = h["window"]
    # all full: 131,072 x 344,064 B = 45,097,156,608; hybrid: (8,192 + 257) x 16 x 21 x 8,192
    #   = 8,449 x 2,752,512 = 23,255,973,888 B; 1 - 8,449/16,384 = 0.484314
    assert (w["all_full_bytes"], w["hybrid_bytes"]) == (45_097_156_608, 23_255_973_888)
    assert w["hybrid_saving"] == 0.484314 and w["layer_ratio"] == 0.5
    assert w["hybrid_off_bytes"] == 45_097_156_608 and w["hybrid_off_saving"] == 0.0
    # params with the tied default: 9,241,705,984 (tests/test_hfconfig.py)
    assert r["model"]["total_params"] == 9_241_705_984
    assert any("tie_word_embeddings absent: true" in x for x in h["config_rules"])


def test_qwen3_next_state_per_request_and_checkpoint(tmp_path, capsys):
    cfg = write(tmp_path, "qwen3-next", QWEN3_NEXT)
    r = size_json(capsys, "--hf-config", cfg)
    h = r["hybrid"]
    # vLLM raises the block to 16 x ceil(1,097,728 / 32,768) = 544 tokens
    assert r["block_tokens"] == 544 and "16 -> 544" in h["block_note"]
    # page: 544 tokens x 12 layers x 2,048 B = 13,369,344 B (state 12 x 1,097,728 = 13,172,736
    #   padded up to it); 3 recurrent groups + 1 full group
    assert r["page_bytes"] == 13_369_344
    kinds = [g["kind"] for g in h["groups"]]
    assert kinds == ["recurrent"] * 3 + ["full"]
    assert {g["state_content_bytes"] for g in h["groups"][:3]} == {13_172_736}
    # per checkpoint: one page of each recurrent group = 3 x 13,369,344 = 40,108,032 B;
    # per request in align mode: 2 pages each = 80,216,064 B
    assert h["state_bytes_per_checkpoint"] == 40_108_032
    assert h["state_bytes_per_request"] == 80_216_064
    # 2,048-token prompt + 512 out: 3 x 2 state pages + ceil(2,048/544) = 4 -> 10 at admission
    assert r["admission_pages_per_seq"] == 10 and r["full_growth_pages_per_seq"] == 11
    none = size_json(capsys, "--hf-config", cfg, "--mamba-cache-mode", "none")
    assert none["hybrid"]["state_bytes_per_request"] == 40_108_032
    assert none["admission_pages_per_seq"] == 3 + 4


def test_llama4_chunked_note(tmp_path, capsys):
    r = size_json(capsys, "--hf-config", write(tmp_path, "scout", LLAMA4_SCOUT))
    assert r["hybrid"]["chunked_layers"] == 36 and r["hybrid"]["chunk_size"] == 8192
    assert r["kv_bytes_per_token"] == 196_608
    c = r["hybrid"]["chunked_if_enabled"]
    # with the env var: 36 chunked + 12 full -> group size 12: 3 chunked groups holding
    #   ceil((8,192 + 1) / 16) = 513 pages, 1 full group 8,192 pages at 131,072 tokens; page
    #   16 x 12 x 4,096 B = 786,432: 9,731 x 786,432 = 7,652,769,792 B vs all full
    #   8,192 x 16 x 48 x 4,096 = 25,769,803,776 B
    assert (c["chunked_groups"], c["pages_per_chunked_group"], c["full_groups"]) == (3, 513, 1)
    assert (c["hybrid_bytes"], c["all_full_bytes"]) == (7_652_769_792, 25_769_803_776)


def test_text_prints_groups_and_saving(tmp_path):
    cfg = write(tmp_path, "gemma-2-9b", GEMMA2_9B)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "size", "--hf-config", cfg],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "gemma2: no layer_types; layer i slides (window 4096) when (i + 1) % 2 != 0" in out
    assert "hybrid manager on         23,255,973,888 B (21.66 GiB), saves 48.4%" in out
    assert "(at most 50.0% = sliding / attention layers)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--context", "0"], "--context must be >= 1"),
        (["--context", "128K"], "--context must be an integer"),
        (["--mamba-cache-mode", "all"], "invalid choice"),
    ],
)
def test_bad_hybrid_options(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "size", "--preset", "gpt-oss-20b", *args],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
