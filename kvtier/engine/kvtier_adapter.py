"""The reference engine as a kvtier client: what an inference replica does around each prefill.

    replica = KvtierEngine(Engine(get_config("tiny"), num_blocks=256), LinkOptions(socket=path))
    out = replica.serve(prompt)          # lookup -> load -> prefill -> report -> store
    tokens, _ = replica.engine.greedy(out.seq, out.logits, 16)
    replica.engine.release(out.seq)

Per request:

1. keys of the prompt's full blocks (`kvtier.core.keys`, namespaced by the weights' model id and the
   layout fingerprint); at most (len(prompt) - 1) // B of them are usable, so that at least one
   position is computed and produces the logits;
2. `Lookup` with the plan: fetch keys[0:cut], recompute the rest (without a plan: the whole hit);
3. `Acquire` (inside `Client.load`; SSD blocks are promoted into DRAM slots by the daemon), copy the
   slots into fresh pool blocks with the transfer engine (`TransferJob(LOAD)`), `Release`;
   only the leading blocks that copied completely are used;
4. chunked prefill of the rest (bit-exact with full recompute, see runner.py);
5. `ReportPrefill` (tokens, seconds, context) so the daemon's planner learns this engine's rate;
6. store the prompt's new prefilled full blocks: `Allocate` (cached keys are skipped), gather pool
   blocks into the slots (`TransferJob(STORE)`), `Commit`.

TTFT is steps 1-4. Failure rule (DESIGN invariant 7): any error on steps 1-3 — daemon gone,
timeout, a block the daemon could not verify (it reports fewer blocks), a failed copy — frees the
pool blocks taken and recomputes; steps 5-6 are best effort. The result says why (`fallback`).
After an unreachable daemon the replica runs without kvtier for `retry_after_s`, then reconnects.

Slots: with the DRAM segment mapped, `Client.slot_buffer()` is the [slots, slot_bytes] array over
the mapping and `Loaded.slots` / `StoreTx.slot_ids` name the rows, so the transfer engine copies
in place (`slot_window`); on the streaming path the per-block views go through a staging array.
Threading: one thread per replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
import numpy.typing as npt
import torch

from kvtier.client.sync_client import Client, KvtierRpcError, LayoutDecl, ModelCost, SlotBuffer
from kvtier.core.keys import KeyScheme
from kvtier.core.layout import DType, KVLayout
from kvtier.core.types import Tier
from kvtier.engine.config import ModelConfig
from kvtier.engine.kvpool import PoolExhausted
from kvtier.engine.runner import Engine
from kvtier.engine.runner import Sequence as Seq
from kvtier.gpu import transfer

log = logging.getLogger(__name__)
U8 = npt.NDArray[np.uint8]


def engine_layout(config: ModelConfig) -> KVLayout:
    return KVLayout.uniform(config.layers, config.kv_heads, config.head_dim,
                            DType.parse(config.dtype), config.block_tokens)


def layout_decl(config: ModelConfig) -> LayoutDecl:
    """The layout as declared to the daemon for this model's weights (`config.model_id()`, the
    same id `key_scheme` seeds keys with), with the cost parameters its planner needs."""
    cost = ModelCost(active_params=float(config.matmul_params()), num_layers=config.layers,
                     attn_dim=config.heads * config.head_dim)
    return LayoutDecl.from_layout(engine_layout(config), config.model_id(), key_width=32,
                                  model=cost)


def key_scheme(config: ModelConfig) -> KeyScheme:
    return KeyScheme.namespaced(config.model_id(), engine_layout(config).fingerprint())


@dataclass(frozen=True, slots=True)
class LinkOptions:
    """How the replica talks to the daemon. `use_plan=False` fetches every cached block;
    `store=False` never stores; `timeout_s` bounds each RPC (a dead daemon costs at most that)."""

    socket: str | Path | None = None
    token: str | None = None
    streaming: bool = False
    use_plan: bool = True
    store: bool = True
    timeout_s: float = 5.0
    retry_after_s: float = 1.0


class ServeResult(NamedTuple):
    logits: torch.Tensor
    """fp32 [vocab]: next-token logits after the prompt (equal to full recompute, bit for bit)."""
    seq: Seq
    """The request's sequence; the caller decodes with it and releases it."""
    prompt_tokens: int
    hit_blocks: int
    """Cached prefix the daemon reported, in blocks (of the usable ones)."""
    planned_blocks: int
    """The plan's cut (= hit_blocks without a plan)."""
    loaded_tiers: tuple[Tier, ...]
    """Tier each loaded block was served from (its length = blocks loaded)."""
    computed_tokens: int
    stored_blocks: int
    lookup_s: float
    load_s: float
    prefill_s: float
    store_s: float
    plan_reason: str
    fallback: str
    """Empty, or why kvtier's answer was not used (the request was recomputed instead)."""

    @property
    def ttft_s(self) -> float:
        return self.lookup_s + self.load_s + self.prefill_s

    @property
    def loaded_blocks(self) -> int:
        return len(self.loaded_tiers)


