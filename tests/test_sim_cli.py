"""`kvtier simulate` end to end, as a user runs it (subprocess), plus the progress bar."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.sim.progress import progress_bar

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
GOOD = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}'
JSON_KEYS = {
    "hit_ratio",
    "hit_ratio_by_tier",
    "infinite_hit_ratio",
    "belady_hit_ratio",
    "ssd_blocks_written",
    "stranded_blocks",
    "promotions",
    "demotions",
}


def simulate(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=240,
        **kw,
    )


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("{not json", "malformed JSON"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [7]}', ">= 0"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "integer"),
    ],
)
def test_bad_trace_line_exits_2_with_line_number(tmp_path, bad, needle):
    trace = tmp_path / "t.jsonl"
    trace.write_text(f"{GOOD}\n{GOOD}\n{bad}\n{GOOD}\n")
    p = simulate("--trace", str(trace), "--dram-blocks", "10")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "t.jsonl:3: " in p.stderr and needle in p.stderr
    assert p.stderr.startswith("kvtier simulate: error: ")
    assert p.stdout == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dram-bytes", "64GiB"], "give --preset NAME, --hf-config PATH"),
        (["--dram-blocks", "10", "--preset", "no-such-model"], "unknown preset"),
        (["--dram-blocks", "ten"], "whole number of blocks"),
        (["--dram-blocks", "-3"], ">= 0"),
        (["--dram-blocks", "10", "--ssd-admit-after", "0"], "--ssd-admit-after"),
        (["--dram-blocks", "10", "--admission-history", "-1"], "--admission-history"),
        (["--dram-blocks", "10", "--plot", "out.txt"], ".png"),
        (["--dram-blocks", "10", "--plot", "/no/such/dir/x.png"], "does not exist"),
        (["--dram-blocks", "10", "--requests", "0"], "--requests"),
        (["--dram-blocks", "10", "--plot", "x.png", "--sweep-points", "1"], "--sweep-points"),
        (["--dram-blocks", "1.5"], "whole number of blocks"),
        (["--dram-bytes", "1.5"], "without a unit"),
        (["--dram-blocks", "1", "--dram-bytes", "1GiB"], "one DRAM capacity"),
        (["--dram-bytes", "1GiB", "--preset", "Llama-3-8B", "--tp", "3"], "TP size 3"),
        (["--dram-bytes", "1GiB", "--preset", "Llama-3-8B", "--block-bytes", "2MiB"], "not both"),
    ],
)
def test_bad_flags_exit_2_without_traceback(args, needle):
    p = simulate("--workload", "chat", *args)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr


def test_missing_trace_file_and_workload_flags_with_a_trace_exit_2(tmp_path):
    p = simulate("--trace", str(tmp_path / "none.jsonl"), "--dram-blocks", "10")
    assert p.returncode == 2 and "cannot read trace" in p.stderr
    p = simulate("--trace", str(tmp_path / "none.jsonl"), "--dram-blocks", "10", "--seed", "3")
    assert p.returncode == 2 and "shape a --workload" in p.stderr


def test_json_on_sample_trace_has_the_promised_keys_and_values():
    if not SAMPLE.exists():
        pytest.skip("sample trace not present")
    p = simulate("--trace", str(SAMPLE), "--dram-blocks", "4000", "--ssd-blocks", "16000", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc.keys() >= JSON_KEYS
    assert set(doc["hit_ratio_by_tier"]) == {"dram", "ssd"}
    assert doc["hit_ratio"] == pytest.approx(sum(doc["hit_ratio_by_tier"].values()))
    # 121,877 - 43,924 distinct = 77,953 infinite-cache hits.
    assert doc["infinite_hit_ratio"] == pytest.approx(77_953 / 121_877)
    assert doc["infinite_hit_ratio"] >= doc["belady_hit_ratio"] >= doc["hit_ratio"] > 0
    assert doc["stranded_blocks"] == 0
    assert doc["block_refs"] == 121_877 and doc["requests"] == 3993
    assert p.stderr == ""  # not a TTY: no progress bar


def test_admission_history_flag_changes_admission():
    if not SAMPLE.exists():
        pytest.skip("sample trace not present")
    docs = {}
    for n in ("0", "20000"):
        p = simulate("--trace", str(SAMPLE), "--dram-blocks", "4000", "--ssd-blocks", "16000",
                     "--json", "--admission-history", n)
        assert p.returncode == 0, p.stderr
        docs[n] = json.loads(p.stdout)
    off, on = docs["0"], docs["20000"]
    assert off["admission_history"] == {"words": 0, "recalled": 0}
    assert on["admission_history"]["words"] == 20_000 and on["admission_history"]["recalled"] > 0
    # the same SSD write budget as `kvtier serve` (1 drive write a day, in blocks here) binds:
    # both write what it grants; blocks committed again start at their remembered count and
    # ask to be written at their Commit, so more write-backs are refused with the history
    for doc in (off, on):
        assert doc["ssd_write_budget"]["bytes_per_day"] == 16_000
        assert doc["ssd_blocks_written"] == off["ssd_blocks_written"] < 4_000 + 200
    assert on["ssd_write_budget"]["refused_writes"] > off["ssd_write_budget"]["refused_writes"] > 0


def test_byte_capacities_with_a_model_preset():
    # Llama-3-8B bf16: 128 KiB/token x 512 tokens = 64 MiB per trace block; 1 GiB = 16 blocks,
    # 2 GiB = 32 blocks.
    p = simulate(
        "--workload",
        "docqa",
        "--requests",
        "200",
        "--dram-bytes",
        "1GiB",
        "--ssd-bytes",
        "2GiB",
        "--preset",
        "Llama-3-8B",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    cap = json.loads(p.stdout)["capacity"]
    assert cap == {
        "dram_blocks": 16,
        "ssd_blocks": 32,
        "block_bytes": 64 * 2**20,
        "dram_bytes": 2**30,
        "ssd_bytes": 2**31,
    }


def test_table_output_and_plot(tmp_path):
    out = tmp_path / "hit.png"
    p = simulate(
        "--workload",
        "chat",
        "--requests",
        "300",
        "--dram-blocks",
        "200",
        "--ssd-blocks",
        "400",
        "--plot",
        str(out),
        "--sweep-points",
        "3",
    )
    assert p.returncode == 0, p.stderr
    for needle in ("prefix hits", "from SSD", "Belady MIN", "stranded blocks", "plot: "):
        assert needle in p.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None; from kvtier.cli import main; "
        f"sys.exit(main(['simulate', '--workload', 'chat', '--dram-blocks', '10', '--plot', "
        f"{str(tmp_path / 'x.png')!r}]))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "needs matplotlib" in p.stderr and "pip install 'matplotlib>=3.8'" in p.stderr
    assert not (tmp_path / "x.png").exists()


def test_progress_bar_draws_on_stderr_only_when_shown(capsys):
    with progress_bar(10, "replay", show=True) as advance:
        advance(10)
    assert "replay" in capsys.readouterr().err
    with progress_bar(10, "replay", show=False) as advance:
        advance(10)
    assert capsys.readouterr() == ("", "")


LLAMA3_8B_CONFIG = {  # published config.json fields of meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def test_hf_config_gives_the_presets_byte_capacities(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA3_8B_CONFIG))
    common = ("--workload", "docqa", "--requests", "100", "--dram-bytes", "1GiB",
              "--ssd-bytes", "2GiB", "--json")
    by_file = simulate(*common, "--hf-config", str(cfg))
    by_preset = simulate(*common, "--preset", "Llama-3-8B")
    assert by_file.returncode == 0 and by_preset.returncode == 0, by_file.stderr
    assert json.loads(by_file.stdout)["capacity"] == json.loads(by_preset.stdout)["capacity"]
    assert json.loads(by_file.stdout)["capacity"]["block_bytes"] == 64 * 2**20
    both = simulate(*common, "--hf-config", str(cfg), "--preset", "Llama-3-8B")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    missing = simulate(*common, "--hf-config", str(tmp_path / "none.json"))
    assert missing.returncode == 2 and "cannot read config" in missing.stderr


def test_old_flags_are_deprecated_aliases_with_the_same_result():
    new = simulate("--workload", "chat", "--requests", "200", "--dram-blocks", "100",
                   "--ssd-blocks", "400", "--ssd-admit-after", "1", "--json")
    old = simulate("--workload", "chat", "--requests", "200", "--dram", "100", "--ssd", "400",
                   "--ssd-admit-k", "1", "--json")
    assert new.returncode == 0 and old.returncode == 0, old.stderr
    timing = ("replay_seconds", "replay_cpu_seconds")
    a, b = ({k: v for k, v in json.loads(p.stdout).items() if k not in timing} for p in (new, old))
    assert a == b
    assert new.stderr == ""
    assert old.stderr.splitlines() == [
        "kvtier simulate: warning: --dram is deprecated, use --dram-blocks N or --dram-bytes SIZE",
        "kvtier simulate: warning: --ssd is deprecated, use --ssd-blocks N or --ssd-bytes SIZE",
        "kvtier simulate: warning: --ssd-admit-k is deprecated, use --ssd-admit-after",
    ]
    model = simulate("--workload", "chat", "--requests", "50", "--dram", "1GiB", "--model",
                     "Llama-3-8B", "--json")
    assert model.returncode == 0 and "--model is deprecated, use --preset" in model.stderr
    assert json.loads(model.stdout)["capacity"]["dram_blocks"] == 16
    for old_flag in ("--dram", "--ssd", "--model", "--ssd-admit-k"):  # hidden from --help
        assert old_flag + " " not in simulate("--help").stdout


def test_simulate_applies_the_write_budget_serve_enforces():
    """`kvtier serve` spends at most `ssd_dwpd` (1) drive writes a day with a quarter-day burst;
    the replay refuses what that budget refuses, and says so."""
    p = simulate("--workload", "docqa", "--requests", "1000", "--dram-blocks", "200",
                 "--ssd-blocks", "2000",
                 "--ssd-admit-after", "1", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    budget = doc["ssd_write_budget"]
    assert budget["bytes_per_day"] == 2000 and budget["burst_bytes"] == 500  # in blocks here
    assert budget["refused_writes"] > 0
    assert 500 <= doc["ssd_blocks_written"] < 520  # the burst, plus what the trace's time refills
    p = simulate("--workload", "docqa", "--requests", "1000", "--dram-blocks", "200",
                 "--ssd-blocks", "2000",
                 "--ssd-admit-after", "1")
    assert "SSD writes refused by the write budget" in p.stdout


def test_byte_capacity_counts_replicated_kv_once():
    """Defect: a byte capacity was divided by every rank's copy of replicated KV (DeepSeek-V3
    at TP 8: 3,819 blocks in 1 TiB), while kvtier stores one copy."""
    proc = simulate("--workload", "chat", "--requests", "20", "--quiet", "--preset",
                    "DeepSeek-V3", "--tp", "8", "--dram-bytes", "1TiB", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    cap = doc["capacity"]
    # 512 tokens x 61 x (512 + 64) x 2 B = 35,979,264 B, stored once: 2^40 // that = 30,559
    assert (cap["block_bytes"], cap["dram_blocks"]) == (35_979_264, 30_559)
    assert "stores it once" in doc["block_note"]
    table = simulate("--workload", "chat", "--requests", "20", "--quiet", "--preset",
                     "DeepSeek-V3", "--tp", "8", "--dram-bytes", "1TiB")
    assert "block: a 512-token block of DeepSeek-V3 at TP 8, bf16: 35,979,264 B" in table.stdout
