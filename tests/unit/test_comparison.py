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


def _row(worlds, mem, model="ttt_current", policy="current_round", mode="ttt", multi=(0, 24)):
    r = {"model": model, "train_policy": policy, "mode": mode, "worlds_128_count": list(worlds),
         "worlds_128": worlds[0] / worlds[1], "memory_action_em_count": list(mem),
         "memory_diagnostics": {"memory_worlds_train_pool": {"multi_key_passed": list(multi)}}}
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


@pytest.mark.parametrize("multi,met", [((12, 24), True), ((11, 24), False), ((0, 0), False)])
def test_training_pool_target_counts_the_worlds_with_two_keys_or_more(multi, met):
    t = comparison.targets({"rows": [_row((70, 128), (60, 100), multi=multi)], "paired_differences": []})
    assert t["train_pool_multi_key_worlds"]["met"] is met and t["train_pool_multi_key_worlds"]["value"] == list(multi)


def test_recovery_target_needs_the_whole_interval_below_zero():
    pairs = [{"a": "ttt_full", "b": "sft_full", "metric": "recovery_nll", "diff": -0.05, "lo": -0.1, "hi": 0.01},
             {"a": "sft_full", "b": "ttt_full", "metric": "action_nll", "diff": 0.02, "lo": 0.01, "hi": 0.03}]
    t = comparison.targets({"rows": [], "paired_differences": pairs})
    assert not t["ttt_full_vs_sft_full_recovery_nll"]["met"]
    a = t["ttt_full_vs_sft_full_action_nll"]
    assert a["met"] and a["value"] == pytest.approx(-0.02) and a["interval"] == pytest.approx([-0.03, -0.01])


def _tiny_ttt(context_policy: str):
    import torch

    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    return TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=1, context_policy=context_policy)).eval()


@pytest.fixture(scope="module")
def two_worlds():
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.render import render_trajectory
    from ds_ttt.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    worlds = [generate_memory_world(MEMORY_SPLITS["dev"] + i, num_distractors=1) for i in range(2)]
    return tok, worlds, [render_trajectory(w, tok) for w in worlds]


def test_copy_check_scores_a_current_round_model_with_full_context_and_restores_its_policy(two_worlds):
    from ds_ttt.evaluation.runner import evaluate_trajectory

    tok, _, rendered = two_worlds
    model, twin = _tiny_ttt("current_round"), _tiny_ttt("full")
    twin.load_state_dict(model.state_dict())
    for mode in ("ttt", "frozen"):
        got = comparison._score_full_context(model, tok, rendered, mode, progress=False)
        want = [evaluate_trajectory(twin, r, mode, tokenizer=tok)[0] for r in rendered]
        own = [evaluate_trajectory(model, r, mode, tokenizer=tok)[0] for r in rendered]
        nll = lambda rows: [[m.obs_nll_sum for m in w] for w in rows]  # noqa: E731
        assert nll(got) == nll(want)  # exactly the model built with full context
        assert nll(got) != nll(own)  # and not what its own policy (current round) sees
        assert model.ttt.context_policy == "current_round" and model.policy.kind == "current_round"


@pytest.mark.parametrize("policy", ["current_round", "full"])
def test_every_mode_gets_a_copy_check_over_the_worlds_readbacks(two_worlds, policy, monkeypatch):
    from ds_ttt.evaluation.metrics import RoundMetrics

    tok, worlds, _ = two_worlds
    full_calls = []

    def all_readbacks_exact(model, tokenizer, rendered, run_mode, *, progress):
        full_calls.append(run_mode)
        return [[RoundMetrics(round=rb["round"], obs_exact=True) for rb in w["meta"]["readbacks"]] for w in worlds]

    monkeypatch.setattr(comparison, "_score_full_context", all_readbacks_exact)
    monkeypatch.setattr(comparison, "summarize_mode", lambda per_set, sets: {})
    sets = {"memory_worlds": worlds, "memory_worlds_train_pool": [], "memory_episodes": [], "recovery_episodes": []}
    out = comparison.score_model(_tiny_ttt(policy), tok, sets, progress=False)
    num = sum(len(w["meta"]["readbacks"]) for w in worlds)
    assert set(out) == {"ttt", "frozen"}
    if policy == "current_round":  # scored again with full context: the patched scorer's readbacks
        assert full_calls == ["ttt", "frozen"]
        assert [out[m]["copy_check_count"] for m in out] == [[num, num]] * 2
    else:  # a full-context model's own readbacks are the copy check (a random tiny model copies nothing)
        assert full_calls == []
        assert [out[m]["copy_check_count"] for m in out] == [[0, num]] * 2


def test_a_round_address_model_has_no_full_context_copy_check(two_worlds, monkeypatch):
    import torch

    from ds_ttt.config import TTTConfig
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    tok, worlds, _ = two_worlds
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=1, context_policy="current_round",
                                               round_address=True)).eval()
    monkeypatch.setattr(comparison, "summarize_mode", lambda per_set, sets: {})
    monkeypatch.setattr(comparison, "_score_full_context", lambda *a, **k: pytest.fail("no full-context twin exists"))
    sets = {"memory_worlds": worlds, "memory_worlds_train_pool": [], "memory_episodes": [], "recovery_episodes": []}
    out = comparison.score_model(model, tok, sets, progress=False)
    for mode in ("ttt", "frozen"):
        assert out[mode]["copy_check_count"] == [0, 0] and out[mode]["copy_check"] is None
        assert "round address" in out[mode]["copy_check_note"]
