"""`kvtier size --overload TOKENS`: what a full pool costs, per way out.

When the pool cannot take a new request, an engine can make it wait (admission control), evict a
running request and recompute it later (vLLM v1's preemption, mode RECOMPUTE), or spill that
request's KV to kvtier's DRAM and bring it back. For a victim of `TOKENS` tokens on one rank:

    admission   the arriving request waits for k = ceil(its pages / one finished sequence's pages)
                completions; C running sequences of O output tokens finish one every O / C
                decode steps:  wait = k x O / C x step
    recompute   the victim's pages are freed at once; on re-admission it prefills its tokens
                again:  redo = prefill FLOPs(0, TOKENS) / F; the steps it runs in are shared
                with everyone's decode
    spill       its pages go over the D2H link and come back over H2D:
                out = bytes / d2h + latency, back = bytes / h2d + latency (bytes = its pages)

The decode step is `--decode-step-ms`, else estimated as one pass over the rank's weights and the
running batch's KV at HBM bandwidth. Rates: `kvtier.commands.size_rates` (stated, calibration
file or the planner's defaults).

Which latency each way out lands on, and by how much (`p99_on`, `p99_effect_s`; `p99_also` for
the others it touches):

    admission   the arriving request's time to first token:  + wait
    recompute   the victim's inter-token gap (and end-to-end):  + wait + redo (it goes back to
                the queue and is re-admitted after the same k completions, then prefills again);
                every running request's step while the recompute shares it: the redo spread over
                n = ceil(TOKENS / --prefill-chunk) steps (1 with the whole prompt in one step),
                step -> step + redo / n (a compute-bound prefill and a memory-bound decode in one
                step add up), so each running request's inter-token gap + redo / n for n steps
                and its end-to-end latency + redo
    spill       the victim's inter-token gap:  + max(out, wait) + back;
                the arriving request's time to first token:  + out

A latency's p99 rises by about its figure when more than 1% of requests pay it (each running
request pays a recompute's slowdown, so one recompute at a time in a busy pool is enough); at or
below 1% the p99 does not see it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvtier.core.costmodel import CostModel
from kvtier.core.errors import UsageError
from kvtier.core.layout import KVLayout
from kvtier.core.presets import ModelSpec
from kvtier.core.sizing import page_bytes, sequence_pages

P99_CONDITION = (
    "a latency's p99 rises by about its figure when more than 1% of requests pay it "
    "(at or below 1%, the p99 does not see it)"
)
HBM_BYTES_PER_S = 3.35e12
"""H100 SXM HBM3 bandwidth (NVIDIA datasheet), for the default decode step estimate."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("a full pool (--overload)")
    o.add_argument(
        "--overload",
        metavar="TOKENS",
        help="price admission control, preemption by recompute and spilling to kvtier's DRAM "
        "for a victim of TOKENS tokens, e.g. 6144",
    )
    o.add_argument(
        "--decode-step-ms",
        metavar="MS",
        help="one decode step's time (default: weights + running KV over H100 HBM bandwidth)",
    )


