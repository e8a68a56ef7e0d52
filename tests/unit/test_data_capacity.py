"""Capacity: keep the valid prefix (first round too long, middle round too long, exact fit).

    .venv/bin/python -m pytest tests/unit/test_data_capacity.py -q
"""

import pytest

from ds_ttt.data.capacity import apply_capacity
from ds_ttt.data.render import RenderedTrajectory


def traj(lengths):
    """Round r gets lengths[r] tokens (round 0 = context)."""
    ids, kinds, rounds = [], [], []
    for r, n in enumerate(lengths):
        ids += list(range(n))
        kinds += [0] + [1] * (n - 1) if r else [0] * n
        rounds += [r] * n
    return RenderedTrajectory("t", ids, kinds, rounds, {})


def test_exact_fit_keeps_everything():
    rt = traj([10, 5, 5, 5])
    prefix, retained = apply_capacity(rt, 25)
    assert retained == 3 and prefix.input_ids == rt.input_ids and prefix.rounds == rt.rounds


def test_one_token_short_drops_last_round():
    prefix, retained = apply_capacity(traj([10, 5, 5, 5]), 24)
    assert retained == 2 and len(prefix) == 20 and max(prefix.rounds) == 2


def test_middle_round_too_long_drops_it_and_all_later():
    rt = traj([10, 5, 100, 5])
    prefix, retained = apply_capacity(rt, 50)
    assert retained == 1 and len(prefix) == 15 and prefix.meta["retained_rounds"] == 1 and prefix.meta["total_rounds"] == 3
    # later rounds never come back even though they would fit on their own
    assert 3 not in prefix.rounds


def test_first_round_too_long_drops_trajectory():
    assert apply_capacity(traj([10, 100, 5]), 50) == (None, 0)


def test_context_alone_too_long_drops_trajectory():
    assert apply_capacity(traj([60, 5]), 50) == (None, 0)


def test_no_text_truncation_prefix_is_whole_rounds():
    rt = traj([7, 3, 4, 9])
    for cap in range(1, 30):
        prefix, retained = apply_capacity(rt, cap)
        if prefix is None:
            continue
        n = len(prefix)
        assert prefix.input_ids == rt.input_ids[:n] and prefix.kinds == rt.kinds[:n]
        assert n == len(rt) or rt.rounds[n] == retained + 1  # cut exactly at a round boundary


def test_invalid_capacity():
    with pytest.raises(ValueError):
        apply_capacity(traj([1, 1]), 0)
