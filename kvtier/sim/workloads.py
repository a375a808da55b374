"""Built-in workload generators: multi-turn chat, long-document QA, agentic tool calling and a RAG
mix, as Mooncake-style traces; and three shapes for checking a policy on traffic it was not tuned
on: `longreuse` (a large, flat-popularity document set: reuse distances of a large fraction of the
distinct blocks, where recency wins as the cache grows), `docchat` (long documents and chat
sessions interleaved: two reuse scales in one stream) and `tenants` (three tenants' streams in one
trace with disjoint ids — a hot chat, a cold flat-popularity RAG and a one-shot document scan —
each with its own reuse). Held out (no policy setting was chosen on them): `drift` (popularity
that moves: three document sets in turn beside agent sessions) and `conversation` (production-like
conversations: many apps' system prompts, sessions of a few turns opening with a long message;
shaped like a real conversation trace, ~24 block references a request, and meant to be run at its
length, 12,000 requests).

All produce `Request`s with chained 512-token block ids exactly like a Mooncake trace, so every
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


@dataclass(frozen=True)
class AgenticSpec:
    """Tool-calling agents: a long shared tool/system prefix (a few, Zipf-popular), then deep
    sessions of many steps, each appending a short tool call and its result (unique text)."""

    requests: int = 4000
    seed: int = 0
    tool_prefixes: int = 4
    tool_tokens: tuple[int, int] = (6000, 16000)
    zipf_s: float = 1.2
    sessions_per_s: float = 0.3
    mean_steps: float = 20.0
    step_tokens: tuple[int, int] = (40, 700)
    mean_step_s: float = 4.0
    max_context_tokens: int = 65536


@dataclass(frozen=True)
class RagSpec:
    """Retrieval-augmented questions: an instruction prefix, then the top-k chunks retrieved for
    a topic (Zipf-popular topics; a topic's chunks always come in the same order, k varies, so
    questions on one topic share the prefix up to the shorter k), then a unique question."""

    requests: int = 4000
    seed: int = 0
    topics: int = 3000
    zipf_s: float = 1.1
    instruction_tokens: int = 700
    chunk_tokens: tuple[int, int] = (300, 1200)
    chunks: tuple[int, int] = (2, 6)
    question_tokens: tuple[int, int] = (20, 250)
    output_tokens: tuple[int, int] = (30, 500)
    requests_per_s: float = 3.0


@dataclass(frozen=True)
class ConversationSpec:
    """Production-like conversations: many apps' system prompts (Zipf-popular), sessions of a few
    turns whose first message is often long (a pasted document or code: log-uniform length) and
    whose later messages are short; each turn's prompt = system prompt + transcript + message."""

    requests: int = 12000
    seed: int = 0
    apps: int = 40
    system_tokens: tuple[int, int] = (300, 4000)
    zipf_s: float = 1.0
    sessions_per_s: float = 1.3
    mean_turns: float = 2.5
    first_tokens: tuple[int, int] = (500, 32000)
    user_tokens: tuple[int, int] = (20, 3000)
    output_tokens: tuple[int, int] = (50, 1000)
    mean_think_s: float = 60.0
    max_context_tokens: int = 65536


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


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    scale: float = (hi / lo) ** rng.random()
    return round(lo * scale)


def conversation(spec: ConversationSpec = ConversationSpec()) -> list[Request]:
    """Conversations (`ConversationSpec`): turn t's prompt = the app's system prompt + every
    earlier message and answer + a new message; the first message log-uniform in
    `first_tokens`, later ones in `user_tokens`."""
    _check_positive(requests=spec.requests, apps=spec.apps, sessions_per_s=spec.sessions_per_s,
                    mean_turns=spec.mean_turns)
    rng = random.Random(spec.seed)
    sys_len = [rng.randint(*spec.system_tokens) for _ in range(spec.apps)]
    cum = _zipf_cum_weights(spec.apps, spec.zipf_s)
    ids = _Ids()
    turns: list[tuple[float, int, int, Request]] = []
    start = 0.0
    session = 0
    while len(turns) < spec.requests:
        start += rng.expovariate(spec.sessions_per_s)
        a = rng.choices(range(spec.apps), cum_weights=cum)[0]
        context = sys_len[a]
        t = start
        for turn in itertools.count():
            msg = _log_uniform(rng, *(spec.first_tokens if turn == 0 else spec.user_tokens))
            prompt = context + msg
            if prompt > spec.max_context_tokens:
                break
            out = rng.randint(*spec.output_tokens)
            segs: list[tuple[Hashable, int]] = [(("app", a), sys_len[a]),
                                                (("conv", session), prompt)]
            turns.append((t, session, turn,
                          Request(round(t * 1000.0, 3), prompt, out, ids.chain(segs, prompt))))
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


