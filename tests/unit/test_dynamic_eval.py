"""Dynamic evaluation (ds_ttt/evaluation/dynamic_eval.py): the SFT model rewritten so its last layers' own
MLPs are fast weights computes exactly the SFT model with W_0, and with updates on takes the TTT recipe's
inner step on exactly those MLPs (only the down projections under fast_matrices="down").

Run: python -m pytest tests/unit/test_dynamic_eval.py
"""

from __future__ import annotations

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.data.render import render_trajectory
from ds_ttt.evaluation.dynamic_eval import dynamic_evaluation_model
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.serve.session import AgentModel, AgentSession

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sft_model():
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    return TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=0, trainable_scope="all",
                                              context_policy="current_round")).eval()


def test_with_w0_it_is_the_sft_model_and_updates_move_only_the_recipes_matrices():
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    sft = sft_model()
    before = {k: v.clone() for k, v in sft.state_dict().items()}
    recipe = TTTConfig(adaptive_layers=1, inner_lr=1.0, inner_max_norm=5.0, fast_matrices="down", key_shift=3)
    dyn = dynamic_evaluation_model(sft, inner=recipe)
    assert all(torch.equal(v, sft.state_dict()[k]) for k, v in before.items())  # the SFT model is untouched
    assert dyn.num_adaptive == 1 and dyn.ttt.inner_lr == 1.0 and dyn.ttt.key_shift == 0
    assert dyn.ttt.context_policy == "current_round"  # the SFT model's own policy

    r = render_trajectory(generate_memory_world(3, num_distractors=1), tok)
    ids, rounds = torch.tensor([r.input_ids]), torch.tensor([r.rounds])
    with torch.no_grad():
        assert torch.equal(dyn(ids, rounds), sft(ids, rounds))  # W_0: exactly the SFT model

    session = AgentSession(AgentModel(dyn, tok), max_new_tokens=8)
    session.reset("Count the lines of notes.txt.")
    session.act(force={"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "wc -l notes.txt"}'}}]})
    session.observe("3 notes.txt")
    w0, w1 = dyn.initial_fast_weights(), session.fast_weights
    assert session.num_updates == 1
    assert torch.equal(w1[0], w0[0]) and torch.equal(w1[1], w0[1])  # gate, up stay (fast_matrices="down")
    assert not torch.equal(w1[2], w0[2].to(w1[2].dtype))  # the layer's own down projection learned


def test_refuses_a_model_that_already_has_adaptive_layers():
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="without adaptive layers"):
        dynamic_evaluation_model(TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=1)), inner=TTTConfig())
    with pytest.raises(ValueError, match="nothing to update"):
        dynamic_evaluation_model(sft_model(), inner=TTTConfig(adaptive_layers=0))