def compute(
    spec: ModelSpec,
    layout: KVLayout,
    weights_bytes: int,
    concurrency: int,
    prompt: int,
    output: int,
    prefill_chunk: int,
    rates: dict[str, float],
    sources: dict[str, str],
    a: argparse.Namespace,
) -> dict[str, Any] | None:
    if a.overload is None:
        return None
    try:
        victim = int(a.overload.strip())
    except ValueError:
        raise UsageError(f"--overload must be a token count, got {a.overload!r}") from None
    if victim < 1:
        raise UsageError(f"--overload must be >= 1, got {victim}")
    b = layout.bytes_per_token()
    running_kv = concurrency * (prompt + output // 2) * b
    if a.decode_step_ms is not None:
        try:
            step = float(a.decode_step_ms) / 1e3
        except ValueError:
            msg = f"--decode-step-ms must be a number, got {a.decode_step_ms!r}"
            raise UsageError(msg) from None
        if not math.isfinite(step) or step <= 0:
            raise UsageError(f"--decode-step-ms must be > 0, got {a.decode_step_ms}")
        step_source = f"--decode-step-ms {a.decode_step_ms}"
    else:
        step = (weights_bytes + running_kv) / HBM_BYTES_PER_S
        step_source = (
            f"({weights_bytes:,} B weights + {running_kv:,} B running KV = {concurrency} x "
            f"({prompt:,} + {output:,} / 2) x {b:,} B) / {HBM_BYTES_PER_S:g} B/s (H100 HBM3)"
        )
    pages = sequence_pages(layout, victim)
    per_finished = sequence_pages(layout, prompt + output)
    k = -(-pages // per_finished) if per_finished else 0
    wait = k * output / concurrency * step
    cost = CostModel.from_spec(spec, tp=layout.tp_size, dtype=layout.dtype)
    flops = float(cost.prefill_flops(0, victim))
    redo = flops / rates["prefill_flops_per_s"]
    moved = pages * page_bytes(layout)
    out = moved / rates["d2h_bytes_per_s"] + rates["d2h_latency_s"]
    back = moved / rates["h2d_bytes_per_s"] + rates["h2d_latency_s"]
    steps = -(-victim // prefill_chunk) if prefill_chunk else 1
    shared = step + redo / steps
    chunking = (
        f"ceil({victim:,} / --prefill-chunk {prefill_chunk:,})" if prefill_chunk
        else "the whole prompt in one step (--prefill-chunk 0)"
    )
    ms = 1e3
    return {
        "victim_tokens": victim,
        "victim_pages": pages,
        "decode_step_s": step,
        "decode_step_source": step_source,
        "p99_condition": P99_CONDITION,
        "admission": {
            "completions_needed": k,
            "wait_s": wait,
            "formula": f"ceil({pages:,} / {per_finished:,}) = {k} completions x {output:,} / "
            f"{concurrency} steps x {step * ms:.3f} ms",
            "absorbed_by": "the arriving request (its time to first token)",
            "p99_on": "the arriving request's time to first token",
            "p99_effect_s": wait,
            "p99_formula": "the wait",
            "p99_also": [],
        },
        "recompute": {
            "prefill_flops": flops,
            "redo_s": redo,
            "formula": f"{flops:.4g} FLOPs / {rates['prefill_flops_per_s']:.4g} FLOP/s",
            "rate_source": sources["prefill"],
            "absorbed_by": "the victim (a gap in its output of at least this), and every running "
            "request's steps while the recompute shares them",
            "p99_on": "the victim's inter-token gap (and end-to-end)",
            "p99_effect_s": wait + redo,
            "p99_formula": f"re-admission wait {wait:.3f} s (the same {k} completions) + redo "
            f"{redo:.3f} s",
            "step_slowdown": {
                "prefill_steps": steps,
                "step_s": step,
                "shared_step_s": shared,
                "factor": shared / step,
                "formula": f"{step * ms:.3f} ms + {redo * ms:.3f} ms / {steps} [{chunking}] = "
                f"{shared * ms:.3f} ms",
            },
            "p99_also": [
                {
                    "on": f"every running request's inter-token gap, for {steps} step(s) "
                    f"(end-to-end +{redo:.3f} s)",
                    "effect_s": redo / steps,
                    "formula": f"a shared step {step * ms:.3f} ms + {redo * ms:.3f} ms / {steps} "
                    f"[{chunking}] = {shared * ms:.3f} ms (x{shared / step:.2f})",
                },
            ],
        },
        "spill": {
            "bytes": moved,
            "out_s": out,
            "back_s": back,
            "formula": f"{moved:,} B / {rates['d2h_bytes_per_s']:.4g} B/s + "
            f"{rates['d2h_latency_s']:g} s out, / {rates['h2d_bytes_per_s']:.4g} B/s + "
            f"{rates['h2d_latency_s']:g} s back",
            "rate_source": f"d2h {sources['dram_write']}; h2d {sources['dram']}",
            "absorbed_by": "the victim (the way back); the way out delays the pages' release to "
            "the arriving request",
            "p99_on": "the victim's inter-token gap (and end-to-end)",
            "p99_effect_s": max(out, wait) + back,
            "p99_formula": f"max(out {out:.4f} s, re-admission wait {wait:.3f} s) + back "
            f"{back:.4f} s",
            "p99_also": [
                {
                    "on": "the arriving request's time to first token",
                    "effect_s": out,
                    "formula": "the way out (its pages are free once copied)",
                },
            ],
        },
    }


def _p99(x: dict[str, Any]) -> list[str]:
    pad = " " * 21
    lines = [f"{pad}p99: {x['p99_on']} +{x['p99_effect_s']:.3f} s = {x['p99_formula']}"]
    for also in x["p99_also"]:
        lines.append(f"{pad}     {also['on']} +{also['effect_s'] * 1e3:.3f} ms = {also['formula']}")
    return lines


def render(o: dict[str, Any]) -> list[str]:
    v = o["victim_tokens"]
    ad, rc, sp = o["admission"], o["recompute"], o["spill"]
    return [
        "",
        f"a full pool: a {v:,}-token victim ({o['victim_pages']:,} pages, one rank); decode step "
        f"{o['decode_step_s'] * 1e3:.3f} ms = {o['decode_step_source']}",
        f"  admission control  wait {ad['wait_s']:.3f} s = {ad['formula']}; paid by "
        f"{ad['absorbed_by']}",
        *_p99(ad),
        f"  recompute          redo {rc['redo_s']:.3f} s = {rc['formula']} [{rc['rate_source']}]; "
        f"paid by {rc['absorbed_by']}",
        *_p99(rc),
        f"  spill to DRAM      {sp['bytes']:,} B: out {sp['out_s']:.4f} s, back {sp['back_s']:.4f}"
        f" s = {sp['formula']} [{sp['rate_source']}]; paid by {sp['absorbed_by']}",
        *_p99(sp),
        f"  p99: {o['p99_condition']}",
    ]
