"""`kvtier.daemon.reload` on its own: which differences are live changes, which are file changes
that need a restart, and which are drift of machine-sized defaults (neither)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtier.core.errors import UsageError
from kvtier.daemon import config
from kvtier.daemon.auth import Authenticator
from kvtier.daemon.reload import ConfigSource, changes, prepare, tenant_changes


def cfg(tmp: Path) -> config.Config:
    return config.load({"data_dir": str(tmp / "data"), "socket": str(tmp / "s.sock")}, env={})


def test_drifted_default_is_not_a_change(tmp_path: Path) -> None:
    old = cfg(tmp_path)
    drifted = dataclasses.replace(old, dram_bytes=old.dram_bytes - old.slot_bytes)
    assert changes(old, drifted, {}, {}) == ({}, [])


def test_file_change_of_a_fixed_setting_is_named(tmp_path: Path) -> None:
    old = cfg(tmp_path)
    new = dataclasses.replace(old, dram_bytes=old.dram_bytes // 2, log_level="debug")
    found = changes(old, new, {"dram_bytes": "1GiB"}, {"dram_bytes": "512MiB"})
    assert found.fixed == ["dram_bytes"]
    assert found.live == {"log_level": ("info", "debug")}


def test_file_change_overridden_by_a_flag_is_no_change(tmp_path: Path) -> None:
    old = cfg(tmp_path)
    assert changes(old, old, {"grace_s": 5}, {"grace_s": 7}) == ({}, [])


def test_tenant_changes_see_tokens_and_quotas(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[tenants.a]\ntoken = "aaaaaaaa"\n[tenants.b]\ntoken = "bbbbbbbb"\n')
    old = Authenticator.from_file(path)
    path.write_text('[tenants.a]\ntoken = "aaaaaaa2"\n[tenants.c]\ntoken = "cccccccc"\n'
                    '[tenants.b]\ntoken = "bbbbbbbb"\ndram_quota = "1GiB"\n')
    new = Authenticator.from_file(path)
    # a's token changed (rekeyed: its fd must not follow), b only its quota
    assert tenant_changes(old, new) == (["c"], [], ["a", "b"], ["a"])
    assert tenant_changes(new, Authenticator()) == (["default"], ["a", "b", "c"], [],
                                                    ["a", "b", "c"])


def test_prepare_refuses_guarantees_over_the_pool(tmp_path: Path) -> None:
    tokens = tmp_path / "t.toml"
    tokens.write_text('[tenants.a]\ntoken = "aaaaaaaa"\n')
    conf = tmp_path / "kvtier.toml"
    conf.write_text(f'tokens_file = "{tokens}"\ndram_bytes = "16MiB"\n')
    source = ConfigSource({"data_dir": str(tmp_path / "data")}, str(conf), env={})
    running = source.load()
    auth = Authenticator.from_file(tokens)
    tokens.write_text('[tenants.a]\ntoken = "aaaaaaaa"\ndram_guarantee = "1GiB"\n'
                      'dram_quota = "2GiB"\n')
    with pytest.raises(UsageError, match="more than the DRAM pool"):
        prepare(source, running, auth, source.file_values())


def test_secrets_never_reach_the_reload_line() -> None:
    from kvtier.daemon.reload import _shown

    assert _shown("remote_password", "hunter2") == "(changed)"
    assert "s3cret" not in _shown("remote_url", "redis://u:s3cret@host:6379/0")
    assert _shown("remote_url", "redis://u:s3cret@host:6379/0") == "'redis://…@host:6379/0'"


def test_remote_tier_on_or_off_needs_a_restart(tmp_path: Path) -> None:
    old = cfg(tmp_path)
    on = dataclasses.replace(old, remote_url="redis://127.0.0.1:1/0")
    assert changes(old, on, {}, {"remote_url": "redis://127.0.0.1:1/0"}).fixed == ["remote_url"]
    moved = dataclasses.replace(on, remote_url="redis://127.0.0.1:2/0", remote_timeout_s=1.0)
    found = changes(on, moved, {}, {})
    assert found.fixed == [] and set(found.live) == {"remote_url", "remote_timeout_s"}
