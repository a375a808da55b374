"""Built-in workload generators: multi-turn chat and long-document QA, as Mooncake-style traces.

Both produce `Request`s with chained 512-token block ids exactly like a Mooncake trace, so every
part of the simulator treats them alike. Output is a pure function of the spec (seeded
`random.Random`, no `hash()`, no clock): the same spec gives the same trace on every run.

How ids are assigned. A prompt is a list of nested *shared segments* — e.g. a system prompt, then
a chat session's transcript — each with an owner that names the whole prompt content up to the
segment's end. A full block lying entirely inside a segment gets id (first such owner, position);
anything else (the part that will never recur: a partial last block, a question's tail) gets a
fresh id. Two prompts thus share an id at position i exactly when they share blocks 0..i:

    tokens  |0        512      1024      1536     1800|
    chat    |  system prompt s |   session transcript   |
    ids       (s,0)    (s,1)    (sess,2)  fresh (partial)
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable
from dataclasses import dataclass

from kvtier.sim.trace import TRACE_BLOCK_TOKENS, Request


@dataclass(frozen=True)
class ChatSpec:
    """Multi-turn chat sessions that share a few system prompts (Zipf-popular)."""

    requests: int = 4000
    seed: int = 0
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (1000, 6000)
    zipf_s: float = 1.0
    sessions_per_s: float = 0.5
    mean_turns: float = 6.0
    user_tokens: tuple[int, int] = (30, 1200)
    output_tokens: tuple[int, int] = (50, 900)
    mean_think_s: float = 40.0
    max_context_tokens: int = 32768


@dataclass(frozen=True)
class DocQASpec:
    """Questions about long documents (Zipf-popular) behind one shared instruction prefix."""

    requests: int = 4000
    seed: int = 0
    documents: int = 600
    document_tokens: tuple[int, int] = (3000, 40000)
    zipf_s: float = 1.0
    instruction_tokens: int = 400
    question_tokens: tuple[int, int] = (15, 300)
    output_tokens: tuple[int, int] = (20, 400)
    requests_per_s: float = 2.0


class _Ids:
    """Assigns block ids; see the module docstring."""

    def __init__(self) -> None:
        self._known: dict[tuple[Hashable, int], int] = {}
        self._next = itertools.count()

    def chain(self, segments: list[tuple[Hashable, int]], input_length: int) -> tuple[int, ...]:
        """Ids of an `input_length`-token prompt; `segments` = [(owner, end_token)], ascending."""
        n_blocks = -(-input_length // TRACE_BLOCK_TOKENS)
        ids: list[int] = []
        seg = 0
        for i in range(n_blocks):
            end = (i + 1) * TRACE_BLOCK_TOKENS
            while seg < len(segments) and segments[seg][1] < end:
                seg += 1
            if seg < len(segments) and end <= input_length:
                key = (segments[seg][0], i)
                bid = self._known.get(key)
                if bid is None:
                    bid = self._known[key] = next(self._next)
                ids.append(bid)
            else:
                ids.append(next(self._next))
        return tuple(ids)


def _zipf_cum_weights(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if v <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")


def chat(spec: ChatSpec = ChatSpec()) -> list[Request]:
    """Multi-turn chat: each turn's prompt = system prompt + transcript so far + new message."""
    _check_positive(
        requests=spec.requests,
        system_prompts=spec.system_prompts,
        sessions_per_s=spec.sessions_per_s,
        mean_turns=spec.mean_turns,
    )
    rng = random.Random(spec.seed)
    sys_len = [rng.randint(*spec.system_tokens) for _ in range(spec.system_prompts)]
    cum = _zipf_cum_weights(spec.system_prompts, spec.zipf_s)
    ids = _Ids()
    turns: list[tuple[float, int, int, Request]] = []
    start = 0.0
    session = 0
    while len(turns) < spec.requests:
        start += rng.expovariate(spec.sessions_per_s)
        s = rng.choices(range(spec.system_prompts), cum_weights=cum)[0]
        context = sys_len[s]
        t = start
        for turn in itertools.count():
            prompt = context + rng.randint(*spec.user_tokens)
            if prompt > spec.max_context_tokens:
                break
            out = rng.randint(*spec.output_tokens)
            segs: list[tuple[Hashable, int]] = [
                (("sys", s), sys_len[s]),
                (("chat", session), prompt),
            ]
            hash_ids = ids.chain(segs, prompt)
            turns.append((t, session, turn, Request(round(t * 1000.0, 3), prompt, out, hash_ids)))
            context = prompt + out
            if rng.random() < 1.0 / spec.mean_turns:
                break
            t += rng.expovariate(1.0 / spec.mean_think_s)
        session += 1
    turns.sort(key=lambda x: x[:3])
    return [x[3] for x in turns[: spec.requests]]


def docqa(spec: DocQASpec = DocQASpec()) -> list[Request]:
    """Long-document QA: instruction prefix + one (Zipf-popular) document + a fresh question."""
    _check_positive(
        requests=spec.requests, documents=spec.documents, requests_per_s=spec.requests_per_s
    )
    rng = random.Random(spec.seed)
    doc_len = [rng.randint(*spec.document_tokens) for _ in range(spec.documents)]
    cum = _zipf_cum_weights(spec.documents, spec.zipf_s)
    ids = _Ids()
    out: list[Request] = []
    t = 0.0
    head = spec.instruction_tokens
    for _ in range(spec.requests):
        t += rng.expovariate(spec.requests_per_s)
        d = rng.choices(range(spec.documents), cum_weights=cum)[0]
        prompt = head + doc_len[d] + rng.randint(*spec.question_tokens)
        segs: list[tuple[Hashable, int]] = [("instructions", head), (("doc", d), head + doc_len[d])]
        req = Request(
            round(t * 1000.0, 3), prompt, rng.randint(*spec.output_tokens), ids.chain(segs, prompt)
        )
        out.append(req)
    return out


WORKLOADS = ("chat", "docqa")


def generate(name: str, requests: int, seed: int) -> list[Request]:
    """A built-in workload by name ('chat' | 'docqa') with default shape parameters."""
    if name == "chat":
        return chat(ChatSpec(requests=requests, seed=seed))
    if name == "docqa":
        return docqa(DocQASpec(requests=requests, seed=seed))
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
