"""Daemon configuration: precedence defaults < TOML < env < flags, validation, CLI errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core.errors import UsageError
from kvtier.daemon import config
from kvtier.daemon.auth import Authenticator, Unauthenticated

GiB = 1 << 30


def test_defaults_need_nothing_and_are_bounded(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    cfg = config.load({}, env)
    assert cfg.socket == tmp_path / "xdg" / "kvtier" / "kvtier.sock"
    assert cfg.data_dir == tmp_path / ".local" / "share" / "kvtier"
    assert 0 < cfg.dram_bytes <= 4 * GiB and cfg.dram_bytes % cfg.slot_bytes == 0
    assert 0 <= cfg.ssd_bytes <= 16 * GiB
    assert cfg.metrics == "127.0.0.1:9464" and cfg.tcp == "" and cfg.tokens_file == ""


def test_runtime_dir_without_xdg_is_per_user(tmp_path: Path) -> None:
    import os

    cfg = config.load({}, {"HOME": str(tmp_path)})
    assert cfg.socket == Path(f"/tmp/kvtier-{os.getuid()}/kvtier.sock")


def test_precedence_toml_then_env_then_flags(tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text('dram_bytes = "1GiB"\nslot_bytes = "1MiB"\nlease_ttl_s = 5\n'
                    'metrics = "127.0.0.1:9999"\n')
    env = {"HOME": str(tmp_path), "KVTIER_DRAM_BYTES": "512MiB", "KVTIER_LEASE_TTL_S": "7"}
    cfg = config.load({"lease_ttl_s": "9", "dram_bytes": None}, env, str(toml))
    assert cfg.slot_bytes == 1 << 20  # TOML
    assert cfg.dram_bytes == 512 << 20  # env beats TOML; a None flag is unset
    assert cfg.lease_ttl_s == 9.0  # flag beats env
    assert cfg.metrics_address() == ("127.0.0.1", 9999)


def test_serve_table_and_kvtier_config_env(tmp_path: Path) -> None:
    toml = tmp_path / "k.toml"
    toml.write_text('[serve]\nssd_bytes = 0\n')
    cfg = config.load({}, {"HOME": str(tmp_path), "KVTIER_CONFIG": str(toml)})
    assert cfg.ssd_bytes == 0


@pytest.mark.parametrize("flags,message", [
    ({"dram_bytes": "lots"}, "dram_bytes (from flag --dram-bytes): cannot read 'lots'"),
    ({"slot_bytes": "1000B"}, "multiple of 4096"),
    ({"slot_bytes": "1000"}, "1000 without a unit"),
    ({"dram_bytes": "1.5g"}, "ambiguous; write GB (10^9 B) or GiB (2^30 B)"),
    ({"group": "no-such-group-kvtier"}, "no group named 'no-such-group-kvtier'"),
    ({"dram_bytes": "4KiB", "slot_bytes": "8KiB"}, "at least one slot"),
    ({"lease_ttl_s": "0"}, "lease_ttl_s"),
    ({"lease_ttl_s": "700"}, "must not exceed max_lease_ttl_s"),
    ({"grace_s": "-1"}, "grace_s"),
    ({"max_blocks_per_request": "0"}, "max_blocks_per_request"),
    ({"log_level": "loud"}, "log_level"),
    ({"metrics": "localhost"}, "expected HOST:PORT"),
    ({"tcp": "0.0.0.0:7000"}, "needs tls_cert and tls_key"),
    ({"tls_cert": "a.pem"}, "go together"),
    ({"ssd_admit_after": "x"}, "expected a number"),
    ({"policy": "fifo"}, "policy (from flag --policy): must be one of"),
])
def test_bad_values_are_usage_errors(tmp_path: Path, flags: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError) as exc:
        config.load(flags, {"HOME": str(tmp_path)})
    assert message in str(exc.value)


def test_bad_toml_and_unknown_keys(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("dram_bytes = = 3")
    with pytest.raises(UsageError, match="config file"):
        config.load({}, {"HOME": str(tmp_path)}, str(bad))
    unknown = tmp_path / "u.toml"
    unknown.write_text("dram = 3")
    with pytest.raises(UsageError, match=r"unknown setting 'dram' .*; did you mean 'dram_bytes'"):
        config.load({}, {"HOME": str(tmp_path)}, str(unknown))
    with pytest.raises(UsageError, match="does not exist"):
        config.load({}, {"HOME": str(tmp_path)}, str(tmp_path / "missing.toml"))


def test_parse_bytes_is_the_one_in_core_units() -> None:
    from kvtier.core import units

    assert config.parse_bytes is units.parse_bytes
    assert config.parse_bytes("4GiB") == 4 * GiB
    assert config.parse_bytes("512 MB") == 512 * 10**6
    assert config.parse_bytes(8192) == 8192 and config.parse_bytes(0) == 0
    for bad in ("-1", "1 parsec", True, -5, 1.5, 123, "1.5g", "16G"):
        with pytest.raises(UsageError):
            config.parse_bytes(bad)


def test_cli_reports_bad_flag_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "serve", "--dram-bytes", "lots"],
        capture_output=True, text=True, env={"HOME": str(tmp_path), "PATH": "/usr/bin"},
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvtier serve: error: dram_bytes (from flag --dram-bytes): cannot read 'lots' as a size "
        "(examples: 80GB, 16GiB, 55.54e9)"
    ]


def test_print_config(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "serve", "--print-config", "--grace-s", "3"],
        capture_output=True, text=True, env={"HOME": str(tmp_path), "PATH": "/usr/bin"},
        timeout=60,
    )
    assert proc.returncode == 0 and "grace_s = 3.0" in proc.stdout


def test_one_declaration_generates_keys_variables_flags_and_print_config(tmp_path: Path) -> None:
    """Every setting of `SETTINGS` is a Config field, a TOML key, a variable and a flag; adding
    one there is the only step."""
    import dataclasses

    from kvtier.commands.serve import add_arguments

    names = [s.name for s in config.SETTINGS]
    assert names == [f.name for f in dataclasses.fields(config.Config)]
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    for s in config.SETTINGS:
        assert flags[s.name].option_strings == [s.flag]
        assert s.doc in (flags[s.name].help or "") and config.env_var(s.name) in (
            flags[s.name].help or "")
    printed = config.to_toml(*config.load_traced({}, {"HOME": str(tmp_path)}))
    keys = [ln.removeprefix("# ").split(" = ")[0] for ln in printed.splitlines()
            if " = " in ln and not ln.startswith("# Lines")]
    assert keys == names


def test_print_config_writes_sizes_with_units_and_round_trips(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    cfg = config.load({"dram_bytes": "64GiB", "ssd_bytes": "3840GB", "slot_bytes": "64KiB",
                       "ssd_write_burst_bytes": "1234567B"}, env)
    text = config.to_toml(cfg)
    assert 'dram_bytes = "64GiB"' in text and 'ssd_bytes = "3840GB"' in text
    assert 'slot_bytes = "64KiB"' in text and 'ssd_write_burst_bytes = "1234567B"' in text
    assert "dram_page_bytes = 0 " in text
    path = tmp_path / "p.toml"
    path.write_text(text)
    assert config.load({}, env, str(path)) == cfg


def test_tokens_file_maps_tokens_to_tenants(tmp_path: Path) -> None:
    import hashlib

    f = tmp_path / "tokens.toml"
    digest = hashlib.sha256(b"bob-token-123").hexdigest()
    f.write_text('[tenants.alice]\ntoken = "alice-token-1"\ndram_quota = "1GiB"\n'
                 f'[tenants.bob]\ntoken_sha256 = "{digest}"\n')
    auth = Authenticator.from_file(f)
    assert auth.authenticate([("authorization", "Bearer alice-token-1")]).dram_quota_bytes == GiB
    assert auth.authenticate([("authorization", "bearer bob-token-123")]).name == "bob"
    for md in ([], [("authorization", "Bearer nope-nope")], [("authorization", "alice-token-1")]):
        with pytest.raises(Unauthenticated):
            auth.authenticate(md)
    assert Authenticator.from_file("").authenticate([]).name == "default"


@pytest.mark.parametrize("text,message", [
    ("[tenants.a]\n", "exactly one of token"),
    ('[tenants.a]\ntoken = "short"\n', "at least 8"),
    ('[tenants.a]\ntoken_sha256 = "xyz"\n', "64 hex"),
    ('[tenants."a/b"]\ntoken = "long-enough-1"\n', "name must match"),
    ('[tenants.a]\ntoken = "same-token-1"\n[tenants.b]\ntoken = "same-token-1"\n', "already used"),
    ('[tenants.a]\ntoken = "long-enough-1"\nquota = 3\n', "unknown keys"),
    ("x = 1\n", "at least one"),
])
def test_bad_tokens_files(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "t.toml"
    f.write_text(text)
    with pytest.raises(UsageError, match=message):
        Authenticator.from_file(f)


def test_deploy_examples_are_valid(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    import grp
    import os

    env = {"HOME": str(tmp_path), "KVTIER_GROUP": grp.getgrgid(os.getgid()).gr_name}
    cfg = config.load({}, env, str(root / "deploy" / "kvtier.toml"))  # more: test_deploy.py
    assert cfg.slot_bytes == 16 << 10 and cfg.ssd_admit_after == 2
    auth = Authenticator.from_file(root / "deploy" / "tokens.toml")
    assert [t.name for t in auth.tenants()] == ["team-chat", "team-agents"]
    token = "example-token-team-chat"  # the published example token the file names
    assert auth.authenticate([("authorization", f"Bearer {token}")]).name == "team-chat"
