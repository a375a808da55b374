"""Error types shared across modules.

`UsageError` is bad user input (a flag, a config value, a trace line): the CLI prints its message on
one line and exits with code 2. Library code raises it (or a subclass) instead of printing.
"""


class KvtierError(Exception):
    """Base class of kvtier's own errors."""


class UsageError(KvtierError, ValueError):
    """Bad input from a user; the CLI reports it in one line and exits 2."""
