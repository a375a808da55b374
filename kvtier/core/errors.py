"""Error types shared across modules and both sides of the socket.

`UsageError` is bad user input (a flag, a config value, a trace line): the CLI prints its message on
one line and exits with code 2. Library code raises it (or a subclass) instead of printing.
"""


class KvtierError(Exception):
    """Base class of kvtier's own errors."""


class UsageError(KvtierError, ValueError):
    """Bad input from a user; the CLI reports it in one line and exits 2."""


class CacheError(KvtierError):
    """A request the cache refuses; the service maps the subclass to a gRPC status
    (and a client maps the status back)."""


class InvalidArgument(CacheError):
    pass


class NotFound(CacheError):
    pass


class PermissionDenied(CacheError):
    pass


class ResourceExhausted(CacheError):
    pass


class FailedPrecondition(CacheError):
    pass


class Unavailable(CacheError):
    """The daemon is draining: no new leases."""


class Unauthenticated(KvtierError):
    """Missing, malformed or unknown token (UNAUTHENTICATED)."""
