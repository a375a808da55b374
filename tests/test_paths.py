"""XDG base directories (kvtier.core.paths) and their use by the daemon's configuration."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.core import paths
from kvtier.daemon import config


def test_xdg_variables_are_followed(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path / "home"), "XDG_DATA_HOME": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_RUNTIME_DIR": str(tmp_path / "run"),
           "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "XDG_CONFIG_DIRS": f"{tmp_path / 'sys1'}:{tmp_path / 'sys2'}"}
    assert paths.data_dir(env) == tmp_path / "data" / "kvtier"
    assert paths.runtime_dir(env) == tmp_path / "run" / "kvtier"
    assert paths.cache_dir(env) == tmp_path / "cache" / "kvtier"
    assert paths.config_dirs(env) == [tmp_path / "cfg" / "kvtier", tmp_path / "sys1" / "kvtier",
                                      tmp_path / "sys2" / "kvtier"]
    assert paths.default_socket(env) == tmp_path / "run" / "kvtier" / "kvtier.sock"


def test_fallbacks_when_unset_empty_or_relative(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for value in (None, "", "relative/dir"):
        env = {"HOME": str(home)}
        if value is not None:
            env.update({k: value for k in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR",
                                           "XDG_CACHE_HOME", "XDG_CONFIG_DIRS")})
        assert paths.data_dir(env) == home / ".local" / "share" / "kvtier"
        assert paths.config_dirs(env) == [home / ".config" / "kvtier", Path("/etc/xdg/kvtier")]
        assert paths.runtime_dir(env) == Path(f"/tmp/kvtier-{os.getuid()}")
        assert paths.cache_dir(env) == home / ".cache" / "kvtier"


def test_config_uses_xdg_data_home_and_config_dirs(tmp_path: Path) -> None:
    system = tmp_path / "sys" / "kvtier"
    system.mkdir(parents=True)
    (system / "kvtier.toml").write_text("grace_s = 4\n")
    env = {"HOME": str(tmp_path / "home"), "XDG_DATA_HOME": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_CONFIG_DIRS": str(tmp_path / "sys")}
    cfg = config.load({}, env)
    assert cfg.data_dir == tmp_path / "data" / "kvtier"  # on main: ~/.local/share/kvtier
    assert cfg.grace_s == 4.0  # from $XDG_CONFIG_DIRS/kvtier/kvtier.toml
    user = tmp_path / "cfg" / "kvtier"
    user.mkdir(parents=True)
    (user / "kvtier.toml").write_text("grace_s = 5\n")
    assert config.load({}, env).grace_s == 5.0  # $XDG_CONFIG_HOME first
    assert config.load({}, {**env, "KVTIER_DATA_DIR": str(tmp_path / "d")}).data_dir == (
        tmp_path / "d")
