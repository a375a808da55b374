"""Where kvtier keeps its files, after the XDG Base Directory Specification (0.8), and where a
daemon and its clients meet on one machine (the runtime dir and the default socket).

    data     $XDG_DATA_HOME/kvtier      else ~/.local/share/kvtier   the SSD tier, calibration
    config   $XDG_CONFIG_HOME/kvtier    else ~/.config/kvtier        kvtier.toml; then each of
             $XDG_CONFIG_DIRS/kvtier    else /etc/xdg/kvtier         (in order) for kvtier.toml
    runtime  $XDG_RUNTIME_DIR/kvtier    else /tmp/kvtier-$UID        the socket, segment record
    cache    $XDG_CACHE_HOME/kvtier     else ~/.cache/kvtier         compiled GPU kernels (CuPy)

As the specification says, a variable that is unset, empty or not an absolute path is ignored
(its fallback is used). `~` is $HOME, else the password database's home.

Both sides of the socket derive the same path from the same environment, so a client started with
no socket argument finds the daemon `kvtier serve` started with no configuration. Pure: every
function reads the mapping it is given (never `os.environ`), never the filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOCKET_NAME = "kvtier.sock"
CONFIG_FILE = "kvtier.toml"


def _home(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or str(Path.home()))


def _xdg(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name, "")
    return Path(value) if value and os.path.isabs(value) else None


def data_dir(env: Mapping[str, str]) -> Path:
    return (_xdg(env, "XDG_DATA_HOME") or _home(env) / ".local" / "share") / "kvtier"


def config_dirs(env: Mapping[str, str]) -> list[Path]:
    """kvtier's config directories, most important first (XDG_CONFIG_HOME, then XDG_CONFIG_DIRS)."""
    home = _xdg(env, "XDG_CONFIG_HOME") or _home(env) / ".config"
    system = [Path(p) for p in (env.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":")
              if p and os.path.isabs(p)] or [Path("/etc/xdg")]
    return [d / "kvtier" for d in (home, *system)]


def runtime_dir(env: Mapping[str, str]) -> Path:
    """`$XDG_RUNTIME_DIR/kvtier`, else `/tmp/kvtier-$UID` (per user, never shared)."""
    xdg = _xdg(env, "XDG_RUNTIME_DIR")
    return xdg / "kvtier" if xdg else Path(f"/tmp/kvtier-{os.getuid()}")


def cache_dir(env: Mapping[str, str]) -> Path:
    return (_xdg(env, "XDG_CACHE_HOME") or _home(env) / ".cache") / "kvtier"


def default_socket(env: Mapping[str, str]) -> Path:
    """The daemon's socket when none is named: `$KVTIER_SOCKET`, else the runtime dir's."""
    return Path(env.get("KVTIER_SOCKET") or runtime_dir(env) / SOCKET_NAME)


SOCKET_PATH_MAX = 107
"""Longest Unix socket path Linux accepts: `sun_path` is 108 bytes, one for the NUL."""


def socket_path_problem(path: Path) -> str | None:
    """Why `path` cannot be a Unix socket's path (too long, or empty), or None."""
    size = len(os.fsencode(path))
    if not str(path):
        return "the socket path is empty"
    if size > SOCKET_PATH_MAX:
        return (f"socket path {path} is {size} bytes; Unix socket paths are limited to "
                f"{SOCKET_PATH_MAX} bytes (choose a shorter one, e.g. under $XDG_RUNTIME_DIR)")
    return None
