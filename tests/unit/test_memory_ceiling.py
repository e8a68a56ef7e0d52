"""benchmarks/memory_ceiling.py: the ideal-memory simulation on hand-built token sequences and 2 real worlds,
and the ideal learned pool (a document-frequency gate on the round's tokens) on hand-built worlds."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "memory_ceiling.py"


@pytest.fixture(scope="module")
def mc():
    spec = importlib.util.spec_from_file_location("memory_ceiling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


C, A, O = 0, 1, 2  # context, action, observation
HEADER = [90, 91, 92]  # the response header before every observation (`user\n<tool_response>\n`)


def world(rounds_spec):
    """rounds_spec: [(action ids, observation ids)] for rounds 1..n -> ids, kinds, rounds."""
    ids, kinds, rounds = [1, 2], [C, C], [0, 0]
    for r, (act, obs) in enumerate(rounds_spec, start=1):
        for part, kind in ((act, A), (HEADER, C), (obs, O)):
            ids += part
            kinds += [kind] * len(part)
            rounds += [r] * len(part)
    return ids, kinds, rounds


# Two keys written by rounds 1 and 2 (commands name 10 and 11), read back by rounds 3 and 4.
TWO_KEYS = [([50, 10], [7, 8]), ([50, 11], [5, 6]), ([60, 10], [7, 8]), ([60, 11], [5, 6])]
READBACKS = [{"round": 3}, {"round": 4}]
TAGS = {1: ("a",), 2: ("b",), 3: ("a",), 4: ("b",)}


def test_window_stops_at_the_round(mc):
    ids, kinds, rounds = world(TWO_KEYS)
    p = ids.index(7)  # first observation token of round 1
    assert mc.window_key(ids, rounds, p, 3) == tuple(HEADER)
    assert mc.window_key(ids, rounds, p, 100) == (50, 10, *HEADER)  # not into round 0


def test_two_keys_collide_under_todays_key(mc):
    ids, kinds, rounds = world(TWO_KEYS)
    out = mc.simulate_world(ids, kinds, rounds, READBACKS, mc.make_key_fn(3), tags=TAGS)
    # both values sit at the header's address: round 2's value overwrote round 1's, so round 3 reads 5,
    # and round 3's write of 7 then spoils round 4
    assert [r["exact"] for r in out["readbacks"]] == [False, False]
    assert not out["passed"]
    first = mc.simulate_world(ids, kinds, rounds, READBACKS, mc.make_key_fn(3), tags=TAGS, write_rule="first")
    assert [r["exact"] for r in first["readbacks"]] == [True, False] and not first["passed"]


def test_round_address_separates_the_keys(mc):
    ids, kinds, rounds = world(TWO_KEYS)
    out = mc.simulate_world(ids, kinds, rounds, READBACKS, mc.make_key_fn(3, "name"), tags=TAGS)
    assert out["passed"] and all(r["exact"] for r in out["readbacks"])
    # the exact command tuple differs between write (50, x) and read (60, x): no read ever matches
    exact = mc.simulate_world(ids, kinds, rounds, READBACKS, mc.make_key_fn(3, "action"), tags=TAGS)
    assert not exact["passed"]
    # when the readback repeats the write's command, the exact round address passes too
    same = [([50, 10], [7, 8]), ([50, 11], [5, 6]), ([50, 10], [7, 8]), ([50, 11], [5, 6])]
    ids2, kinds2, rounds2 = world(same)
    assert mc.simulate_world(ids2, kinds2, rounds2, READBACKS, mc.make_key_fn(3, "action"))["passed"]
    assert not mc.simulate_world(ids2, kinds2, rounds2, READBACKS, mc.make_key_fn(3))["passed"]


def test_overwrite_and_read_before_write(mc):
    # round 1 writes 7 8, round 2 (same address) overwrites with 5 6; round 3 reads 5 6
    spec = [([50], [7, 8]), ([50], [5, 6]), ([50], [5, 6])]
    ids, kinds, rounds = world(spec)
    assert mc.simulate_world(ids, kinds, rounds, [{"round": 3}], mc.make_key_fn(3))["passed"]
    assert not mc.simulate_world(ids, kinds, rounds, [{"round": 3}], mc.make_key_fn(3), write_rule="first")["passed"]
    # a round is read with the memory of the earlier rounds only: round 1 cannot read its own write
    assert not mc.simulate_world(ids, kinds, rounds, [{"round": 1}], mc.make_key_fn(3))["passed"]
    # first-token accuracy counts the given position
    p = [i for i, r in enumerate(rounds) if r == 3 and kinds[i] == O][0]
    out = mc.simulate_world(ids, kinds, rounds, [{"round": 3}], mc.make_key_fn(3), first_positions={3: p},
                            write_rule="first")
    assert out["readbacks"][0]["first_token"] is False


def test_two_real_worlds(mc):
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.tokenizer import load_tokenizer
    from ds_ttt.evaluation.memory import MEMORY_SEED_BASE

    tok = load_tokenizer()
    pool = mc.render_pool([generate_memory_world(MEMORY_SEED_BASE + i) for i in range(2)], tok)
    assert all(w["num_keys"] == 2 and len(w["firsts"]) == len(w["readbacks"]) for w in pool)
    today = mc.score_pool(pool, mc.make_key_fn(4))
    assert today["passed"] == 0 and today["first_token"]["total"] == today["readbacks"]
    name = mc.score_pool(pool, mc.make_key_fn(4, "name"))
    assert name["passed"] == 2 and name["exact_readbacks"] == name["readbacks"]
    assert name["by_num_keys"] == {"2": {"worlds": 2, "passed": 2}}


# The learned pool: two keys written by `keygen <name>` (verb 50) and read back by `cat <name>` (verb 60).
COMMON = {1: 1.0, 2: 1.0, 50: 0.4, 60: 0.4, 70: 0.3, **{h: 0.9 for h in HEADER}}  # verbs, template: frequent
RARE = {10: 0.01, 11: 0.01}  # the names: rare


def test_pool_key_keeps_the_rare_tokens_of_the_round(mc):
    ids, kinds, rounds = world(TWO_KEYS)
    assert mc.round_starts(rounds)[ids.index(8)] == ids.index(50)  # round 1 starts at its action
    key_of = mc.make_pool_key_fn(3, {**COMMON, **RARE}, 0.1)(ids, kinds, rounds)
    p7, p8 = ids.index(7), ids.index(8)
    assert key_of(p7) == (tuple(HEADER), frozenset({10}))  # the verb and the header gated out, round 0 unseen
    assert key_of(p8) == ((91, 92, 7), frozenset({10, 7}))  # the value so far: never seen, so kept
    # a token at exactly the threshold is kept
    assert 50 in mc.make_pool_key_fn(3, {**COMMON, **RARE}, 0.4)(ids, kinds, rounds)(p7)[1]


def test_learned_pool_passes_where_todays_key_fails(mc):
    ids, kinds, rounds = world(TWO_KEYS)
    df = {**COMMON, **RARE}
    for nearest in (False, True):
        out = mc.simulate_world(ids, kinds, rounds, READBACKS, mc.make_pool_key_fn(3, df, 0.1), nearest=nearest)
        assert out["passed"] and [r["exact"] for r in out["readbacks"]] == [True, True]
    assert not mc.simulate_world(ids, kinds, rounds, READBACKS, mc.make_key_fn(3))["passed"]
    # a gate that keeps everything is the exact bag of the round: the read's verb is not the write's
    everything = mc.make_pool_key_fn(3, df, 1.0)
    exact = mc.simulate_world(ids, kinds, rounds, READBACKS, everything)
    assert [r["exact"] for r in exact["readbacks"]] == [False, False]
    # and read by the nearest set, round 4 ties between its write and round 3's readback (same verb): the
    # later write wins and returns the other key's value
    near = mc.simulate_world(ids, kinds, rounds, READBACKS, everything, nearest=True)
    assert [r["exact"] for r in near["readbacks"]] == [True, False]
    # a gate that drops the names too puts both keys on one address again
    assert not mc.simulate_world(ids, kinds, rounds, READBACKS, mc.make_pool_key_fn(3, df, 0.005))["passed"]


def _pool(names_per_world):
    out = []
    for i, (a, b) in enumerate(names_per_world):
        ids, kinds, rounds = world([([50, a], [7, 8]), ([50, b], [5, 6]), ([70], [3]),
                                    ([60, a], [7, 8]), ([60, b], [5, 6])])
        out.append({"seed": i, "num_keys": 2, "ids": ids, "kinds": kinds, "rounds": rounds,
                    "readbacks": [{"round": 4}, {"round": 5}], "firsts": {}, "tags": {}})
    return out


def test_document_frequency_and_the_dev_choice(mc):
    dev = _pool([(10, 11), (12, 13), (14, 15), (16, 17)])
    df, num_rounds = mc.document_frequency(dev)
    assert num_rounds == 4 * 6  # round 0 (the prompt) counts
    assert df[10] == pytest.approx(2 / 24) and df[50] == pytest.approx(8 / 24) and df[91] == pytest.approx(20 / 24)
    gate = mc.choose_gate(dev, 3, df, [0.2, 0.5, 1.0])
    cells = {(r["threshold"], r["read"], r["write_rule"]): r["passed"] for r in gate["grid"]}
    assert cells[(0.2, "exact", "overwrite")] == 4 and cells[(0.5, "exact", "overwrite")] == 0
    assert gate["chosen"] == {"exact": 0.2, "nearest": 0.2}
    # scored on a world whose names the dev worlds never saw: kept (frequency 0), so it passes
    held = _pool([(20, 21)])
    assert mc.score_pool(held, mc.make_pool_key_fn(3, df, gate["chosen"]["exact"]))["passed"] == 1


# The novelty-scored pool: thought (40-42, with the name) then <tool_call> (99) and the command; a distractor
# round (70) between the writes (`keygen` 50) and the readbacks (`cat` 60), which differ only in the name.
TC = 99
NOVEL = [([40, 10, TC, 50, 10], [7, 8]), ([40, 11, TC, 50, 11], [5, 6]), ([41, TC, 70], [3]),
         ([42, 10, TC, 60, 10], [7, 8]), ([42, 11, TC, 60, 11], [5, 6])]
NOVEL_READBACKS = [{"round": 4}, {"round": 5}]


def test_novel_sets(mc):
    ids, kinds, rounds = world(NOVEL)
    prev = mc.novel_sets(ids, kinds, rounds, TC, lookback=1)
    assert prev[0] == frozenset() and prev[1] == {TC, 50, 10}  # the prompt has no action tokens
    assert prev[2] == {11} and prev[3] == {70} and prev[4] == {60, 10} and prev[5] == {11}
    # against every earlier round the readbacks' names are never novel: the writes used them
    every = mc.novel_sets(ids, kinds, rounds, TC)
    assert every[4] == {60} and every[5] == frozenset()
    # the round's action tokens (the thought too) instead of the command
    assert mc.novel_sets(ids, kinds, rounds, None, lookback=1)[4] == {42, 10, 60}
    key_of = mc.make_novel_key_fn(3, TC, 1, {10: 0.01, 11: 0.01, 60: 0.3, TC: 0.9}, 0.1)(ids, kinds, rounds)
    p = [i for i, r in enumerate(rounds) if r == 4 and kinds[i] == O][0]
    assert key_of(p) == (tuple(HEADER), frozenset({10}))  # the verb gated out as frequent


def test_novelty_pool_passes_where_todays_key_fails(mc):
    ids, kinds, rounds = world(NOVEL)
    assert not mc.simulate_world(ids, kinds, rounds, NOVEL_READBACKS, mc.make_key_fn(3))["passed"]
    near = mc.simulate_world(ids, kinds, rounds, NOVEL_READBACKS, mc.make_novel_key_fn(3, TC, 1), nearest=True)
    assert near["passed"] and [r["exact"] for r in near["readbacks"]] == [True, True]
    # read exactly, round 4's set {cat, name} is not its write's {<tool_call>, keygen, name}
    exact = mc.simulate_world(ids, kinds, rounds, NOVEL_READBACKS, mc.make_novel_key_fn(3, TC, 1))
    assert [r["exact"] for r in exact["readbacks"]] == [False, True]
    # novel against every earlier round, neither readback's set holds its name ({cat}, then nothing): they
    # overlap no write and tie to the latest one (the distractor's, then round 4's)
    every = mc.simulate_world(ids, kinds, rounds, NOVEL_READBACKS, mc.make_novel_key_fn(3, TC), nearest=True)
    assert [r["exact"] for r in every["readbacks"]] == [False, False]
