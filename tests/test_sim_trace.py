"""Trace parsing: the Mooncake JSONL reader, its line-numbered errors, and the generators."""

import json
from pathlib import Path

import pytest

from kvtier.core.errors import UsageError
from kvtier.sim import workloads
from kvtier.sim.trace import (
    ChainChecker,
    Request,
    block_refs,
    dump_lines,
    parse_lines,
    read_trace,
    write_trace,
)

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"
GOOD = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}'


def test_sample_trace_counts_match_its_readme():
    if not SAMPLE.exists():
        pytest.skip("sample trace not present")
    reqs = read_trace(SAMPLE)
    # ../shared/traces/README.md: 3,993 requests, 121,877 block references, 43,924 distinct.
    assert len(reqs) == 3993
    assert block_refs(reqs) == 121_877
    assert len({h for r in reqs for h in r.hash_ids}) == 43_924
    assert reqs[0] == Request(0, 40160, 6, tuple(range(79)))


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"timestamp": 0, "input_length": 5,', "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field(s) 'hash_ids'"),
        ('{"input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', ">= 0"),
        ('{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": []}', ">= 0"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', ">= 0"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": []}', "integer"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": []}', "integer"),
        ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": []}', "integer"),
        ('{"timestamp": "now", "input_length": 5, "output_length": 1, "hash_ids": []}', "number"),
        ('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": []}', "finite"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 7}', "a list"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}', "[1]"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-3]}', "[0]"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1.0]}', "[0]"),
        # id 1 came after id 0 on line 1; here it is a first block: not a chained prefix id.
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "chained"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, 1, 0]}', "id 0"),
    ],
)
def test_bad_line_is_reported_with_its_line_number(line, needle):
    with pytest.raises(UsageError) as err:
        parse_lines([GOOD + "\n", "\n", line + "\n", GOOD + "\n"], "t.jsonl")
    msg = str(err.value)
    assert msg.startswith("t.jsonl:3: "), msg
    assert needle in msg


def test_blank_lines_are_skipped_and_empty_trace_is_an_error(tmp_path):
    assert parse_lines(["\n", GOOD, "  \n"]) == [Request(0, 1000, 5, (0, 1))]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UsageError, match="no requests"):
        read_trace(empty)


def test_unreadable_file_and_non_utf8_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(UsageError, match=r"bad.jsonl:2: not UTF-8"):
        read_trace(bad)


def test_chain_checker_accepts_shared_prefixes_and_rejects_a_second_parent():
    c = ChainChecker()
    assert c.check((0, 1, 2)) is None
    assert c.check((0, 1, 3)) is None  # shares the prefix 0, 1
    assert c.check((4,)) is None
    assert "after id 4" in (c.check((4, 2)) or "")  # 2's parent is 1


def test_write_then_read_round_trips(tmp_path):
    reqs = workloads.chat(workloads.ChatSpec(requests=50, seed=3))
    path = tmp_path / "chat.jsonl"
    write_trace(reqs, path)
    assert read_trace(path) == reqs
    assert all(json.loads(x)["hash_ids"] for x in dump_lines(reqs[:3]))


@pytest.mark.parametrize("name", workloads.WORKLOADS + workloads.HELD_OUT)
def test_generators_are_seeded_chained_and_mooncake_shaped(name):
    a = workloads.generate(name, 300, seed=7)
    assert a == workloads.generate(name, 300, seed=7)
    assert a != workloads.generate(name, 300, seed=8)
    assert len(a) == 300
    chain = ChainChecker()
    for r in a:
        assert chain.check(r.hash_ids) is None
        assert len(r.hash_ids) == -(-r.input_length // 512)  # ceil, as in the Mooncake sample
        assert r.output_length > 0
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)


def test_chat_turns_extend_their_session_and_share_system_prompts():
    reqs = workloads.chat(workloads.ChatSpec(requests=400, seed=1))
    firsts = [r.hash_ids[0] for r in reqs]
    # 8 system prompts of >= 1000 tokens: every first block is one of at most 8 shared ids.
    assert len(set(firsts)) <= 8
    # Some later turn repeats all full blocks of an earlier prompt (its session transcript).
    full = {r.hash_ids[: r.input_length // 512] for r in reqs if r.input_length >= 3 * 512}
    assert any(
        r.hash_ids[: len(p)] == p and len(r.hash_ids) > len(p) + 1 for r in reqs for p in full
    )


def test_docqa_repeats_documents_with_fresh_questions():
    reqs = workloads.docqa(workloads.DocQASpec(requests=300, seed=2))
    tails = [r.hash_ids[-1] for r in reqs]
    assert len(set(tails)) == len(tails)  # the block holding the question is never shared
    heads = [r.hash_ids[:4] for r in reqs]
    assert len(set(heads)) < len(heads)  # popular documents recur


def test_generators_reject_nonsense_specs():
    with pytest.raises(ValueError, match="requests"):
        workloads.chat(workloads.ChatSpec(requests=0))
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.generate("nope", 10, 0)


def test_merge_keeps_streams_apart_and_in_time_order():
    a = workloads.chat(workloads.ChatSpec(requests=100, seed=1))
    b = workloads.docqa(workloads.DocQASpec(requests=100, seed=1))
    m = workloads.merge(a, b)
    assert len(m) == 200 and [r.timestamp for r in m] == sorted(r.timestamp for r in m)
    ids_a = {h for r in m for h in r.hash_ids if h % 2 == 0}
    assert ids_a == {h * 2 for r in a for h in r.hash_ids}  # stream 0 kept, apart from stream 1


def _median_reuse_distance(reqs):
    last, dists, t = {}, [], 0
    for r in reqs:
        for h in r.hash_ids:
            if h in last:
                dists.append(t - last[h])
            last[h] = t
            t += 1
    dists.sort()
    return (dists[len(dists) // 2] if dists else 0), len(dists) / t


def test_new_shapes_have_the_reuse_they_claim():
    long_d, _ = _median_reuse_distance(workloads.generate("longreuse", 600, 0))
    doc_d, _ = _median_reuse_distance(workloads.generate("docqa", 600, 0))
    assert long_d > 3 * doc_d  # reuse comes back much later
    reqs = workloads.generate("tenants", 600, 0)
    by_stream = [[r for r in reqs if r.hash_ids[0] % 3 == j] for j in range(3)]
    reuse = [_median_reuse_distance(s)[1] for s in by_stream]
    assert reuse[0] > 2 * reuse[1] > 0 and reuse[2] == 0  # hot chat, cold RAG, one-shot scan


def test_held_out_drift_moves_its_popular_set_beside_agents_throughout():
    """drift: documents (outer stream 0) in three phases with their own ids (inner stream k),
    agent sessions (outer stream 1) a fifth of the requests, across the whole span."""
    reqs = workloads.generate("drift", 600, 0)
    assert "drift" not in workloads.WORKLOADS  # never a tuning workload
    docs = [r for r in reqs if r.hash_ids[0] % 2 == 0]
    agents = [r for r in reqs if r.hash_ids[0] % 2 == 1]
    assert len(agents) == 120 and len(docs) == 480

    def phase(r):
        return (r.hash_ids[0] // 2) % 3

    assert {phase(r) for r in docs[:96]} == {0} and {phase(r) for r in docs[-96:]} == {2}
    blocks = [{h for r in docs if phase(r) == k for h in r.hash_ids} for k in range(3)]
    assert not blocks[0] & blocks[1] and not blocks[1] & blocks[2]  # the popular set moves
    first_2 = min(r.timestamp for r in docs if phase(r) == 2)
    assert agents[0].timestamp < docs[96].timestamp and agents[-1].timestamp > first_2