def slot_window(buffer: SlotBuffer | None, slots: Sequence[int]) -> tuple[U8, list[int]] | None:
    """The rows of the client's slot buffer from the lowest to the highest of `slots`, as one
    [rows, slot_bytes] array over the mapping (no copy), and each slot's row in it; None without
    a buffer (the streaming path) or slots."""
    if buffer is None or not slots:
        return None
    low = min(slots)
    return buffer.array()[low : max(slots) + 1], [s - low for s in slots]


def unreachable(exc: BaseException) -> bool:
    """The daemon is gone or not answering (as opposed to refusing one request)."""
    if isinstance(exc, KvtierRpcError):
        return exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return isinstance(exc, TimeoutError | ConnectionError)


class _StoreCopyFailed(RuntimeError):
    pass


class KvtierEngine:
    """An `Engine` serving prompts with kvtier: see the module docstring for the flow."""

    def __init__(self, engine: Engine, options: LinkOptions | None = None,
                 on_stage: Callable[[str], None] | None = None) -> None:
        """`on_stage(name)` is called at "lookup_done", "acquired" and "prefilled" (tracing and
        fault-injection tests)."""
        self.engine = engine
        self.options = options or LinkOptions()
        self.on_stage = on_stage
        self.decl = layout_decl(engine.config)
        self.scheme = key_scheme(engine.config)
        self._tpool = transfer.KVPool.layered(engine.pool.k, engine.pool.v)
        self._client: Client | None = None
        self._down_until = 0.0
        self.last_error = ""

    # -- connection ---------------------------------------------------------------------------

    def client(self) -> Client | None:
        """The connected client, connecting if needed; None while the daemon is unreachable."""
        if self._client is not None:
            return self._client
        if time.monotonic() < self._down_until:
            return None
        o = self.options
        try:
            self._client = Client(o.socket, layout=self.decl, token=o.token,
                                  streaming=o.streaming, timeout=o.timeout_s)
        except Exception as exc:  # unreachable, refused: run without kvtier for a while
            self._mark_down(exc)
            return None
        if self.engine.device.type == "cuda" and not self._client.register_cuda():
            log.info("DRAM segment not registered with CUDA; copies use unregistered memory")
        return self._client

    def _mark_down(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("kvtier unavailable, recomputing: %s", self.last_error)
        if self._client is not None:
            try:
                self._client.close()
            except Exception as close_exc:
                log.debug("closing the kvtier client failed: %s", close_exc)
        self._client = None
        self._down_until = time.monotonic() + self.options.retry_after_s

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> KvtierEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ------------------------------------------------------------------------------

    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        return self.scheme.block_keys(prompt, self.engine.block_tokens)

    def _stage(self, name: str) -> None:
        if self.on_stage is not None:
            self.on_stage(name)

    def serve(self, prompt: list[int]) -> ServeResult:
        """Prefill `prompt` using kvtier where it helps; always returns the correct logits."""
        bt = self.engine.block_tokens
        keys = self.keys(prompt)
        usable = keys[: max(0, (len(prompt) - 1) // bt)]
        hit = cut = 0
        reason = fallback = ""
        blocks: list[int] = []
        tiers: tuple[Tier, ...] = ()
        t0 = time.perf_counter()
        client = self.client() if keys else None
        if client is None and keys:
            fallback = f"kvtier unavailable: {self.last_error}"
        t1 = t2 = time.perf_counter()
        if client is not None and usable:
            try:
                found = client.lookup(usable, prompt_tokens=len(prompt),
                                      plan=self.options.use_plan)
                hit = found.hit_blocks
                cut = found.fetch_blocks if self.options.use_plan else hit
                reason = found.plan.reason if found.plan is not None else ""
                t1 = time.perf_counter()
                self._stage("lookup_done")
                if cut:
                    blocks, tiers = self._load(client, usable[:cut])
            except Exception as exc:
                fallback = f"{type(exc).__name__}: {exc}"
                if unreachable(exc):
                    self._mark_down(exc)
                else:
                    log.warning("kvtier load path failed, recomputing: %s", fallback)
                blocks, tiers = [], ()
                client = self._client
            t2 = time.perf_counter()
        seq = self.engine.adopt(prompt[: len(blocks) * bt], blocks)
        try:
            res = self.engine.prefill(seq, prompt)
        except BaseException:
            self.engine.release(seq)
            raise
        self._stage("prefilled")
        t3 = time.perf_counter()
        stored = 0
        if client is not None and self._client is client:
            stored = self._after_prefill(client, keys, seq, len(blocks), res.computed_tokens,
                                         res.seconds)
        return ServeResult(res.logits, seq, len(prompt), hit, cut, tiers, res.computed_tokens,
                           stored, t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, reason,
                           fallback)

    def _load(self, client: Client, keys: list[bytes]) -> tuple[list[int], tuple[Tier, ...]]:
        """Pool blocks holding keys' KV (a prefix of them: fewer if the daemon or a copy failed)."""
        try:
            blocks = self.engine.pool.allocate(len(keys))
        except PoolExhausted as exc:
            log.info("no free KV blocks to load into (%s); recomputing", exc)
            return [], ()
        n = 0
        try:
            with client.load(keys) as got:
                self._stage("acquired")
                n = got.blocks
                if n:
                    buf = client.slot_buffer() if got.slots else None
                    ok = self._copy(transfer.Direction.LOAD, buf, got.slots[:n], got.views[:n],
                                    blocks[:n])
                    n = int(np.argmin(ok)) if not ok.all() else n
                tiers = tuple(got.tiers[:n])
        except BaseException:
            self.engine.pool.free(blocks)
            raise
        self.engine.pool.free(blocks[n:])
        return blocks[:n], tiers

    def _copy(self, direction: transfer.Direction, buffer: SlotBuffer | None,
              slots: Sequence[int], views: Sequence[U8], blocks: Sequence[int]
              ) -> npt.NDArray[np.bool_]:
        """Copy between slots and pool blocks through the transfer engine; ok per pair. In place
        through the client's slot buffer when there is one, else through `views` and staging."""
        nbytes = self.decl.block_bytes
        window = slot_window(buffer, slots)
        if window is not None:
            return self._transfer(direction, window[0], window[1], blocks)
        if direction is transfer.Direction.LOAD:
            staging = np.stack([np.frombuffer(v, dtype=np.uint8) for v in views])
            return self._transfer(direction, staging, range(len(views)), blocks)
        staging = np.empty((len(views), nbytes), dtype=np.uint8)
        ok = self._transfer(direction, staging, range(len(views)), blocks)
        for view, row in zip(views, staging, strict=True):
            np.copyto(view, row)
        return ok

    def _transfer(self, direction: transfer.Direction, slots: U8, rows: Sequence[int],
                  blocks: Sequence[int]) -> npt.NDArray[np.bool_]:
        with transfer.TransferEngine(self._tpool, slots, backend="auto") as te:
            result = te.wait(te.submit(transfer.TransferJob(direction, list(rows), list(blocks))))
        if result.error:
            log.warning("transfer %s failed for %d block(s): %s", direction,
                        int((~result.ok).sum()), result.error)
        return result.ok

    def _after_prefill(self, client: Client, keys: list[bytes], seq: Seq, loaded: int,
                       computed: int, seconds: float) -> int:
        """Report the prefill rate and store new full blocks; best effort, never raises."""
        try:
            context = loaded * self.engine.block_tokens
            client.report_prefill(computed, seconds, context_tokens=context)
            if not self.options.store:
                return 0
            return self._store(client, keys, seq, loaded)
        except Exception as exc:
            if unreachable(exc):
                self._mark_down(exc)
            else:
                log.warning("kvtier store failed (output unaffected): %s", exc)
            return 0

    def _store(self, client: Client, keys: list[bytes], seq: Seq, first: int) -> int:
        last = min(seq.prefilled_blocks, len(keys))
        if last <= first:
            return 0
        new_keys = keys[first:last]
        parent = keys[first - 1] if first else b""
        blocks = seq.block_table[first:last]
        if not client.uses_shm:
            staging = np.empty((len(blocks), self.decl.block_bytes), dtype=np.uint8)
            ok = self._transfer(transfer.Direction.STORE, staging, range(len(blocks)), blocks)
            if not ok.all():
                return 0
            return client.store(new_keys, list(staging), parent).stored
        with client.store_into(new_keys, parent) as tx:
            if tx.slots:
                idx = [i for i, _ in tx.slots]
                ok = self._copy(transfer.Direction.STORE, client.slot_buffer(), tx.slot_ids,
                                [v for _, v in tx.slots], [blocks[i] for i in idx])
                if not ok.all():
                    raise _StoreCopyFailed(f"{int((~ok).sum())} block(s) failed to copy")
        return tx.committed


def describe(result: ServeResult) -> dict[str, Any]:
    """A flat, JSON-friendly summary of one request (for benchmarks and the demo)."""
    return {
        "prompt_tokens": result.prompt_tokens, "hit_blocks": result.hit_blocks,
        "planned_blocks": result.planned_blocks, "loaded_blocks": result.loaded_blocks,
        "loaded_tiers": [t.label for t in result.loaded_tiers],
        "computed_tokens": result.computed_tokens, "stored_blocks": result.stored_blocks,
        "ttft_s": result.ttft_s, "lookup_s": result.lookup_s, "load_s": result.load_s,
        "prefill_s": result.prefill_s, "store_s": result.store_s,
        "plan_reason": result.plan_reason, "fallback": result.fallback,
    }
