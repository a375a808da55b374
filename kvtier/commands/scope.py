"""What the operators' commands share (`kvtier evict`, `clear`, `pin`, `unpin`, `pins`,
`prefetch`): the daemon they talk to (`kvtier.commands.target`), which namespaces they act on
(`--tenant`, `--all-tenants`, `--model`, `--layout`), which blocks (`--keys` / `--keys-file`
as hex block keys, or `--tokens` / `--tokens-file` as a prompt's token ids hashed the way the
engine does), and how replies print (`--json`: the reply's fields).

Keys from token ids: vLLM's block hashes (`kvtier.core.keys`: sha256_cbor over canonical CBOR,
NONE_HASH seeded as vLLM seeds it, `--hash-seed` for an engine run with PYTHONHASHSEED), one key
per kvtier block of `--block-tokens` tokens; when a kvtier block spans several engine blocks
(`--engine-block-tokens`, vLLM's block size), the engine's hash of its last one
(`kvtier.core.keys.span_keys`). A request with a LoRA adapter, images or a cache salt has other
keys: give those as `--keys`. `--tokens-file` takes a JSON list of ints, or the object vLLM's
`/tokenize` endpoint answers (`{"tokens": [...]}`); "-" reads it from stdin.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvtier.core.errors import UsageError


def add_target(parser: argparse.ArgumentParser) -> None:
    from kvtier.commands import target

    target.add_arguments(parser)
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="give up after this many seconds (default 60)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def add_namespaces(parser: argparse.ArgumentParser, every: bool = True) -> None:
    g = parser.add_argument_group("which namespaces (default: the token's tenant, every model)")
    g.add_argument("--model", metavar="ID", default="",
                   help="the layouts an engine registered for this model id")
    g.add_argument("--layout", metavar="HEX", default="",
                   help="one layout id (64 hex digits, as `kvtier pins` shows it)")
    g.add_argument("--tenant", metavar="NAME", default="",
                   help="another tenant's blocks (admin token)")
    if every:
        g.add_argument("--all-tenants", action="store_true",
                       help="every tenant's blocks (admin token)")


def add_keys(parser: argparse.ArgumentParser, what: str) -> None:
    g = parser.add_argument_group(f"which blocks: {what}")
    g.add_argument("--keys", metavar="HEX[,HEX...]", default="",
                   help="block keys in hex (16 or 32 bytes each), comma separated")
    g.add_argument("--keys-file", metavar="PATH", default="",
                   help="block keys in hex, one per line ('-': stdin)")
    g.add_argument("--tokens", metavar="ID[,ID...]", default="",
                   help="a prompt's token ids, comma separated (needs --block-tokens)")
    g.add_argument("--tokens-file", metavar="PATH", default="",
                   help="a prompt's token ids: a JSON list, or vLLM's /tokenize answer "
                        "('-': stdin)")
    g.add_argument("--block-tokens", type=int, default=0, metavar="N",
                   help="tokens per kvtier block (the layout's block_tokens)")
    g.add_argument("--engine-block-tokens", type=int, default=0, metavar="N",
                   help="tokens per engine block when a kvtier block spans several "
                        "(vLLM's block size; default: --block-tokens)")
    g.add_argument("--hash", choices=("sha256_cbor", "xxh3_128"), default="sha256_cbor",
                   help="the engine's prefix-caching hash (default sha256_cbor)")
    g.add_argument("--hash-seed", metavar="SEED", default="",
                   help="the engine's PYTHONHASHSEED, if it sets one")


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None


def _hex_keys(text: str, where: str) -> list[bytes]:
    out = []
    for word in text.replace(",", " ").split():
        try:
            key = bytes.fromhex(word)
        except ValueError:
            raise UsageError(f"{where}: {word[:20]!r} is not a hex block key") from None
        if len(key) not in (16, 32):
            raise UsageError(f"{where}: a block key is 16 or 32 bytes (32 or 64 hex digits), "
                             f"got {len(key)} bytes")
        out.append(key)
    if out and len({len(k) for k in out}) > 1:
        raise UsageError(f"{where}: the keys are of different widths")
    return out


def _token_ids(args: argparse.Namespace) -> list[int]:
    if args.tokens:
        words = args.tokens.replace(",", " ").split()
        try:
            ids = [int(w) for w in words]
        except ValueError:
            raise UsageError("--tokens: expected integers separated by commas") from None
    else:
        try:
            data: Any = json.loads(_read(args.tokens_file))
        except json.JSONDecodeError as exc:
            raise UsageError(f"--tokens-file: not JSON ({exc})") from None
        if isinstance(data, dict):
            data = data.get("tokens", data.get("prompt_token_ids"))
        if not isinstance(data, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in data):
            raise UsageError("--tokens-file: expected a JSON list of token ids or an object "
                             "with a \"tokens\" list (vLLM's /tokenize answer)")
        ids = data
    if any(t < 0 for t in ids):
        raise UsageError("token ids are non-negative integers")
    return ids


def keys_of(args: argparse.Namespace, required: bool) -> list[bytes]:
    """The blocks the flags name: keys, or token ids hashed (module docstring)."""
    given = [n for n in ("keys", "keys_file", "tokens", "tokens_file") if getattr(args, n)]
    if len(given) > 1:
        raise UsageError("give the blocks one way: --keys, --keys-file, --tokens or "
                         "--tokens-file")
    if not given:
        if required:
            raise UsageError("name the prefix: --keys, --keys-file, --tokens or --tokens-file")
        for flag in ("block_tokens", "engine_block_tokens"):
            if getattr(args, flag):
                raise UsageError(f"--{flag.replace('_', '-')} goes with --tokens or "
                                 "--tokens-file")
        return []
    if args.keys:
        return _hex_keys(args.keys, "--keys")
    if args.keys_file:
        return _hex_keys(_read(args.keys_file), "--keys-file")
    from kvtier.core.keys import KeyScheme, span_keys

    bt = args.block_tokens
    if bt <= 0:
        raise UsageError("--tokens needs --block-tokens N (the layout's tokens per block)")
    ebt = args.engine_block_tokens or bt
    if ebt <= 0 or bt % ebt:
        raise UsageError(f"--block-tokens {bt} must be a multiple of --engine-block-tokens "
                         f"{ebt}")
    ids = _token_ids(args)
    scheme = (KeyScheme.vllm(args.hash, args.hash_seed) if args.hash_seed
              else KeyScheme.vllm(args.hash))
    keys = span_keys(scheme.block_keys(ids, ebt), bt // ebt)
    if not keys:
        raise UsageError(f"the prompt has {len(ids)} tokens: no full block of {bt}")
    return keys


def namespaces(args: argparse.Namespace) -> dict[str, Any]:
    """The `kvtier.client.control.Control` keywords of the namespace flags."""
    layout = b""
    if args.layout:
        try:
            layout = bytes.fromhex(args.layout)
        except ValueError:
            raise UsageError("--layout: expected the layout id in hex") from None
        if len(layout) != 32:
            raise UsageError("--layout: a layout id is 32 bytes (64 hex digits)")
    out: dict[str, Any] = {"model_id": args.model, "layout_id": layout, "tenant": args.tenant}
    if getattr(args, "all_tenants", False):
        if args.tenant:
            raise UsageError("give --tenant or --all-tenants, not both")
        out["all_tenants"] = True
    return out


def connect(args: argparse.Namespace) -> Any:
    """A `Control` on the daemon the flags name (UsageError when nothing listens there)."""
    import grpc

    from kvtier.client.control import Control
    from kvtier.commands import target

    where = target.from_args(args)
    target.probe(where)
    credentials = None
    if where.tls_ca:
        try:
            with open(where.tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(f.read())
        except OSError as exc:
            raise UsageError(f"--tls-ca {where.tls_ca}: {exc.strerror or exc}") from None
    metadata = target.token(args)
    token = metadata[0][1].removeprefix("Bearer ") if metadata else None
    return Control(target=where.grpc, token=token, timeout=args.timeout,
                   credentials=credentials)


def call(fn: Any, *a: Any, **kw: Any) -> Any:
    """A `Control` call; the daemon's refusal as one line (`UsageError`, exit 2)."""
    from kvtier.client.sync_client import KvtierRpcError

    try:
        return fn(*a, **kw)
    except KvtierRpcError as exc:
        raise UsageError(f"{exc.code.name}: {exc.details}") from None


def output(args: argparse.Namespace, reply: Any, lines: list[str]) -> int:
    if args.json:
        from kvtier.commands.stats import plain

        print(json.dumps(plain(reply) if hasattr(reply, "DESCRIPTOR") else reply, indent=2))
    else:
        for line in lines:
            print(line)
    return 0


def evicted_lines(r: Any) -> list[str]:
    out = [f"removed {r.blocks} block(s) of {r.namespaces} namespace(s): DRAM {r.dram_blocks}, "
           f"SSD {r.ssd_blocks}, remote {r.remote_blocks}"]
    if r.doomed_blocks:
        out.append(f"{r.doomed_blocks} block(s) held by leases or writes in flight go when "
                   "released (no lookup finds them meanwhile)")
    if r.remote_error:
        out.append(f"warning: remote copies not all deleted: {r.remote_error}")
    return out
