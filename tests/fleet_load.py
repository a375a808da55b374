"""Traffic for the fleet tests: a thread per daemon that looks up, loads and stores prompt chains
the way an engine does, so every kvtier_* series the dashboards read moves (hits in DRAM and
SSD, plans, leases, evictions, SSD write-backs and promotions)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvtier import Client, LayoutDecl, ModelCost

BLOCK = 65536  # the daemon fixture's slot size
PROMPTS = 40  # x 8 blocks = 320 blocks: more than the fixture's 256 DRAM slots, so DRAM evicts
BLOCKS = 8


def layout(model_id: str) -> LayoutDecl:
    return LayoutDecl(fingerprint=b"fleet-load-fp", block_bytes=BLOCK, block_tokens=16,
                      model=ModelCost(8.0e9, 32, 4096), model_id=model_id)


def chain(prompt: int, n: int = BLOCKS) -> list[bytes]:
    head = [bytes([0, j]) + bytes(30) for j in range(2)]  # a shared 2-block system prompt
    return head + [bytes([1 + prompt, j]) + bytes(30) for j in range(n - 2)]


def engine_loop(socket: Path, model_id: str, stop: threading.Event, pause_s: float) -> None:
    payload = bytes(BLOCK)
    with Client(socket, layout=layout(model_id)) as kv:
        i = 0
        while not stop.is_set():
            keys = chain((i * 7) % PROMPTS)
            kv.lookup(keys, plan=True, prompt_tokens=16 * len(keys))
            with kv.load(keys) as got:
                cached = got.blocks
            if cached < len(keys):
                kv.store(keys, [payload] * len(keys))
            i += 1
            stop.wait(pause_s)


@contextmanager
def load(sockets: Sequence[Path], models: Sequence[str], pause_s: float = 0.02,
         ) -> Iterator[list[threading.Thread]]:
    """Runs one engine loop per (socket, model) until the block exits; re-raises nothing (a
    daemon stopping under it ends its loop), joins the threads."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(sock: Path, model: str) -> None:
        try:
            engine_loop(sock, model, stop, pause_s)
        except BaseException as exc:
            if not stop.is_set():
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, m), daemon=True)
               for s, m in zip(sockets, models, strict=True)]
    for t in threads:
        t.start()
    try:
        yield threads
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    if errors:
        raise errors[0]
