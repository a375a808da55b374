"""TTFT of the reference engine without and with kvtier: `python -m bench.e2e [--quick]`.

Workloads (token ids from a fixed seed; chat replies are the engine's own greedy output):
  chat  `--convs` conversations of `--turns` turns sharing a `--system`-token system prompt; each
        turn adds a 64-192-token user message; the reply (32 greedy tokens) joins the next prompt.
  doc   `--docs` documents of `--doc-tokens` tokens, `--questions` 32-96-token questions each.
Request classes: chat/first (turn 0: only the system prompt can hit), chat/follow (turns >= 1),
doc/first (first question: cold), doc/follow (the document is cached), short/first and
short/follow (`--short` 48-token prompts after one shared 16-token block: fixed costs decide).
Modes, each from a fresh daemon and run round by round (turn t of every conversation, question q of
every document):
  recompute   the engine alone (the baseline, same run)
  dram        kvtier, planner off (fetch every hit); hits come from DRAM
  ssd         kvtier, planner off; before every round >= 1 the previous round's blocks are
              settled on SSD (`settle_on_ssd`), the daemon is restarted (DRAM lost) and the SSD
              files' pages are dropped from the page cache: hits come from SSD
  plan-dram   like dram with the planner on; plan-ssd like ssd with the planner on. The daemon
              learns this engine's prefill rate from two warm-up requests after each (re)start.
TTFT = lookup + load + prefill (storing new blocks happens after the first token). Every request's
logits are compared with the recompute pass: the run reports whether all were bit-exact.
Writes bench/results/e2e.json (+ e2e_ttft.png with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kvtier._proto import kvtier_pb2 as pb
from kvtier.engine import Engine, Sequence, get_config
from kvtier.engine.kvtier_adapter import KvtierEngine, LinkOptions
from kvtier.engine.local_daemon import LocalDaemon

RESULTS = Path(__file__).parent / "results"
MODES = ("recompute", "dram", "ssd", "plan-dram", "plan-ssd")
CLASSES = ("chat/first", "chat/follow", "doc/first", "doc/follow", "short/first", "short/follow")
REPLY_TOKENS = 32


@dataclass(slots=True)
class Request:
    cls: str
    rnd: int
    prompt: list[int]
    ref: torch.Tensor | None = None


@dataclass(slots=True)
class Workload:
    rounds: list[list[Request]] = field(default_factory=list)

    def requests(self) -> Iterator[Request]:
        for rnd in self.rounds:
            yield from rnd


def rand(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    out: list[int] = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return out


def between(gen: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=gen).item())


def doc_workload(args: argparse.Namespace, vocab: int) -> Workload:
    gen = torch.Generator().manual_seed(2)
    docs = [rand(gen, args.doc_tokens, vocab) for _ in range(args.docs)]
    w = Workload()
    for q in range(args.questions):
        w.rounds.append([Request("doc/first" if q == 0 else "doc/follow", q,
                                 d + rand(gen, between(gen, 32, 96), vocab)) for d in docs])
    return w


def short_workload(args: argparse.Namespace, vocab: int) -> Workload:
    """A one-block shared preamble before short unique prompts: fetching one block must beat
    recomputing 16 tokens, a case where per-request fixed costs decide."""
    gen = torch.Generator().manual_seed(4)
    preamble = rand(gen, 16, vocab)
    w = Workload()
    w.rounds.append([Request("short/first", 0, preamble + rand(gen, 48, vocab))])
    w.rounds.append([Request("short/follow", 1, preamble + rand(gen, 48, vocab))
                     for _ in range(args.short)])
    return w


def chat_workload(args: argparse.Namespace, engine: Engine) -> Workload:
    """Builds the conversations by running them (the replies are greedy decodes)."""
    vocab = engine.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    system = rand(gen, args.system, vocab)
    history = [list(system) for _ in range(args.convs)]
    w = Workload()
    for t in range(args.turns):
        rnd = []
        for c in range(args.convs):
            prompt = history[c] + rand(gen, between(gen, 64, 192), vocab)
            seq = Sequence()
            logits = engine.prefill(seq, prompt).logits
            reply, _ = engine.greedy(seq, logits, REPLY_TOKENS)
            engine.release(seq)
            history[c] = prompt + reply
            rnd.append(Request("chat/first" if t == 0 else "chat/follow", t, prompt))
        w.rounds.append(rnd)
    return w


def drop_page_cache(directory: Path) -> None:
    """Evict a directory's files from the OS page cache (clean pages only; no root needed)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def settle_on_ssd(replica: KvtierEngine, prompts: list[list[int]], timeout: float = 60.0) -> int:
    """Look the prompts up again until the SSD tier stops growing; returns its block count.

    The daemon queues write-backs when a block is looked up (its k-th access), into a bounded
    queue: re-looking-up until the SSD block count stops moving makes sure every block landed.
    """
    client = replica.client()
    if client is None:
        return 0
    last, still, deadline = -1, 0, time.monotonic() + timeout
    while still < 3 and time.monotonic() < deadline:
        for p in prompts:
            client.lookup(replica.keys(p))
        time.sleep(0.3)
        now = int(next(t.blocks for t in client.stats().tiers if t.tier == pb.TIER_SSD))
        still = still + 1 if now == last else 0
        last = now
    return last