def agentic(spec: AgenticSpec = AgenticSpec()) -> list[Request]:
    """Agent sessions: step i's prompt = tool prefix + every earlier step's call and result."""
    _check_positive(
        requests=spec.requests,
        tool_prefixes=spec.tool_prefixes,
        sessions_per_s=spec.sessions_per_s,
        mean_steps=spec.mean_steps,
    )
    rng = random.Random(spec.seed)
    tool_len = [rng.randint(*spec.tool_tokens) for _ in range(spec.tool_prefixes)]
    cum = _zipf_cum_weights(spec.tool_prefixes, spec.zipf_s)
    ids = _Ids()
    steps: list[tuple[float, int, int, Request]] = []
    start = 0.0
    session = 0
    while len(steps) < spec.requests:
        start += rng.expovariate(spec.sessions_per_s)
        p = rng.choices(range(spec.tool_prefixes), cum_weights=cum)[0]
        prompt = tool_len[p] + rng.randint(*spec.step_tokens)
        t = start
        for step in itertools.count():
            if prompt > spec.max_context_tokens:
                break
            segs: list[tuple[Hashable, int]] = [(("tools", p), tool_len[p]),
                                                (("agent", session), prompt)]
            out = rng.randint(*spec.step_tokens) // 4 + 1
            req = Request(round(t * 1000.0, 3), prompt, out, ids.chain(segs, prompt))
            steps.append((t, session, step, req))
            if rng.random() < 1.0 / spec.mean_steps:
                break
            prompt += out + rng.randint(*spec.step_tokens)
            t += rng.expovariate(1.0 / spec.mean_step_s)
        session += 1
    steps.sort(key=lambda x: x[:3])
    return [x[3] for x in steps[: spec.requests]]


def rag(spec: RagSpec = RagSpec()) -> list[Request]:
    """RAG: instruction prefix + a Zipf-popular topic's first k chunks + a fresh question."""
    _check_positive(requests=spec.requests, topics=spec.topics, requests_per_s=spec.requests_per_s)
    rng = random.Random(spec.seed)
    cum = _zipf_cum_weights(spec.topics, spec.zipf_s)
    chunk_len: dict[int, list[int]] = {}
    ids = _Ids()
    out: list[Request] = []
    t = 0.0
    head = spec.instruction_tokens
    for _ in range(spec.requests):
        t += rng.expovariate(spec.requests_per_s)
        topic = rng.choices(range(spec.topics), cum_weights=cum)[0]
        lens = chunk_len.get(topic)
        if lens is None:
            lens = chunk_len[topic] = [rng.randint(*spec.chunk_tokens)
                                       for _ in range(spec.chunks[1])]
        k = rng.randint(*spec.chunks)
        segs: list[tuple[Hashable, int]] = [("instructions", head)]
        end = head
        for j in range(k):
            end += lens[j]
            segs.append((("rag", topic, j), end))
        prompt = end + rng.randint(*spec.question_tokens)
        out.append(Request(round(t * 1000.0, 3), prompt, rng.randint(*spec.output_tokens),
                           ids.chain(segs, prompt)))
    return out


def merge(*streams: list[Request]) -> list[Request]:
    """Several traces as one, in arrival order, with each stream's ids kept apart (stream j's id
    i becomes ``i * len(streams) + j``): the streams share no block, like separate tenants."""
    n = len(streams)
    tagged = [(r.timestamp, j, i, r._replace(hash_ids=tuple(h * n + j for h in r.hash_ids)))
              for j, reqs in enumerate(streams) for i, r in enumerate(reqs)]
    tagged.sort(key=lambda x: x[:3])
    return [x[3] for x in tagged]


