"""`kvtier size` end to end: real processes, exit codes, one-line errors, --json, --help."""

import argparse
import json
import subprocess
import sys

import pytest

from kvtier.cli import build_parser, main
from kvtier.core.presets import list_presets

REQUIRED_KEYS = {
    "kv_bytes_per_token",
    "block_bytes",
    "pool_pages",
    "admission_pages",
    "full_growth_pages",
    "concurrency_ceiling",
}


def kvtier(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "size", *args], capture_output=True, text=True, timeout=60
    )


def size_json(capsys, *args):
    assert main(["size", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_llama3_8b_subprocess():
    proc = kvtier("--preset", "Llama-3-8B", "--json", "--dram-bytes", "256GiB", "--reserved", "0")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert set(r) >= REQUIRED_KEYS
    # 2*32*8*128*2 = 131,072 B/token; x16 = 2 MiB/block
    assert (r["kv_bytes_per_token"], r["block_bytes"]) == (131_072, 2_097_152)
    # (80 GiB * 0.9 - 16,060,522,496 B weights - 0 reserved) / 2 MiB = 29,205 pages
    # (tests/test_size.py)
    assert r["pool_pages"] == 29_205
    # 64 x ceil(2048/16) = 8,192; 64 x ceil(2560/16) = 10,240; floor(29,205/160) = 182
    assert (r["admission_pages"], r["full_growth_pages"]) == (8_192, 10_240)
    assert r["concurrency_ceiling"] == 182
    assert r["dram"]["blocks"] == 131_072 and r["dram"]["tokens"] == 2_097_152
    assert r["ssd"] is None


def test_tp16_json(capsys):
    r = size_json(capsys, "--preset", "llama-3-8b", "--tp", "16", "--tp-rank", "15")
    # still one KV head per rank: 2*32*1*128*2 = 16,384 B; replicated twice across 16 ranks
    assert r["kv_bytes_per_token"] == 16_384
    assert r["kv_bytes_per_token_total"] == 16 * 16_384
    assert r["model"]["kv_heads_per_rank"] == 1


def test_weights_override_and_fraction(capsys):
    r = size_json(
        capsys,
        "--preset",
        "Llama-3-8B",
        "--gpu-bytes",
        "80GB",
        "--gpu-util",
        "0.5",
        "--weights",
        "10GB",
        "--reserved",
        "2GiB",
    )
    # 80e9 * 0.5 = 40e9; - 10e9 - 2,147,483,648 = 27,852,516,352 B; / 2 MiB = 13,281 pages
    assert r["usable_kv_bytes"] == 27_852_516_352
    assert r["pool_pages"] == 13_281


def test_weights_that_do_not_fit(capsys):
    r = size_json(capsys, "--preset", "Llama-3-70B", "--gpu-bytes", "80GB")
    # 70.55e9 params * 2 B = 141 GB > 72 GB budget: nothing usable, nothing fits
    assert r["usable_kv_bytes"] < 0
    assert r["pool_pages"] == 0 and r["concurrency_ceiling"] == 0
    assert not r["admission_fits"]


def test_custom_flags_match_preset(capsys):
    preset = size_json(capsys, "--preset", "gpt-oss-20b", "--weights", "13GB", "--reserved", "1GB")
    custom = size_json(
        capsys,
        "--layers",
        "24",
        "--kv-heads",
        "8",
        "--head-dim",
        "64",
        "--attention-heads",
        "64",
        "--layer-pattern",
        "sliding,full",
        "--window",
        "128",
        "--weights",
        "13GB",
        "--reserved",
        "1GB",
    )
    assert custom["fingerprint"] == preset["fingerprint"]
    for key in REQUIRED_KEYS:
        assert custom[key] == preset[key]


def test_custom_mla_and_recurrent(capsys):
    mla = size_json(capsys, "--layers", "61", "--kv-lora-rank", "512", "--rope-dim", "64")
    assert mla["kv_bytes_per_token"] == 61 * 576 * 2
    hybrid = size_json(
        capsys,
        "--layers",
        "8",
        "--kv-heads",
        "2",
        "--head-dim",
        "128",
        "--layer-pattern",
        "recurrent,recurrent,recurrent,full",
        "--state-bytes",
        "1MiB",
    )
    # 2 full layers * 2 * 2 heads * 128 * 2 B = 2,048 B/token; 6 MiB of state per sequence
    assert hybrid["kv_bytes_per_token"] == 2048
    assert hybrid["state_bytes_per_sequence"] == 6 * 2**20


def test_hf_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "mistral",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "sliding_window": 4096,
                "vocab_size": 32000,
            }
        )
    )
    from_file = size_json(capsys, "--hf-config", str(cfg))
    preset = size_json(capsys, "--preset", "Mistral-7B-v0.1")
    assert from_file["fingerprint"] == preset["fingerprint"]
    assert from_file["weights_bytes"] == preset["weights_bytes"]  # params estimated from dims