def record(mode: str, req: Request, ttft: float, **extra: Any) -> dict[str, Any]:
    return {"mode": mode, "cls": req.cls, "round": req.rnd, "prompt_tokens": len(req.prompt),
            "ttft_s": ttft, **extra}


def run_recompute(engine: Engine, work: list[Workload]) -> list[dict[str, Any]]:
    out = []
    for w in work:
        for rnd in w.rounds:
            for req in rnd:
                seq = Sequence()
                res = engine.prefill(seq, req.prompt)
                engine.release(seq)
                req.ref = res.logits
                out.append(record("recompute", req, res.seconds, prefill_s=res.seconds,
                                  exact=True, computed_tokens=len(req.prompt)))
    return out


def warm_up(replica: KvtierEngine, gen: torch.Generator, tokens: int) -> None:
    """Unrelated prompts so the daemon's planner learns this engine's prefill rate."""
    for _ in range(2):
        res = replica.serve(rand(gen, tokens, replica.engine.config.vocab_size))
        replica.engine.release(res.seq)


def run_kvtier(mode: str, engine: Engine, work: list[Workload], root: Path,
               daemon_args: list[str], warm_tokens: int, results: Path) -> list[dict[str, Any]]:
    plan, ssd = mode.startswith("plan"), mode.endswith("ssd")
    daemon = LocalDaemon(root / mode, daemon_args).start()
    replica = KvtierEngine(engine, LinkOptions(socket=daemon.socket, use_plan=plan,
                                               timeout_s=30.0))
    gen = torch.Generator().manual_seed(99)
    out = []
    try:
        if plan:
            warm_up(replica, gen, warm_tokens)
        for w in work:
            for r, rnd in enumerate(w.rounds):
                if ssd and r > 0:
                    settled = settle_on_ssd(replica, [q.prompt for q in w.rounds[r - 1]])
                    print(f"  {mode}: {settled} blocks on SSD before restart {r}",
                          file=sys.stderr)
                    replica.close()
                    daemon.stop()
                    drop_page_cache(daemon.data_dir)
                    daemon.start()
                    if plan:
                        warm_up(replica, gen, warm_tokens)
                for req in rnd:
                    res = replica.serve(req.prompt)
                    engine.release(res.seq)
                    assert req.ref is not None
                    tiers = [t.label for t in res.loaded_tiers]
                    out.append(record(
                        mode, req, res.ttft_s, lookup_s=res.lookup_s, load_s=res.load_s,
                        prefill_s=res.prefill_s, store_s=res.store_s,
                        usable_blocks=(len(req.prompt) - 1) // engine.block_tokens,
                        hit_blocks=res.hit_blocks, planned_blocks=res.planned_blocks,
                        loaded_blocks=res.loaded_blocks, dram_blocks=tiers.count("dram"),
                        ssd_blocks=tiers.count("ssd"), computed_tokens=res.computed_tokens,
                        plan_reason=res.plan_reason, fallback=res.fallback,
                        exact=bool(torch.equal(res.logits, req.ref))))
    finally:
        replica.close()
        daemon.stop()
        results.mkdir(parents=True, exist_ok=True)
        (results / f"e2e_daemon_{mode}.log").write_text(daemon.log())
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    table: dict[str, dict[str, dict[str, float]]] = {}
    for cls in (*CLASSES, "all"):
        table[cls] = {}
        for mode in MODES:
            rs = [r for r in records if r["mode"] == mode and cls in (r["cls"], "all")]
            if not rs:
                continue
            ttft = [r["ttft_s"] for r in rs]
            usable = sum(r.get("usable_blocks", 0) for r in rs)
            table[cls][mode] = {
                "n": len(rs), "p50_s": statistics.median(ttft), "p90_s": pct(ttft, 0.9),
                "kvtier_p50_s": statistics.median(r.get("lookup_s", 0.0) + r.get("load_s", 0.0)
                                                  for r in rs),
                "tokens_per_s": sum(r["prompt_tokens"] for r in rs) / sum(ttft),
                "hit_ratio": (sum(r.get("loaded_blocks", 0) for r in rs) / usable) if usable
                else 0.0,
            }
        base = table[cls].get("recompute")
        for row in table[cls].values():
            row["speedup_p50"] = base["p50_s"] / row["p50_s"] if base else float("nan")
    return table


