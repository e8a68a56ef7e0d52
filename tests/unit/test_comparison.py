"""The fair comparison's pieces: paired NLL differences, held-out sets that exclude training prompts,
dev/test seeds apart, and targets that cannot be met by a small or missing measurement.
Run: python -m pytest tests/unit/test_comparison.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds_ttt.evaluation import comparison
from ds_ttt.evaluation.memory import MEMORY_SPLITS


def test_paired_difference_is_the_ratio_difference_and_pairs_the_episodes():
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 40, size=60).astype(float)
    a = [(t * 1.0 + rng.normal(0, 2), t) for t in tokens]
    b = [(x + t * 0.05 + rng.normal(0, 0.1), t) for (x, _), t in zip(a, tokens)]  # b = a + 0.05/token, small noise
    d = comparison.paired_nll_difference(a, b)
    assert d["diff"] == pytest.approx(sum(x for x, _ in a) / tokens.sum() - sum(x for x, _ in b) / tokens.sum())
    assert d["lo"] < d["diff"] < d["hi"] and d["hi"] < 0 and d["excludes_zero"]
    # unpaired resampling of the same data would be far wider: pairing is what makes 0.05 detectable
    assert d["hi"] - d["lo"] < 0.02
    with pytest.raises(ValueError, match="same episodes"):
        comparison.paired_nll_difference(a, b[:-1] + [(1.0, 99.0)])


def test_fresh_episodes_never_reuse_a_training_prompt():
    from ds_ttt.data.generator import generate

    train = generate(30, seed=5, family="error_recovery")
    train_prompts = {comparison._prompt(t) for t in train}
    kept, generated = comparison.fresh_episodes("error_recovery", 5, train_prompts, min_units=5,
                                                units_of=lambda t: len(t["meta"].get("recovery_rounds") or []))
    prompts = [comparison._prompt(t) for t in kept]
    assert not set(prompts) & train_prompts
    bodies = [json.dumps(t["messages"], sort_keys=True) for t in kept]
    assert len(set(bodies)) == len(bodies)  # prompts may repeat among held-out episodes, worlds never
    assert sum(len(t["meta"]["recovery_rounds"]) for t in kept) >= 5 and generated > len(kept)


def test_dev_and_test_seeds_are_apart():
    assert MEMORY_SPLITS["dev"] != MEMORY_SPLITS["test"]
    assert abs(MEMORY_SPLITS["dev"] - MEMORY_SPLITS["test"]) >= 1_000_000
    assert comparison.EPISODE_SEEDS["dev"] != comparison.EPISODE_SEEDS["test"]


def _row(worlds, mem, model="ttt_current", policy="current_round", mode="ttt"):
    r = {"model": model, "train_policy": policy, "mode": mode, "worlds_128_count": list(worlds),
         "worlds_128": worlds[0] / worlds[1], "memory_action_em_count": list(mem)}
    from ds_ttt.evaluation.intervals import wilson_interval
    r["worlds_128_lo"], r["worlds_128_hi"] = wilson_interval(*worlds)
    return r


@pytest.mark.parametrize("worlds,mem,met", [((70, 128), (60, 100), (True, True)),
                                            ((63, 128), (50, 100), (False, True)),   # just under 50%
                                            ((20, 32), (50, 99), (False, False)),    # too few worlds / rounds
                                            ((128, 128), (49, 100), (True, False))])
def test_targets_are_never_met_by_small_samples(worlds, mem, met):
    t = comparison.targets({"rows": [_row(worlds, mem)], "paired_differences": []})
    assert (t["worlds_128"]["met"], t["memory_action_em"]["met"]) == met
    assert "ttt_full_vs_sft_full_recovery_nll" not in t  # no such pair measured: not decided


def test_recovery_target_needs_the_whole_interval_below_zero():
    pairs = [{"a": "ttt_full", "b": "sft_full", "metric": "recovery_nll", "diff": -0.05, "lo": -0.1, "hi": 0.01},
             {"a": "sft_full", "b": "ttt_full", "metric": "action_nll", "diff": 0.02, "lo": 0.01, "hi": 0.03}]
    t = comparison.targets({"rows": [], "paired_differences": pairs})
    assert not t["ttt_full_vs_sft_full_recovery_nll"]["met"]
    a = t["ttt_full_vs_sft_full_action_nll"]
    assert a["met"] and a["value"] == pytest.approx(-0.02) and a["interval"] == pytest.approx([-0.03, -0.01])
