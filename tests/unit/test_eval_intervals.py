"""Wilson and bootstrap intervals of the evaluation reports.  python -m pytest tests/unit/test_eval_intervals.py"""

from __future__ import annotations

import numpy as np
import pytest

from ds_ttt.evaluation.intervals import bootstrap_ratio_interval, wilson_interval


def test_wilson_matches_published_values():
    # Newcombe (1998), Table I: 81/263 -> 0.2553..0.3662; 15/148 -> 0.0624..0.1605; 0/10 -> 0..0.2775; 10/10 -> 0.7225..1
    lo, hi = wilson_interval(81, 263)
    assert lo == pytest.approx(0.2553, abs=1e-4) and hi == pytest.approx(0.3662, abs=1e-4)
    lo, hi = wilson_interval(15, 148)
    assert lo == pytest.approx(0.0624, abs=1e-4) and hi == pytest.approx(0.1605, abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(10, 10)
    assert lo == pytest.approx(0.7225, abs=1e-4) and hi == pytest.approx(1.0)
    assert wilson_interval(0, 0) == (None, None)
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(3, 2)


def test_wilson_coverage_is_near_95_percent():
    rng = np.random.default_rng(1)
    p, n = 0.15, 40
    hits = 0
    for k in rng.binomial(n, p, size=4000):
        lo, hi = wilson_interval(int(k), n)
        hits += lo <= p <= hi
    assert 0.93 <= hits / 4000 <= 0.97


def test_bootstrap_interval_covers_the_ratio_and_shrinks_with_more_units():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, size=400).astype(float)
    nll = tokens * rng.gamma(2.0, 0.5, size=400)
    point = nll.sum() / tokens.sum()
    lo, hi = bootstrap_ratio_interval(nll, tokens)
    assert lo < point < hi
    lo_small, hi_small = bootstrap_ratio_interval(nll[:40], tokens[:40])
    assert hi_small - lo_small > 1.5 * (hi - lo)
    assert bootstrap_ratio_interval([], []) == (None, None)
    assert bootstrap_ratio_interval(nll, tokens) == (lo, hi)  # seeded: reproducible


def test_summaries_carry_intervals_around_their_point_values():
    from ds_ttt.evaluation.metrics import RoundMetrics, summarize
    rounds = [RoundMetrics(round=i % 5 + 1, action_tokens=10 + i, action_nll_sum=0.5 * (10 + i) * (1 + i % 3),
                           action_exact=i % 4 == 0, memory_check=i % 2 == 0, recovery=i % 3 == 0)
              for i in range(60)]
    s = summarize(rounds)
    for name in ("action_exact", "memory_action_exact", "action_nll", "memory_action_nll", "recovery_action_nll"):
        assert s[f"{name}_lo"] <= s[name] <= s[f"{name}_hi"], name
    assert (s["action_exact_lo"], s["action_exact_hi"]) == wilson_interval(*s["action_exact_count"])
    assert s["obs_exact_lo"] is None  # no observation rounds: no interval
