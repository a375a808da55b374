"""A new user's rough edges in the CLI: no abbreviated flags, a client without a daemon fails
fast, `--print-config` round-trips through `--config`, errors name the variable, `--help` shows
every default and its variable."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.cli import COMMANDS, build_parser
from kvtier.client.async_client import AsyncClient
from kvtier.client.sync_client import Client, KvtierUnavailable, LayoutDecl

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = LayoutDecl(fingerprint=b"edges/v1", block_bytes=4096, block_tokens=16, model_id="m@1")


def kvtier(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True,
                          text=True, timeout=60, env={**env, "PYTHONPATH": str(ROOT)})


def clean_env(tmp: Path) -> dict[str, str]:
    return {"HOME": str(tmp), "PATH": os.environ.get("PATH", "/usr/bin"),
            "XDG_RUNTIME_DIR": str(tmp / "run")}


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_accepts_an_abbreviated_flag(command: str) -> None:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = [o for o in _long_options(sub.choices[command]) if o != "--help"]
    assert options
    for option in options:
        prefix = option[:-1]
        if any(o != option and o.startswith(prefix) for o in options):
            continue  # ambiguous anyway
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([command, prefix, "1"])
        assert exc.value.code == 2, option


def test_serve_refuses_a_typo_flag(tmp_path: Path) -> None:
    proc = kvtier("serve", "--ssd-byte", "2GiB", "--print-config", env=clean_env(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "kvtier serve: error: unrecognized argument --ssd-byte; did you mean --ssd-bytes? "
        "(see --help)"]


@pytest.mark.parametrize(("args", "line"), [
    (["serve", "--dram", "4GiB"], "kvtier serve: error: unrecognized argument --dram; did you "
     "mean --dram-bytes? (see --help)"),
    (["serve", "--ssd-admit-k=3"], "kvtier serve: error: unrecognized argument --ssd-admit-k; "
     "did you mean --ssd-admit-after? (see --help)"),
    (["simulate", "--workload", "chat", "--dram-block", "4"], "kvtier simulate: error: "
     "unrecognized argument --dram-block; did you mean --dram-blocks? (see --help)"),
    (["stats", "--sockt", "x"], "kvtier stats: error: unrecognized argument --sockt; did you "
     "mean --socket? (see --help)"),
    (["serve", "--zzz"], "kvtier serve: error: unrecognized argument --zzz (see --help)"),
    (["serve", "extra"], "kvtier serve: error: unrecognized argument 'extra' (see --help)"),
])
def test_a_flag_typo_names_the_closest_flag(tmp_path: Path, args: list[str], line: str) -> None:
    proc = kvtier(*args, env=clean_env(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [line]


def test_size_old_flags_are_deprecated_aliases_with_the_same_result(tmp_path: Path) -> None:
    env = {**clean_env(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    base = ["size", "--preset", "Llama-3-8B", "--json"]
    new = kvtier(*base, "--gpu-bytes", "48GB", "--dram-bytes", "256GiB", "--ssd-bytes", "4TB",
                 env=env)
    old = kvtier(*base, "--gpu-mem", "48GB", "--dram", "256GiB", "--ssd", "4TB", env=env)
    assert new.returncode == 0 and old.returncode == 0, old.stderr
    assert json.loads(old.stdout) == json.loads(new.stdout)
    assert json.loads(old.stdout)["gpu_bytes"] == 48_000_000_000  # the old flag's value is used
    assert json.loads(old.stdout)["dram"]["bytes"] == 256 << 30
    assert new.stderr == ""
    assert old.stderr.splitlines() == [
        "kvtier size: warning: --gpu-mem is deprecated, use --gpu-bytes",
        "kvtier size: warning: --dram is deprecated, use --dram-bytes",
        "kvtier size: warning: --ssd is deprecated, use --ssd-bytes",
    ]
    shown = kvtier("size", "--help", env=env).stdout
    assert "--gpu-bytes SIZE" in shown
    for old_flag in ("--gpu-mem", "--dram", "--ssd"):  # hidden from --help
        assert old_flag + " " not in shown


def test_demo_model_is_a_deprecated_alias_of_preset(tmp_path: Path) -> None:
    """`demo --model tiny` still picks the tiny model (its 4,096-position limit is what refuses
    this long a conversation, before any daemon or engine starts) and says to use --preset."""
    too_long = ["--turns", "50", "--system-tokens", "4096"]
    refused = ("kvtier demo: error: the conversation reaches 13296 tokens; model 'tiny' holds "
               "4096: use fewer --turns or --system-tokens")
    new = kvtier("demo", "--preset", "tiny", *too_long, env=clean_env(tmp_path))
    old = kvtier("demo", "--model", "tiny", *too_long, env=clean_env(tmp_path))
    assert new.returncode == 2 and new.stderr.splitlines() == [refused]
    assert old.returncode == 2 and old.stderr.splitlines() == [
        "kvtier demo: warning: --model is deprecated, use --preset", refused]
    assert "--model " not in kvtier("demo", "--help", env=clean_env(tmp_path)).stdout


def test_implausible_bare_sizes_are_refused_everywhere(tmp_path: Path) -> None:
    """A size without a unit means bytes in every subcommand, flag, variable and file; one that
    small is a unit left out, refused with the same hint."""
    toml = tmp_path / "k.toml"
    toml.write_text("dram_bytes = 64\n")
    env = clean_env(tmp_path)
    cases = [
        (["size", "--preset", "Llama-3-8B", "--gpu-bytes", "80"], env, "--gpu-bytes: 80 without"),
        (["size", "--preset", "Llama-3-8B", "--dram-bytes", "256"], env, "--dram-bytes: 256 "),
        (["simulate", "--workload", "chat", "--dram-bytes", "64", "--preset", "Llama-3-8B"], env,
         "--dram-bytes: 64 without"),
        (["serve", "--print-config", "--dram-bytes", "64"], env, "(from flag --dram-bytes): 64 "),
        (["serve", "--print-config"], {**env, "KVTIER_DRAM_BYTES": "64"},
         "(from environment variable KVTIER_DRAM_BYTES): 64 without"),
        (["serve", "--print-config", "--config", str(toml)], env, "k.toml): 64 without"),
    ]
    for args, run_env, needle in cases:
        proc = kvtier(*args, env=run_env)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and needle in lines[0], lines
        assert "without a unit would be" in lines[0] and "write the unit (" in lines[0]


def test_every_argparse_parser_disallows_abbreviations() -> None:
    """The bench scripts build their own parsers: each must say allow_abbrev=False."""
    for path in [*ROOT.glob("bench/*.py"), *ROOT.glob("kvtier/**/*.py")]:
        text = path.read_text()
        for m in re.finditer(r"argparse\.ArgumentParser\(", text):
            call = text[m.end():m.end() + 200]
            assert "allow_abbrev=False" in call, f"{path.relative_to(ROOT)}: {call[:60]!r}"


# What the "fails at once" tests below prove: the client does not wait for a daemon that is not
# there (a client that waited would take its whole RPC timeout, `WAITING`, before failing). The
# bound is a fifth of that, so a loaded machine (or this VM's stops of every process, seen up to
# 35 s) cannot make a right client look like a waiting one, and a waiting one cannot pass.
WAITING = 300.0


def test_sync_client_without_a_daemon_fails_at_once(tmp_path: Path) -> None:
    for sock in (tmp_path / "none.sock", tmp_path / "stale.sock"):
        if sock.name == "stale.sock":  # a dead daemon's leftover socket file
            import socket

            s = socket.socket(socket.AF_UNIX)
            s.bind(str(sock))
            s.close()
        t0 = time.monotonic()
        with pytest.raises(KvtierUnavailable) as exc:
            Client(sock, layout=LAYOUT, timeout=WAITING)
        assert time.monotonic() - t0 < WAITING / 5
        assert str(exc.value.details) == f"no kvtier daemon at {sock} (start one: kvtier serve)"


def test_async_client_without_a_daemon_fails_at_once(tmp_path: Path) -> None:
    sock = tmp_path / "none.sock"

    async def connect() -> None:
        await AsyncClient.connect(sock, layout=LAYOUT, timeout=WAITING)

    t0 = time.monotonic()
    with pytest.raises(KvtierUnavailable) as exc:
        asyncio.run(connect())
    assert time.monotonic() - t0 < WAITING / 5
    assert exc.value.details == f"no kvtier daemon at {sock} (start one: kvtier serve)"


def test_tcp_client_without_a_daemon_fails_fast(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(KvtierUnavailable, match=f"no kvtier daemon at 127.0.0.1:{port}"):
        Client(target=f"127.0.0.1:{port}", layout=LAYOUT, timeout=WAITING)
    assert time.monotonic() - t0 < WAITING / 5


def test_stats_without_a_daemon_is_one_line_at_once(tmp_path: Path) -> None:
    sock = tmp_path / "none.sock"
    t0 = time.monotonic()
    proc = kvtier("stats", "--socket", str(sock), "--timeout", str(WAITING),
                  env=clean_env(tmp_path))
    took = time.monotonic() - t0
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"kvtier stats: error: no kvtier daemon at {sock} (start one: kvtier serve)"]
    # the interpreter start included (seconds on a loaded machine); a stats that waited for a
    # daemon would take its --timeout
    assert took < WAITING / 3


def test_print_config_round_trips_through_config(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    first = kvtier("serve", "--print-config", "--grace-s", "3", "--tcp", "127.0.0.1:7001",
                   "--data-dir", str(tmp_path / 'a "quoted" dir'), env=env)
    assert first.returncode == 0, first.stderr
    assert "grace_s = 3.0" in first.stdout
    path = tmp_path / "printed.toml"
    path.write_text(first.stdout)
    again = kvtier("serve", "--config", str(path), "--print-config", env=env)
    assert again.returncode == 0, again.stderr

    def settled(text: str) -> list[str]:  # derived values follow the free disk: their names
        return [ln.split(" = ")[0] if "# derived:" in ln else ln for ln in text.splitlines()]

    assert settled(again.stdout) == settled(first.stdout)


def test_print_config_read_back_derives_again_on_another_machine(tmp_path: Path) -> None:
    """Defect: --print-config froze what it derived (this machine's paths and sizes, the SSD
    write budget and queue), so its file, read back with --config elsewhere, kept them."""
    here = clean_env(tmp_path / "a")
    first = kvtier("serve", "--print-config", "--grace-s", "3", env=here)
    assert first.returncode == 0, first.stderr
    derived = {ln.split(" = ")[0].removeprefix("# ") for ln in first.stdout.splitlines()
               if "  # derived: " in ln}
    assert derived >= {"socket", "data_dir", "dram_bytes", "ssd_bytes", "ssd_write_bytes_per_day",
                       "ssd_write_burst_bytes", "writeback_queue_bytes"}
    path = tmp_path / "printed.toml"
    path.write_text(first.stdout)
    # "another machine": other runtime and data dirs, and an SSD tier of its own size
    there = {**clean_env(tmp_path / "b"), "XDG_DATA_HOME": str(tmp_path / "b-data")}
    again = kvtier("serve", "--config", str(path), "--ssd-bytes", "1GiB", "--print-config",
                   env=there)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert f'# socket = "{tmp_path}/b/run/kvtier/kvtier.sock"  # derived: ' in "\n".join(lines)
    assert any(ln.startswith(f'# data_dir = "{tmp_path}/b-data/kvtier"') for ln in lines)
    # the write budget follows this SSD tier: 1 GiB x 1 drive write a day
    assert any(ln.startswith('# ssd_write_bytes_per_day = "1GiB"  # derived: ') for ln in lines)
    assert "grace_s = 3.0  # SIGTERM drain period in seconds" in lines  # what was set stays


def test_invalid_environment_value_names_the_variable(tmp_path: Path) -> None:
    proc = kvtier("serve", "--print-config", env={**clean_env(tmp_path),
                                                  "KVTIER_SSD_BYTES": "lots"})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "kvtier serve: error: ssd_bytes (from environment variable KVTIER_SSD_BYTES): cannot "
        "read 'lots' as a size (examples: 80GB, 16GiB, 55.54e9)"]


def test_serve_help_shows_every_default_and_variable(tmp_path: Path) -> None:
    proc = kvtier("serve", "--help", env=clean_env(tmp_path))
    assert proc.returncode == 0
    section = proc.stdout.split("\noptions:\n", 1)[1]
    entries = {m.group(1): " ".join(m.group(2).split()) for m in re.finditer(
        r"^  (--[\w-]+)(.*?)(?=^  -|\Z)", section, flags=re.M | re.S)}
    parser = build_parser("serve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = [o for o in _long_options(sub.choices["serve"]) if o != "--help"]
    from kvtier.daemon.config import SETTINGS

    assert options == ["--config", "--print-config", *(s.flag for s in SETTINGS)]
    assert set(entries) == set(options)
    for option in options:
        helptext = entries[option]
        assert "(default: " in helptext, option
        if option not in ("--config", "--print-config"):
            var = "KVTIER_" + option[2:].replace("-", "_").upper()
            assert f"env {var})" in helptext, option


def test_serve_help_shows_the_kept_ssd_size_here(tmp_path: Path) -> None:
    """Defect: `serve --help` said the free-disk default was the SSD size "here" while the
    daemon would run with the size kept in its data dir."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "kept.toml").write_text("ssd_bytes = 4194304\n")
    proc = kvtier("serve", "--help", env={**clean_env(tmp_path), "KVTIER_DATA_DIR": str(data),
                                          "COLUMNS": "400"})
    assert proc.returncode == 0, proc.stderr
    line = " ".join(proc.stdout.split("--ssd-bytes SIZE", 2)[-1].split())
    assert f"; 4MiB here (kept in {data}/kept.toml);" in line, line
    printed = kvtier("serve", "--print-config", env={**clean_env(tmp_path),
                                                     "KVTIER_DATA_DIR": str(data)})
    assert '# ssd_bytes = "4MiB"  # derived: ' in printed.stdout  # what serve would use


