"""Tokens file: the `admin` flag and `dram_guarantee` (issue 12), and a daemon that refuses
guarantees larger than its pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.errors import UsageError
from kvtier.daemon.auth import Authenticator
from tests.daemon_fixture import DaemonProc


def tokens(tmp: Path, body: str) -> Path:
    f = tmp / "tokens.toml"
    f.write_text(body)
    return f


def test_admin_and_guarantee_are_read(tmp_path: Path) -> None:
    auth = Authenticator.from_file(tokens(tmp_path, (
        '[tenants.a]\ntoken = "aaaaaaaa-token"\ndram_guarantee = "1MiB"\ndram_quota = "2MiB"\n'
        '[tenants.ops]\ntoken = "oooooooo-token"\nadmin = true\n')))
    a = auth.authenticate([("authorization", "Bearer aaaaaaaa-token")])
    ops = auth.authenticate([("authorization", "Bearer oooooooo-token")])
    assert (a.dram_guarantee_bytes, a.admin) == (1 << 20, False)
    assert (ops.dram_guarantee_bytes, ops.admin) == (0, True)
    assert Authenticator().tenants()[0].admin  # no tokens file: the one tenant sees its node


@pytest.mark.parametrize("spec,message", [
    ('admin = "yes"', "admin must be true or false"),
    ('dram_guarantee = "3MiB"\ndram_quota = "2MiB"', "dram_guarantee exceeds its dram_quota"),
    ('dram_guarantee = "lots"', "dram_guarantee"),
])
def test_bad_tenant_settings_are_refused(tmp_path: Path, spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        Authenticator.from_file(
            tokens(tmp_path, f'[tenants.a]\ntoken = "aaaaaaaa-token"\n{spec}\n'))


def test_serve_refuses_guarantees_larger_than_the_pool(tmp_path: Path) -> None:
    f = tokens(tmp_path, '[tenants.a]\ntoken = "aaaaaaaa-token"\ndram_guarantee = "12MiB"\n'
                         '[tenants.b]\ntoken = "bbbbbbbb-token"\ndram_guarantee = "8MiB"\n')
    with pytest.raises(RuntimeError, match=r"daemon exited 2[\s\S]*dram_guarantee add up to"):
        DaemonProc(tmp_path / "d", ["--tokens-file", str(f)]).start()


def test_whitespace_around_a_token_is_not_part_of_it(tmp_path: Path) -> None:
    """A presented token is read without the whitespace around it; a token in the file with
    whitespace around it could never be presented, so the file is refused."""
    auth = Authenticator.from_file(tokens(tmp_path, '[tenants.a]\ntoken = "aaaaaaaa-token"\n'))
    for value in ("Bearer aaaaaaaa-token", "Bearer  aaaaaaaa-token ", " bearer aaaaaaaa-token\t"):
        assert auth.authenticate([("authorization", value)]).name == "a"
    with pytest.raises(UsageError, match="whitespace around it"):
        Authenticator.from_file(tokens(tmp_path, '[tenants.a]\ntoken = " aaaaaaaa-token"\n'))