def planner_check(records: list[dict[str, Any]], table: dict[str, Any]) -> list[dict[str, Any]]:
    """Per class and tier: did the planner choose the option that measured faster?

    The options compared are what a plan decides between once the lookup is done: fetch (load +
    prefill of the rest, median over the planner-off run of that tier) or recompute (prefill of
    the whole prompt, the engine-alone run). The lookup itself is paid either way.
    """
    out = []
    for cls in CLASSES:
        redo = [r["prefill_s"] for r in records if r["mode"] == "recompute" and r["cls"] == cls]
        for state in ("dram", "ssd"):
            rs = [r for r in records if r["mode"] == f"plan-{state}" and r["cls"] == cls
                  and r["hit_blocks"] > 0]
            fetch = [r["load_s"] + r["prefill_s"] for r in records
                     if r["mode"] == state and r["cls"] == cls and r["loaded_blocks"] > 0]
            if not rs or not fetch or not redo:
                continue
            fetched = sum(1 for r in rs if r["planned_blocks"] > 0)
            choice = "fetch" if fetched * 2 >= len(rs) else "recompute"
            fetch_s, redo_s = statistics.median(fetch), statistics.median(redo)
            faster = "fetch" if fetch_s < redo_s else "recompute"
            out.append({
                "cls": cls, "tier": state, "requests_with_hits": len(rs),
                "planner_fetched": fetched, "choice": choice, "faster": faster,
                "correct": choice == faster, "fetch_p50_s": fetch_s, "recompute_p50_s": redo_s,
                "planner_p50_s": table[cls][f"plan-{state}"]["p50_s"],
                "reasons": sorted({r["plan_reason"] for r in rs}),
            })
    return out


def print_report(table: dict[str, Any], checks: list[dict[str, Any]], n8k: int,
                 prefill_8k: float, exact: bool) -> None:
    print(f"\nprefill of {n8k} tokens, engine alone: {prefill_8k:.2f} s "
          f"({'>=' if prefill_8k >= 1 else '<'} 1 s)")
    print(f"\n{'class':<12} {'mode':<10} {'n':>3} {'TTFT p50':>10} {'p90':>10} "
          f"{'lookup+load':>11} {'tok/s':>9} {'hit':>5} {'speedup':>8}")
    for cls, rows in table.items():
        for mode, r in rows.items():
            print(f"{cls:<12} {mode:<10} {r['n']:>3} {r['p50_s'] * 1e3:>8.1f}ms "
                  f"{r['p90_s'] * 1e3:>8.1f}ms {r['kvtier_p50_s'] * 1e3:>9.1f}ms "
                  f"{r['tokens_per_s']:>9.0f} "
                  f"{r['hit_ratio']:>5.2f} {r['speedup_p50']:>7.1f}x")
    print("\nplanner: chosen vs measured-faster option per class and tier")
    for c in checks:
        mark = "ok" if c["correct"] else "WRONG"
        print(f"  {c['cls']:<12} {c['tier']:<5} chose {c['choice']:<9} "
              f"({c['planner_fetched']}/{c['requests_with_hits']} fetched) faster: "
              f"{c['faster']:<9} fetch {c['fetch_p50_s'] * 1e3:.1f}ms vs recompute "
              f"{c['recompute_p50_s'] * 1e3:.1f}ms  [{mark}] {','.join(c['reasons'])}")
    print(f"\nall logits bit-exact vs recompute: {exact}")