def test_model_and_policy_names_take_any_case(tmp_path: Path) -> None:
    """Defect: `--preset llama-3-8b` worked in size but `--policy LRU` was refused by simulate
    and serve (and `demo --preset TINY` by demo): names now take any case everywhere."""
    env = clean_env(tmp_path)
    assert kvtier("size", "--preset", "LLAMA-3-8B", "--json", env=env).returncode == 0
    sim = kvtier("simulate", "--workload", "chat", "--requests", "20", "--dram-blocks", "8",
                 "--policy", "LRU", "--quiet", "--json", env=env)
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["policy"] == "lru"
    served = kvtier("serve", "--policy", "Vllm-ARC", "--print-config", env=env)
    assert served.returncode == 0, served.stderr
    assert 'policy = "vllm-arc"  #' in served.stdout
    bad = kvtier("simulate", "--workload", "chat", "--dram-blocks", "8", "--policy", "lfu",
                 env=env)
    assert bad.returncode == 2 and "invalid choice: 'lfu'" in bad.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the demo needs torch")
def test_demo_preset_names_its_models_and_says_what_a_size_preset_is(tmp_path: Path) -> None:
    """Defect: `--preset` is documented as a built-in model of size, simulate and demo, and
    `demo --preset Llama-3-8B` (a size preset) was refused as an "unknown engine model". The
    demo's own models take any case, and a size preset gets a line saying what the demo runs."""
    env = clean_env(tmp_path)
    ok = kvtier("demo", "--preset", "TINY", "--turns", "1", "--system-tokens", "16", "--json",
                env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["model"] == "tiny"
    size_preset = kvtier("demo", "--preset", "Llama-3-8B", env=env)
    assert size_preset.returncode == 2 and size_preset.stdout == ""
    assert size_preset.stderr.splitlines() == [
        "kvtier demo: error: 'Llama-3-8B' is a model `kvtier size` and `kvtier simulate` size; "
        "the demo runs one of its own small reference models on the CPU (bench, demo, tiny), "
        "with random weights (to measure a real model, run it in vLLM with the kvtier "
        "connector)"]
    assert "tiny, demo (default) or bench" in " ".join(kvtier("demo", "--help",
                                                              env=env).stdout.split())


def test_an_unknown_kvtier_variable_is_refused(tmp_path: Path) -> None:
    """Defect: a misspelt setting variable (KVTIER_SSD_BYTES less its S) was silently ignored, the
    default left in force. `serve` refuses an unknown KVTIER_* in one line naming the nearest
    setting, and starts nothing."""
    typo = "KVTIER_SSD_BYTES"[:-1]  # (spelt out, the repository-wide check below would see it)
    env = {**clean_env(tmp_path), typo: "1GiB"}
    for args in (["serve", "--print-config"],
                 ["serve", "--socket", str(tmp_path / "s.sock"), "--metrics", ""]):
        proc = kvtier(*args, env=env)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.splitlines() == [
            f"kvtier serve: error: unknown environment variable {typo}; did you mean "
            "KVTIER_SSD_BYTES? (the settings' variables are listed by kvtier serve --help; "
            "unset it)"]
    assert not (tmp_path / "s.sock").exists()
    known = {**clean_env(tmp_path), "KVTIER_SSD_BYTES": "1GiB", "KVTIER_TOKEN": "x" * 16,
             "KVTIER_MEMORY_LIMIT_BYTES": "1073741824", "KVTIER_VENV": "/v"}
    assert kvtier("serve", "--print-config", env=known).returncode == 0


def test_every_kvtier_variable_the_project_names_is_known() -> None:
    """Each `KVTIER_*` variable named anywhere in the repository (code, tests, scripts, deploy
    files, docs) is a setting's or one `config.OTHER_VARIABLES` lists, so none that the project
    itself sets trips the refusal above."""
    from kvtier.daemon import config

    known = {config.env_var(s.name) for s in config.SETTINGS} | config.OTHER_VARIABLES
    named: dict[str, str] = {}
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if not path.is_file() or (parts[0].startswith(".") and parts[0] != ".ci") \
                or "__pycache__" in parts:
            continue
        if path.suffix not in (".py", ".sh", ".toml", ".yaml", ".yml", ".md", ".service", "") \
                or path.stat().st_size > 2_000_000:
            continue
        text = path.read_text(errors="replace")
        for var in re.findall(r"\bKVTIER_[A-Z0-9_]*[A-Z0-9]\b", text):
            named.setdefault(var, str(path.relative_to(ROOT)))
    assert {"KVTIER_VENV", "KVTIER_REQUIRE_REDIS", "KVTIER_SSD_BYTES"} <= set(named)
    assert {v: f for v, f in named.items() if v not in known} == {}
