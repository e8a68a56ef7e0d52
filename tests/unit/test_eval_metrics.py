"""Evaluation metrics on hand-built records whose answers are known, and ttt vs frozen on a tiny model
(independently recomputed from plain logits; W adapts in a copy, the model is untouched).
Run: python -m pytest tests/unit/test_eval_metrics.py
"""

from __future__ import annotations

import math

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.data.render import RenderedTrajectory
from ds_ttt.evaluation.metrics import RoundMetrics, fact_exact, observation_end_positions, round_metrics, summarize
from ds_ttt.evaluation.runner import evaluate_model, set_context_policy
from ds_ttt.model.event_loop import EventRecord
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is faster and fair to the other jobs
    yield
    torch.set_num_threads(n)


class CharTokenizer:
    """decode(ids) = the characters chr(id): lets a test spell actions by hand."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def record(round_id, kinds, labels, argmax, nll, after=None, updated=False):
    t = torch.tensor
    return EventRecord(round=round_id, label_positions=t(list(range(len(kinds)))), labels=t(labels),
                       label_kinds=t(kinds), token_nll=t(nll, dtype=torch.float32), argmax=t(argmax),
                       obs_nll_after=None if after is None else t(after, dtype=torch.float32),
                       updated=updated, skipped=False)


def test_hand_built_round_known_answers():
    # labels:  ctx  a    c    t    ctx  o    o    END  ctx
    kinds = [0, 1, 1, 1, 0, 2, 2, 0, 0]
    labels = [5, 97, 98, 49, 6, 120, 121, 7, 8]
    argmax = [9, 97, 98, 49, 6, 120, 121, 3, 8]  # context miss (ignored), the observation's end token wrong
    nll = [9.0, 0.5, 1.0, 1.5, 9.0, 2.0, 4.0, 9.0, 9.0]
    m = round_metrics(record(2, kinds, labels, argmax, nll, after=[1.0, 2.0], updated=True),
                      memory_checks=[{"round": 2, "fact": "b1", "source_round": 1}, {"round": 3, "fact": "zz"}],
                      tokenizer=CharTokenizer())
    assert (m.action_tokens, m.action_correct, m.action_exact) == (3, 3, True)
    assert m.action_nll == pytest.approx(1.0)
    assert (m.obs_tokens, m.obs_nll, m.obs_nll_after) == (2, pytest.approx(3.0), pytest.approx(1.5))
    assert m.obs_exact is False  # every observation token right, but not the token that closes it
    assert m.memory == [{"fact": "b1", "source_round": 1, "exact": True}]  # only this round's check

    argmax2 = [5, 97, 0, 49, 6, 120, 121, 7, 8]  # one action token wrong (the 'b' of the fact)
    m2 = round_metrics(record(2, kinds, labels, argmax2, nll), memory_checks=[{"round": 2, "fact": "b1"}],
                       tokenizer=CharTokenizer())
    assert (m2.action_exact, m2.action_correct, m2.obs_exact, m2.obs_nll_after) == (False, 2, True, None)
    assert m2.memory[0]["exact"] is False

    s = summarize([m, m2])
    assert s["action_nll"] == pytest.approx(1.0) and s["action_token_acc"] == pytest.approx(5 / 6)
    assert s["action_exact_count"] == [1, 2] and s["obs_exact_count"] == [1, 2]
    assert s["obs_nll_after"] == pytest.approx(1.5) and s["obs_nll_before_updated"] == pytest.approx(3.0)
    assert s["memory_fact_count"] == [1, 2] and s["num_updates"] == 1


def test_memory_check_and_recovery_rounds_flags_and_summary():
    kinds, labels = [1, 1, 2], [97, 98, 120]
    rec = record(3, kinds, labels, labels, [1.0, 1.0, 1.0])
    m = round_metrics(rec, memory_checks=[{"round": 3, "fact": "a"}, {"round": 3, "fact": "b"}], recovery_rounds=[5])
    assert (m.memory_check, m.recovery) == (True, False)
    m = round_metrics(rec, memory_checks=[{"round": 2, "fact": "a"}], recovery_rounds=[3, 5])
    assert (m.memory_check, m.recovery) == (False, True)

    rounds = [  # hand-built: two memory-check rounds (one exact), two recovery rounds, one plain round
        RoundMetrics(round=1, action_tokens=4, action_nll_sum=8.0, action_correct=4, action_exact=True),
        RoundMetrics(round=2, action_tokens=2, action_nll_sum=1.0, action_correct=2, action_exact=True,
                     memory_check=True),
        RoundMetrics(round=3, action_tokens=6, action_nll_sum=9.0, action_correct=5, action_exact=False,
                     memory_check=True),
        RoundMetrics(round=4, action_tokens=3, action_nll_sum=6.0, action_correct=3, action_exact=True, recovery=True),
        RoundMetrics(round=5, action_tokens=1, action_nll_sum=4.0, action_correct=0, action_exact=False, recovery=True),
    ]
    s = summarize(rounds)
    assert s["memory_action_exact"] == pytest.approx(0.5) and s["memory_action_exact_count"] == [1, 2]
    assert s["memory_action_nll"] == pytest.approx(10.0 / 8)  # token-weighted, not the mean of round means
    assert s["recovery_action_nll"] == pytest.approx(10.0 / 4)
    assert (s["recovery_action_tokens"], s["recovery_rounds"]) == (4, 2)
    assert s["action_exact_count"] == [3, 5] and s["action_nll"] == pytest.approx(28.0 / 16)  # unchanged keys
    empty = summarize(rounds[:1])
    assert empty["memory_action_exact"] is None and empty["memory_action_exact_count"] == [0, 0]
    assert empty["memory_action_nll"] is None and empty["recovery_action_nll"] is None
    assert (empty["recovery_action_tokens"], empty["recovery_rounds"]) == (0, 0)


def test_observation_end_positions_and_fact_search():
    mask = torch.tensor([False, True, True, False, True, False, True])
    assert observation_end_positions(mask) == [3, 5]  # the last span runs to the round's end: no end token
    tok = CharTokenizer()
    ids = [ord(c) for c in "port 4242 then 4242"]
    correct = [True] * len(ids)
    correct[-1] = False  # the second occurrence is wrong; the first (the recall) decides
    assert fact_exact(tok, ids, correct, "4242") is True
    correct[6] = False
    assert fact_exact(tok, ids, correct, "4242") is False
    assert fact_exact(tok, ids, correct, "9999") is None


def tiny_trajectory(vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0, 0]
    kinds = [0] * 6 + rnd * 3
    rounds = [0] * 6 + [r for r in (1, 2, 3) for _ in rnd]
    ids = torch.randint(0, vocab, (len(kinds),), generator=g).tolist()
    return RenderedTrajectory("t0", ids, kinds, rounds, {"family": "memory"})


def test_frozen_mode_equals_plain_logits_and_ttt_adapts_in_a_copy(tiny_qwen3_config):
    model = TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig(context_policy="current_round"))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    traj = tiny_trajectory()
    res = evaluate_model(model, [traj], progress=False)

    # frozen, recomputed independently from whole-sequence logits under the same context policy
    ids, kinds, rounds = (torch.tensor([x]) for x in (traj.input_ids, traj.kinds, traj.rounds))
    with torch.no_grad():
        logits = model(ids, rounds)[0, :-1]
    labels, lk = ids[0, 1:], kinds[0, 1:]
    nll = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    act = lk == 1
    frozen = res["summary"]["frozen"]
    assert frozen["action_nll"] == pytest.approx(float(nll[act].mean()), rel=1e-5)
    assert frozen["action_token_acc"] == pytest.approx(float((logits.argmax(-1) == labels)[act].float().mean()))
    assert frozen["obs_nll"] == pytest.approx(float(nll[lk == 2].mean()), rel=1e-5)
    assert frozen["obs_nll_after"] is None and frozen["num_updates"] == 0

    ttt = res["summary"]["ttt"]
    assert ttt["num_updates"] == 3 and ttt["obs_nll_after"] is not None
    # round 1 is scored with W_0 in both modes; later rounds differ only through the adapted W
    r1 = {m: res["per_round"][m][0] for m in ("ttt", "frozen")}
    assert r1["ttt"]["action_nll"] == pytest.approx(r1["frozen"]["action_nll"], rel=1e-6)
    assert res["per_round"]["ttt"][2]["action_nll"] != pytest.approx(res["per_round"]["frozen"][2]["action_nll"], rel=1e-6)
    # the inner step lowers the loss of the observation it learned from
    assert ttt["obs_nll_after"] < ttt["obs_nll_before_updated"]
    for n, p in model.state_dict().items():  # nothing written back
        assert torch.equal(p, before[n]), n
    row = res["trajectories"][0]
    assert [r["round"] for r in row["ttt"]["rounds"]] == [1, 2, 3] and row["family"] == "memory"
    assert all(math.isfinite(r["action_nll"]) for r in row["frozen"]["rounds"])


def test_context_policy_override_equals_a_model_configured_with_it(tiny_qwen3_config):
    trained = TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig(context_policy="current_round"))
    with torch.no_grad():
        for layer in trained.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    full = TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig(context_policy="full"))
    full.load_state_dict(trained.state_dict())
    trajs = [tiny_trajectory(seed=1)]
    res_cur = evaluate_model(trained, trajs, progress=False)

    assert set_context_policy(trained, "full") == "current_round"
    assert trained.ttt == full.ttt and trained.policy == full.policy
    res_over, res_full = evaluate_model(trained, trajs, progress=False), evaluate_model(full, trajs, progress=False)
    for m in ("ttt", "frozen"):
        assert res_over["summary"][m] == res_full["summary"][m]
        assert res_over["per_round"][m] == res_full["per_round"][m]
    # the override matters: under it attention sees earlier rounds, which current_round hides
    frozen_nll = res_cur["summary"]["frozen"]["action_nll"]
    assert res_over["summary"]["frozen"]["action_nll"] != pytest.approx(frozen_nll, rel=1e-6)
    set_context_policy(trained, "window", window=5)
    assert (trained.ttt.context_policy, trained.ttt.window, trained.policy.window) == ("window", 5, 5)
    with pytest.raises(ValueError, match="window"):
        set_context_policy(trained, "full", window=3)
    with pytest.raises(ValueError, match="context_policy"):
        set_context_policy(full, "everything")
