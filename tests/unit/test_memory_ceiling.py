"""benchmarks/memory_ceiling.py: the ideal-memory simulation on hand-built token sequences and 2 real worlds."""

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