def test_table_prints_formula_and_units():
    proc = kvtier("--preset", "Llama-3-8B", "--gpu-bytes", "80GB", "--ssd-bytes", "4TB")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "131,072 B (128 KiB) = 2 x 32 full layers x 8 heads x 128 x 2 B" in out
    assert "80GB: GB = 10^9 B" in out
    assert "4,000,000,000,000 B (TB = 10^12 B)" in out
    assert "concurrency ceiling at full length" in out


def test_list_presets():
    proc = kvtier("--list-presets")
    assert proc.returncode == 0
    assert [line.split()[0] for line in proc.stdout.splitlines()] == list_presets()


def test_help_documents_every_option():
    proc = kvtier("--help")
    assert proc.returncode == 0
    parser = build_parser("size")
    sub = next(a for a in parser._actions if a.dest == "command").choices["size"]
    shown = [a for a in sub._actions if a.help != argparse.SUPPRESS]  # not the old aliases
    flags = [s for a in shown for s in a.option_strings if s.startswith("--")]
    assert len(flags) > 25
    for flag in flags:
        assert flag in proc.stdout
    for action in sub._actions:
        assert action.help, f"{action.option_strings} has no help text"


BAD = [
    (["--preset", "no-such-model"], "unknown preset 'no-such-model'"),
    (["--preset", "Llama-3-8B", "--tp", "3"], "TP size 3 does not divide the 32 attention heads"),
    (
        [
            "--layers",
            "4",
            "--kv-heads",
            "8",
            "--head-dim",
            "64",
            "--attention-heads",
            "48",
            "--tp",
            "6",
        ],
        "TP size 6 does not divide the 8 KV heads",
    ),
    (["--preset", "Llama-3-8B", "--block-tokens", "0"], "--block-tokens must be >= 1"),
    (["--preset", "Llama-3-8B", "--gpu-util", "1.2"], "--gpu-util must be in (0, 1]"),
    (["--preset", "Llama-3-8B", "--gpu-util", "0"], "--gpu-util must be in (0, 1]"),
    (["--preset", "Llama-3-8B", "--gpu-util", "nan"], "--gpu-util must be in (0, 1]"),
    (["--preset", "Llama-3-8B", "--concurrency", "-3"], "--concurrency must be >= 1"),
    (["--preset", "Llama-3-8B", "--prompt-tokens", "1.5"], "--prompt-tokens must be an integer"),
    (["--layers", "-2", "--kv-heads", "8", "--head-dim", "64"], "--layers must be >= 1"),
    (["--layers", "32", "--kv-heads", "8"], "this model needs --head-dim"),
    (
        ["--layers", "4", "--kv-heads", "2", "--head-dim", "8", "--layer-pattern", "sliding"],
        "this model needs --window",
    ),
    (
        ["--layers", "4", "--kv-heads", "2", "--head-dim", "8", "--layer-pattern", "swa"],
        "unknown kind 'swa'",
    ),
    (["--preset", "Llama-3-8B", "--layers", "4"], "give one model source"),
    ([], "no model"),
    (["--hf-config", "/nonexistent/config.json"], "cannot read config"),
    (["--preset", "Llama-3-8B", "--gpu-bytes", "80G"], "ambiguous"),
    (["--preset", "Llama-3-8B", "--dram-bytes=-1GB"], "negative"),
    (["--preset", "Llama-3-8B", "--dtype", "int4"], "unknown dtype 'int4'"),
    (["--preset", "Llama-3-8B", "--tp-rank", "1"], "out of range"),
    (["--preset", "Llama-3-8B", "--params", "eight"], "--params must be a number"),
    (["--preset", "Llama-3-8B", "--concurrency"], "expected one argument"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_one_line_exit_2(args, message):
    proc = kvtier(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvtier size: error: ")
    assert message in lines[0]


def test_incomplete_config_exit_2(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"hidden_size": 4096, "num_hidden_layers": 32}')
    proc = kvtier("--hf-config", str(cfg))
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("config lacks 'num_attention_heads'")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", list_presets())
def test_every_section_as_json_for_every_preset(name, capsys, tmp_path, monkeypatch):
    # gpt-oss/Mistral windows make the cost model return numpy floats: --json must still encode
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    args = ["--tiers", "--pd", "--samples", "4", "--overload", "6144", "--ssd-bytes", "4TB"]
    args += ["--ssd-writes-per-day", "5TB", "--dtype", "fp8", "--scale-layout", "per-channel"]
    r = size_json(capsys, "--preset", name, *args)
    for key in ("tiers", "pd", "samples", "overload", "quantized", "hybrid", "gpu_memory"):
        assert r[key], key
    assert isinstance(r["tiers"]["tiers"]["dram"]["worth_it"], bool)


def test_replicated_kv_is_counted_once_in_host_tiers():
    """Defect: `size` charged every rank's copy of replicated KV to the host tiers, while the
    connector stores one: DeepSeek-V3 at TP 8 in 1 TiB of DRAM read 1,955,808 tokens."""
    proc = kvtier("--preset", "DeepSeek-V3", "--tp", "8", "--dram-bytes", "1TiB", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    # MLA: 61 x (512 + 64) x 2 B = 70,272 B/token on every rank, stored once;
    # 2^40 // (16 x 70,272 = 1,124,352) = 977,906 blocks x 16 = 15,646,496 tokens
    assert (r["kv_copies_stored"], r["block_bytes_stored"]) == (1, 1_124_352)
    assert r["dram"]["tokens"] == 15_646_496
    table = kvtier("--preset", "DeepSeek-V3", "--tp", "8", "--dram-bytes", "1TiB")
    assert "15,646,496 tokens of the whole model (TP 8, replicated KV stored once)" in table.stdout
    assert "kvtier stores it once" in table.stdout
    # GQA beyond the KV heads: Llama-3-8B at TP 16 holds 8 shards of 16 KiB/token, each twice
    r = json.loads(kvtier("--preset", "Llama-3-8B", "--tp", "16", "--dram-bytes", "1TiB",
                          "--json").stdout)
    assert (r["kv_copies_stored"], r["kv_bytes_per_token_stored"]) == (8, 131_072)
    # 2^40 // (8 x 256 KiB) = 524,288 blocks x 16 = 8,388,608 tokens (TP 8 holds as many)
    assert r["dram"]["tokens"] == 8_388_608


@pytest.mark.parametrize(("preset", "tp"), [("DeepSeek-V3", 8), ("DeepSeek-V3", 2),
                                             ("Llama-3-8B", 16), ("Llama-3-8B", 4),
                                             ("Llama-3-8B", 1)])
def test_stored_copies_are_the_ranks_the_connector_saves_from(preset, tp):
    """`size` counts a block of the TP group as the vLLM connector stores it: one copy per
    rank whose shard says `saves` (kvtier.integrations.vllm.layout.kv_shard)."""
    from kvtier.core.layout import AttentionKind
    from kvtier.core.presets import get_preset
    from kvtier.integrations.vllm.layout import kv_shard

    spec = get_preset(preset)
    mla = spec.layers[0].kind is AttentionKind.MLA
    savers = sum(kv_shard(tp, r, spec.num_kv_heads, replicated=mla).saves for r in range(tp))
    layout = spec.layout(tp_size=tp)
    assert layout.kv_copies == savers
    assert layout.block_bytes_stored() == savers * layout.block_bytes()