def longreuse(requests: int, seed: int) -> list[Request]:
    """Document QA over many documents of flat popularity (Zipf 0.6 over 4,000): most reuse comes
    back after a large share of the distinct blocks, so a cache ranks by recency as it grows."""
    return docqa(DocQASpec(requests=requests, seed=seed, documents=4000, zipf_s=0.6,
                           document_tokens=(2000, 20000)))


def docchat(requests: int, seed: int) -> list[Request]:
    """Long documents and chat interleaved over the same time span: half the requests each."""
    docs = docqa(DocQASpec(requests=requests // 2, seed=seed, documents=1500, zipf_s=0.8,
                           requests_per_s=1.0))
    talk = chat(ChatSpec(requests=requests - requests // 2, seed=seed + 1, sessions_per_s=0.17))
    return merge(docs, talk)


def tenants(requests: int, seed: int) -> list[Request]:
    """Three tenants with different reuse in one stream: hot chat (40%), cold RAG over many
    flat-popularity topics (40%) and a one-shot document scan that never recurs (20%)."""
    a, b = requests * 2 // 5, requests * 2 // 5
    hot = chat(ChatSpec(requests=a, seed=seed, sessions_per_s=0.2))
    cold = rag(RagSpec(requests=b, seed=seed + 1, topics=20000, zipf_s=0.7, requests_per_s=1.2))
    return merge(hot, cold, _scan(requests - a - b, seed + 2, 0.6))


def _scan(requests: int, seed: int, per_s: float) -> list[Request]:
    """One-shot documents (2,000-12,000 tokens) behind a short shared instruction prefix."""
    rng = random.Random(seed)
    ids = _Ids()
    out: list[Request] = []
    t = 0.0
    for i in range(requests):
        t += rng.expovariate(per_s)
        prompt = 300 + rng.randint(2000, 12000)
        segs: list[tuple[Hashable, int]] = [("instructions", 300), (("scan", i), prompt - 50)]
        out.append(Request(round(t * 1000.0, 3), prompt, rng.randint(20, 400),
                           ids.chain(segs, prompt)))
    return out


def drift(requests: int, seed: int) -> list[Request]:
    """Held out (never used to tune a policy; `bench.policies` reports it apart):
    document QA whose popular set changes twice — three phases in turn, each over its own 1,000
    documents of Zipf 0.9 popularity (1,500-12,000 tokens) — beside agent sessions that run
    through all three (a fifth of the requests)."""
    agents = requests // 5
    per = (requests - agents) // 3
    phases = []
    for k in range(3):
        n = per if k < 2 else requests - agents - 2 * per
        docs = docqa(DocQASpec(requests=max(1, n), seed=seed * 3 + k, documents=1000,
                               zipf_s=0.9, document_tokens=(1500, 12000), requests_per_s=2.0))
        shift = k * per / 2.0 * 1000.0  # each phase starts where the previous one ended
        phases.append([r._replace(timestamp=round(r.timestamp + shift, 3)) for r in docs])
    span_s = max(1.0, (requests - agents) / 2.0)
    steps = agentic(AgenticSpec(requests=max(1, agents), seed=seed + 7,
                                sessions_per_s=max(1, agents) / span_s / 20.0))
    return merge(merge(*phases), steps)


WORKLOADS = ("chat", "docqa", "agentic", "rag", "longreuse", "docchat", "tenants")
"""The generated shapes policies are measured (and tuned) on."""
HELD_OUT = ("drift", "conversation")
"""Shapes kept out of tuning: `bench.policies` reports them in their own rows and minimum."""


def generate(name: str, requests: int, seed: int) -> list[Request]:
    """A built-in workload by name (one of `WORKLOADS` or `HELD_OUT`) with default shape
    parameters."""
    if name == "chat":
        return chat(ChatSpec(requests=requests, seed=seed))
    if name == "docqa":
        return docqa(DocQASpec(requests=requests, seed=seed))
    if name == "agentic":
        return agentic(AgenticSpec(requests=requests, seed=seed))
    if name == "rag":
        return rag(RagSpec(requests=requests, seed=seed))
    if name == "longreuse":
        return longreuse(requests, seed)
    if name == "docchat":
        return docchat(requests, seed)
    if name == "tenants":
        return tenants(requests, seed)
    if name == "drift":
        return drift(requests, seed)
    if name == "conversation":
        return conversation(ConversationSpec(requests=requests, seed=seed))
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS + HELD_OUT)}")
