"""`kvtier demo`: a short multi-turn conversation on the reference engine, without and with kvtier.

Uses the daemon on `--socket` (default: the default socket) when one answers there; otherwise it
starts a temporary daemon in a temporary directory and stops it afterwards. Each turn's prompt is
prefilled twice: by the engine alone (TTFT without kvtier) and through kvtier (lookup, plan, load
of the cached prefix, prefill of the rest, store). The logits of the two must be identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtier.core.errors import UsageError

HELP = "serve a short conversation on a reference model, printing TTFT with and without kvtier"
REPLY_TOKENS = 24
USER_TOKENS = 160


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", metavar="PATH",
                        help="daemon to use (default $KVTIER_SOCKET, else the runtime dir); "
                             "a temporary daemon is started when none answers on the default")
    parser.add_argument("--token", metavar="TOKEN",
                        help="bearer token of an existing daemon (else $KVTIER_TOKEN)")
    parser.add_argument("--preset", dest="model", default="demo", metavar="NAME",
                        help="the demo's reference model (small, random weights, on the CPU): "
                             "tiny, demo (default) or bench; not the models of kvtier size")
    from kvtier.commands.flags import alias

    alias(parser, "--model", "--preset", "model")
    parser.add_argument("--turns", type=int, default=5, metavar="N",
                        help="conversation turns (default 5)")
    parser.add_argument("--system-tokens", type=int, default=1024, metavar="N",
                        help="system prompt length in tokens (default 1024)")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="torch CPU threads (default 1)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _check(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("torch") is None:
        raise UsageError("the demo needs torch (its CPU build: pip install 'torch==2.13.0+cpu' "
                         "--extra-index-url https://download.pytorch.org/whl/cpu)")
    if not 1 <= args.turns <= 50:
        raise UsageError(f"--turns must be 1..50, got {args.turns}")
    if not 16 <= args.system_tokens <= 4096:
        raise UsageError(f"--system-tokens must be 16..4096, got {args.system_tokens}")
    if not 1 <= args.threads <= 256:
        raise UsageError(f"--threads must be 1..256, got {args.threads}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    from kvtier.client.sync_client import default_socket, no_daemon
    from kvtier.engine.config import get_config
    from kvtier.engine.local_daemon import LocalDaemon, daemon_alive

    cfg = get_config(args.model)
    args.model = args.model.strip().lower()
    needed = args.system_tokens + args.turns * (USER_TOKENS + REPLY_TOKENS)
    if needed > cfg.max_positions:
        raise UsageError(f"the conversation reaches {needed} tokens; model {args.model!r} "
                         f"holds {cfg.max_positions}: use fewer --turns or --system-tokens")
    socket = Path(args.socket) if args.socket else default_socket()
    if daemon_alive(socket):
        return _converse(args, socket, "running daemon")
    if args.socket:
        raise UsageError(no_daemon(str(socket)).details)
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        slot = max(cfg.block_bytes(), 4096)
        daemon = LocalDaemon(Path(tmp), ["--dram-bytes", str(max(128 << 20, 64 * slot)),
                                         "--slot-bytes", str(slot), "--ssd-bytes", "256MiB",
                                         "--max-block-bytes", str(max(slot, 8 << 20)),
                                         "--log-level", "warning"])
        try:
            daemon.start()
        except RuntimeError as exc:
            print(f"kvtier demo: error: could not start a daemon: {exc}", file=sys.stderr)
            return 1
        try:
            return _converse(args, daemon.socket, "temporary daemon")
        finally:
            daemon.stop()


def _converse(args: argparse.Namespace, socket: Path, which: str) -> int:
    import torch
    from tqdm import tqdm

    from kvtier.engine import Engine, Sequence, get_config
    from kvtier.engine.kvtier_adapter import KvtierEngine, LinkOptions

    torch.set_num_threads(args.threads)
    cfg = get_config(args.model)
    total = args.system_tokens + args.turns * (USER_TOKENS + REPLY_TOKENS)
    baseline = Engine(cfg, num_blocks=total // cfg.block_tokens + 8)
    replica = KvtierEngine(Engine(cfg, num_blocks=total // cfg.block_tokens + 8),
                           LinkOptions(socket=socket,
                                       token=args.token or os.environ.get("KVTIER_TOKEN")))
    gen = torch.Generator().manual_seed(7)

    def tokens(n: int) -> list[int]:
        out: list[int] = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        return out

    history = tokens(args.system_tokens)
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=args.turns, desc="kvtier demo", unit="turn", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())  # a bar only on a terminal, never in a log
    try:
        for turn in range(1, args.turns + 1):
            prompt = history + tokens(USER_TOKENS)
            seq = Sequence()
            alone = baseline.prefill(seq, prompt)
            baseline.release(seq)
            out = replica.serve(prompt)
            reply, _ = replica.engine.greedy(out.seq, out.logits, REPLY_TOKENS)
            replica.engine.release(out.seq)
            history = prompt + reply
            rows.append({
                "turn": turn, "prompt_tokens": len(prompt),
                "usable_blocks": (len(prompt) - 1) // cfg.block_tokens,
                "hit_blocks": out.hit_blocks, "loaded_blocks": out.loaded_blocks,
                "ttft_without_s": alone.seconds, "ttft_with_s": out.ttft_s,
                "identical": bool(torch.equal(alone.logits, out.logits)),
                "fallback": out.fallback,
            })
            bar.update(1)
    finally:
        bar.close()
        replica.close()
    _report(args, rows, socket, which)
    return 0 if all(r["identical"] for r in rows) else 1


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], socket: Path,
            which: str) -> None:
    without = sum(r["ttft_without_s"] for r in rows)
    with_kv = sum(r["ttft_with_s"] for r in rows)
    usable = sum(r["usable_blocks"] for r in rows)
    loaded = sum(r["loaded_blocks"] for r in rows)
    later = rows[1:] or rows
    later_ratio = sum(r["ttft_without_s"] for r in later) / sum(r["ttft_with_s"] for r in later)
    if args.json:
        print(json.dumps({"model": args.model, "socket": str(socket), "daemon": which,
                          "turns": rows, "ttft_without_s": without, "ttft_with_s": with_kv,
                          "block_hit_ratio": sum(r["hit_blocks"] for r in rows) / usable
                          if usable else 0.0,
                          "blocks_fetched": loaded,
                          "speedup_after_first_turn": later_ratio}, indent=2))
        return
    print(f"kvtier demo: model {args.model!r}, {which} on {socket}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>9} {'fetched':>8} {'TTFT alone':>11} "
          f"{'TTFT kvtier':>12} {'speedup':>8}  same output")
    for r in rows:
        cached = f"{r['hit_blocks']}/{r['usable_blocks']}"
        note = "yes" if r["identical"] else "NO"
        if r["fallback"]:
            note += f" (kvtier unavailable, recomputed: {r['fallback']})"
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {cached:>9} {r['loaded_blocks']:>8} "
              f"{r['ttft_without_s'] * 1e3:>9.0f}ms {r['ttft_with_s'] * 1e3:>10.0f}ms "
              f"{r['ttft_without_s'] / r['ttft_with_s']:>7.1f}x  {note}")
    hit = sum(r["hit_blocks"] for r in rows)
    ratio = f"{hit / usable:.0%}" if usable else "-"
    print(f"total TTFT {without:.2f} s alone, {with_kv:.2f} s with kvtier; "
          f"turns 2+: {later_ratio:.1f}x faster")
    print(f"prompt blocks cached {hit}/{usable} (hit ratio {ratio}), fetched {loaded} "
          f"(the planner may recompute cached blocks); outputs identical: "
          f"{all(r['identical'] for r in rows)}")
