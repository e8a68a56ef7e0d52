"""The trainer's memory pre-flight (ds_ttt/train/memory_budget.py): its exact parts against the real
model and event loop, the refusal and the fix it names, and the trainer's call.

Run: .venv/bin/python -m pytest tests/unit/test_memory_budget.py
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model import event_checkpoint
from ds_ttt.model.presets import qwen3_8b_config, tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.train import engine, memory_budget
from ds_ttt.train.memory_budget import GIB, Layout, data_shape, estimate, layout_of, preflight


def _cfg():
    return tiny_qwen3_config(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, vocab_size=96)


@pytest.mark.parametrize("tied", [False, True])
def test_weights_are_the_models_parameters(tied):
    cfg = dataclasses.replace(_cfg()) if not tied else tiny_qwen3_config(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=96, tie_word_embeddings=True)
    ttt = TTTConfig(adaptive_layers=2, prime_intermediate_size=48)
    model = TTTQwen3ForCausalLM(cfg, ttt)
    one_stage = sum(p.numel() for p in model.parameters()) * 2
    assert estimate(cfg, ttt, tokens=64, layout=Layout(1, 1)).parts_gib["weights"] * GIB == one_stage
    last = [*model.adaptive_layers, model.model.norm, model.lm_head]
    last_stage = sum(p.numel() for m in last for p in m.parameters()) * 2
    assert estimate(cfg, ttt, tokens=64, layout=Layout(2, 1)).parts_gib["weights"] * GIB == last_stage


def test_trainable_state_follows_the_scope_the_dp_ranks_and_offload():
    cfg, ttt = _cfg(), TTTConfig(adaptive_layers=2)
    model = TTTQwen3ForCausalLM(cfg, ttt)
    model.set_trainable_scope()
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = lambda lay: estimate(cfg, ttt, tokens=64, layout=lay).parts_gib["trainable_state"] * GIB  # noqa: E731
    assert state(Layout(1, 1)) == n * (2 + 16)
    assert state(Layout(1, 4)) == n * (2 + 16 / 4)
    assert state(Layout(1, 4, offload_optimizer=True)) == n * 2


def test_update_store_bounds_what_the_event_loop_stores(monkeypatch):
    """The estimate's stored updates are an upper bound of what a real checkpointed step stores (bf16),
    and a tight one: rounds of equal length, with the prompt the only event without an update."""
    chains = []
    real = event_checkpoint.FastWeightChain.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        chains.append(self)
    monkeypatch.setattr(event_checkpoint.FastWeightChain, "__init__", spy)
    cfg = _cfg()
    ttt = TTTConfig(adaptive_layers=2, fast_matrices="all", checkpoint_events=True)
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, ttt).to(torch.bfloat16)
    model.set_trainable_scope()
    n, events = 40, 5  # 40 tokens x (64 + 128) < 64 x 128: factors
    kinds = [0] * n + ([0, 0] + [1] * 10 + [0] + [2] * (n - 14) + [0]) * events
    rounds = [r for r in range(events + 1) for _ in range(n)]
    ids = torch.randint(0, cfg.vocab_size, (1, len(kinds)))
    model.trajectory_loss(ids, torch.tensor([kinds]), torch.tensor([rounds]), create_graph=True)
    (chain,) = chains
    stored = chain.stored_bytes() - 2 * 3 * events  # less the 1-byte skip flags
    bound = estimate(cfg, ttt, tokens=len(kinds), round_tokens=n).parts_gib["update_store"] * GIB
    assert stored <= bound <= stored * (events + 1) / events


def test_fast_matrices_down_and_longer_context_change_the_estimate_as_the_code_does():
    cfg = qwen3_8b_config()
    down, all_ = TTTConfig(adaptive_layers=9, fast_matrices="down"), TTTConfig(adaptive_layers=9)
    e_down, e_all = (estimate(cfg, t, tokens=32768, round_tokens=1028) for t in (down, all_))
    assert e_all.parts_gib["fast_work"] == pytest.approx(3 * e_down.parts_gib["fast_work"])
    # factors: 32K tokens x (4096 + 12288) per matrix and layer, bf16 (1,028-token rounds < 3,072)
    assert e_down.parts_gib["update_store"] * GIB == 9 * 32768 * (4096 + 12288) * 2
    longer = estimate(cfg, down, tokens=65536, round_tokens=1028)
    assert longer.parts_gib["update_store"] == pytest.approx(2 * e_down.parts_gib["update_store"])
    assert longer.parts_gib["event_activations"] == e_down.parts_gib["event_activations"]


def test_preflight_refuses_naming_the_context_the_estimate_and_a_fix_that_fits():
    cfg, ttt = qwen3_8b_config(), TTTConfig(adaptive_layers=9, fast_matrices="down")
    est, refusal = preflight(cfg, ttt, tokens=65536, round_tokens=1028, layout=Layout(1, 4), device_bytes=None, world=4)
    assert refusal is None and est.total_gib > 0  # a CPU rank: reported, never refused
    est, refusal = preflight(cfg, ttt, tokens=65536, round_tokens=1028, layout=Layout(1, 4),
                             device_bytes=80 * GIB, world=4)
    assert refusal is None, refusal
    est, refusal = preflight(cfg, ttt, tokens=65536, round_tokens=1028, layout=Layout(1, 1),
                             device_bytes=80 * GIB, world=1)
    assert refusal is not None
    assert "65536 tokens" in refusal and f"{est.total_gib:.1f} GiB" in refusal and "Use " in refusal
    # every fix it names fits by the same estimate: the layout and the context it proposes
    assert "PP1xDP1 ZeRO-1 + optimizer offload" in refusal and "--capacity" in refusal
    usable = 80 * 0.975
    assert estimate(cfg, ttt, tokens=65536, round_tokens=1028,
                    layout=Layout(1, 1, offload_optimizer=True)).total_gib <= usable
    t = int(refusal.split("a context of ")[2].split(" tokens")[0])
    assert estimate(cfg, ttt, tokens=t, round_tokens=1028, layout=Layout(1, 1)).total_gib <= usable
    _, refusal = preflight(cfg, ttt, tokens=65536, round_tokens=1028, layout=Layout(1, 1), device_bytes=20 * GIB,
                           world=1)
    assert "nothing this estimate knows fits" in refusal


def test_data_shape_and_layout_of():
    samples = [types.SimpleNamespace(rounds=[0, 0, 0, 1, 1, 2]), types.SimpleNamespace(rounds=[0, 1, 1, 1, 1])]
    assert data_shape(samples) == (6, 4)
    ds = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    assert layout_of(ds, 2, 4) == Layout(stages=2, dp=4, zero_stage=1, offload_optimizer=True)
    assert layout_of({"zero_optimization": {"stage": 1}}, 1, 8).offload_optimizer is False


def test_trainer_preflight_refuses_before_building_when_told_the_device(monkeypatch, capsys):
    """The trainer's call: reports on CPU ranks; with DS_TTT_PREFLIGHT_DEVICE_GIB it plans for that
    device and refuses with the message (ValueError) before anything is built."""
    monkeypatch.setattr(engine, "broadcast_from_rank0", lambda obj: obj)
    run = types.SimpleNamespace(ttt=TTTConfig(adaptive_layers=9, fast_matrices="down"))
    layout = types.SimpleNamespace(num_stages=1)
    samples = [types.SimpleNamespace(rounds=[r for r in range(32) for _ in range(1024)])]
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}
    engine.memory_preflight(run, ds, qwen3_8b_config(), layout, 4, samples, rank=0, device="cpu")
    out = capsys.readouterr().out
    assert "memory pre-flight: longest trajectory 32768 tokens, longest round 1024" in out
    assert "CPU ranks: reported, not enforced" in out
    monkeypatch.setenv(engine.PREFLIGHT_DEVICE_GIB, "24")
    with pytest.raises(ValueError, match=r"memory pre-flight: a context of 32768 tokens .* GiB usable of this "
                                         r"device's 24.0 GiB"):
        engine.memory_preflight(run, ds, qwen3_8b_config(), layout, 4, samples, rank=0, device="cpu")
