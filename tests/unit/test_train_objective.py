"""The token-weighted outer objective (ds_ttt/train/objective.py): the host-side token counts equal the
event loop's own counts (padding, observation-end labels, rounds without observations), and the
micro-batch losses add up to the whole batch's token means.

    python -m pytest tests/unit/test_train_objective.py
"""

from __future__ import annotations

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.train.data_loader import collate
from ds_ttt.train.objective import StepObjective, count_loss_tokens


def trajectory(seed: int, num_rounds: int, num_action: int, end_obs: bool):
    """Rounds of header, action, header, observation (+ closing header); the last round may end on an
    observation (no closing token) to cover the end-of-row case."""
    g = torch.Generator().manual_seed(seed)
    kinds, rounds = [0, 0, 0], [0, 0, 0]
    for r in range(1, num_rounds + 1):
        body = [0] + [1] * num_action + [0] + [2] * (2 + r)
        if r < num_rounds or not end_obs:
            body.append(0)
        kinds += body
        rounds += [r] * len(body)
    return torch.randint(0, 64, (len(kinds),), generator=g).tolist(), kinds, rounds


@pytest.mark.parametrize("with_end", [False, True])
def test_host_counts_equal_the_event_loops(with_end):
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, vocab_size=64)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=1, obs_loss_with_end=with_end))
    rows = [trajectory(0, 1, 1, False), trajectory(1, 4, 7, True), trajectory(2, 2, 3, False)]
    ids, kinds, rounds = collate(rows, bucket=16, capacity=4096)  # right padding
    assert int((kinds < 0).sum()) > 0
    with torch.no_grad():
        out = model.trajectory_loss(ids, kinds, rounds, update=False)
    assert count_loss_tokens(kinds, rounds, obs_loss_with_end=with_end) == (out.num_action_tokens, out.num_obs_tokens)


def test_step_objective_scales_for_deepspeed_averaging():
    ids, kinds, rounds = collate([trajectory(0, 2, 5, False)], bucket=1, capacity=4096)
    ttt = TTTConfig(obs_loss_weight=0.5)
    obj = StepObjective.for_step([(ids, kinds, rounds), (ids, kinds, rounds)], ttt, loss_scale=8.0)
    n_act, n_obs = count_loss_tokens(kinds, rounds, obs_loss_with_end=False)
    assert (obj.num_action_tokens, obj.num_obs_tokens) == (2 * n_act, 2 * n_obs) == (20, 14)
    a, o = torch.tensor(10.0), torch.tensor(7.0)
    torch.testing.assert_close(obj.micro_batch_loss(a, o), torch.tensor(8.0 * (10.0 / 20 + 0.5 * 7.0 / 14)))
    no_obs = StepObjective.for_step([(ids, kinds, rounds)], TTTConfig(), loss_scale=1.0)
    torch.testing.assert_close(no_obs.step_loss(a, o), torch.tensor(1.0))  # weight 0: the obs term is absent