def plot(records: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in zip(MODES, "os^vD", strict=True):
        rs = [r for r in records if r["mode"] == mode and r["cls"].endswith("follow")]
        ax.scatter([r["prompt_tokens"] for r in rs], [r["ttft_s"] * 1e3 for r in rs],
                   label=mode, marker=marker, s=18)
    ax.set(xlabel="prompt tokens", ylabel="TTFT (ms)", yscale="log",
           title="Reference engine TTFT, follow-up requests (dev-2c CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.e2e", description=__doc__.split("\n")[0],
    )
    p.add_argument("--model", default="bench", help="engine preset (default: bench)")
    p.add_argument("--convs", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system", type=int, default=512, help="system prompt tokens")
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=8192)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--short", type=int, default=8, help="short prompts after a 1-block preamble")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the engine runs (cuda: not yet run on a GPU)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="directory of e2e.json, the plot and daemon logs (default bench/results)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model and workloads (a smoke run of a few seconds)")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.convs, args.turns, args.system = "tiny", 2, 2, 48
        args.docs, args.doc_tokens, args.questions, args.short = 1, 256, 2, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible to torch")
    bad = set(args.modes.split(",")) - set(MODES)
    if bad or "recompute" not in args.modes.split(","):
        p.error(f"--modes: choose from {','.join(MODES)} and include recompute")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    cfg = get_config(args.model)
    n8k = min(8192, cfg.max_positions)
    longest = max(n8k, args.doc_tokens + 96, args.system + args.turns * (192 + REPLY_TOKENS))
    engine = Engine(cfg, num_blocks=longest // cfg.block_tokens + 64, device=args.device)
    started = time.perf_counter()
    seq = Sequence()
    prefill_8k = engine.prefill(seq, rand(torch.Generator().manual_seed(3), n8k,
                                          cfg.vocab_size)).seconds
    engine.release(seq)
    print(f"model {args.model}: {cfg.matmul_params() / 1e6:.2f} M matmul params, "
          f"{cfg.layers} layers, {cfg.kv_bytes_per_token()} B KV/token; "
          f"prefill of {n8k} tokens {prefill_8k:.2f} s", file=sys.stderr)
    work = [chat_workload(args, engine), doc_workload(args, cfg.vocab_size),
            short_workload(args, cfg.vocab_size)]
    records = run_recompute(engine, work)
    slot = max(cfg.block_bytes(), 4096)
    daemon_args = ["--dram-bytes", str(max(256 << 20, 64 * slot)), "--slot-bytes", str(slot),
                   "--ssd-bytes", "2GiB", "--ssd-admit-after", "1", "--grace-s", "5",
                   "--ssd-write-bytes-per-day", "1TiB"]  # TTFT here, not the wear policy
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-e2e-") as tmp:
        for mode in args.modes.split(","):
            if mode != "recompute":
                print(f"mode {mode} ...", file=sys.stderr)
                records += run_kvtier(mode, engine, work, Path(tmp), daemon_args,
                                      4 * cfg.block_tokens * 8, args.results)
    table = summarize(records)
    checks = planner_check(records, table)
    exact = all(r["exact"] for r in records)
    print_report(table, checks, n8k, prefill_8k, exact)
    args.results.mkdir(parents=True, exist_ok=True)
    png = args.results / "e2e_ttft.png"
    result = {
        "bench": "e2e", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "python": platform.python_version(),
        "torch_threads": args.threads, "model": cfg.model_id(),
        "args": {**vars(args), "results": str(args.results)},
        "prefill_8k_tokens": n8k, "prefill_8k_s": prefill_8k, "summary": table, "planner": checks,
        "all_bit_exact": exact, "records": records,
        "wall_s": time.perf_counter() - started,
        "plot": str(png) if plot(records, png) else None,
    }
    (args.results / "e2e.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.results / 'e2e.json'} in {result['wall_s']:.0f} s", file=sys.stderr)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
