"""The main job's cheaper meta-training step, bit for bit: the frozen path's attention built once per
micro-batch (qwen3.FrozenPathAttention, shared by a stage's DecoderPipes), the CPU-only per-layer
reseed (pipeline.seed_cpu_rngs, chosen by pipeline.layer_seed_fn), and the frozen layers run without
DeepSpeed's activation checkpointing (ds_configs/cpu_tiny_pp1_dp2.json) with the same gradients.

    .venv/bin/python -m pytest -q tests/unit/test_step_cost_levers.py
"""

from __future__ import annotations

import json
import pathlib
import random

import numpy as np
import pytest
import torch
from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.utils import set_random_seed

from ds_ttt.config import TTTConfig
from ds_ttt.model.context import ContextPolicy
from ds_ttt.model.qwen3 import FrozenPathAttention, TTTQwen3ForCausalLM
from ds_ttt.train import pipeline
from ds_ttt.train.data_loader import collate
from ds_ttt.train.layout import resolve_layout
from ds_ttt.train.pipeline import DecoderPipe, EmbedPipe, TTTPipelineModule, build_specs

REPO = pathlib.Path(__file__).resolve().parents[2]
ROUND = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 0]


def batch(num_rounds: list[int], seed: int = 0):
    """A right-padded micro-batch of trajectories with `num_rounds[i]` rounds each."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in num_rounds:
        kinds = [0] * 5 + ROUND * n
        rounds = [0] * 5 + [r for r in range(1, n + 1) for _ in ROUND]
        rows.append((torch.randint(0, 256, (len(kinds),), generator=g).tolist(), kinds, rounds))
    return collate(rows, bucket=1, capacity=10_000)


def frozen_stage(cfg, ttt):
    """Spec 0 .. P (embedding and every frozen decoder layer) of a one-stage layout, built as a rank
    builds them, with the single-device model's weights."""
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, ttt)
    layout = resolve_layout(1, cfg.num_hidden_layers, ttt)
    layers = [spec.build() for spec in build_specs(cfg, ttt, layout)[:layout.first_adaptive + 1]]
    full = model.state_dict()
    for idx, layer in enumerate(layers):
        layer.load_state_dict({k: full[layout.hf_name(idx, k)] for k in layer.state_dict()})
    return layers


def count_masks(monkeypatch) -> list:
    calls = []
    mask = ContextPolicy.mask

    def counting(self, rounds_BT):
        calls.append(rounds_BT.shape)
        return mask(self, rounds_BT)
    monkeypatch.setattr(ContextPolicy, "mask", counting)
    return calls


def test_frozen_mask_is_built_once_per_micro_batch(tiny_qwen3_config, monkeypatch):
    """The stage's DecoderPipes share one FrozenPathAttention: one context-policy mask per micro-batch
    (before: one per frozen layer, 6 here), a new one for the next micro-batch, and hidden states equal
    bit for bit to layers that each build their own."""
    ttt = TTTConfig(adaptive_layers=2, context_policy="current_round")
    layers = frozen_stage(tiny_qwen3_config, ttt)
    decoders = [layer for layer in layers if isinstance(layer, DecoderPipe)]
    assert len(decoders) == 6 and len({id(d.frozen_attention) for d in decoders}) == 1
    calls = count_masks(monkeypatch)
    outs = []
    for i, micro in enumerate([batch([2, 3], seed=1), batch([3, 1], seed=2), batch([2, 3], seed=3)]):
        x = micro
        for layer in layers:
            x = layer(x)
        outs.append(x[0])
        assert len(calls) == i + 1  # each micro-batch's round ids differ from the last one's
    # the old behaviour: each layer its own FrozenPathAttention
    for d in decoders:
        d.frozen_attention = FrozenPathAttention()
    for micro, out in zip([batch([2, 3], seed=1), batch([3, 1], seed=2), batch([2, 3], seed=3)], outs):
        x = micro
        for layer in layers:
            x = layer(x)
        assert torch.equal(x[0], out)
    assert len(calls) == 3 + 3 * 6


def test_frozen_attention_rebuilds_for_other_round_ids_or_settings():
    """Reuse only for the same call: round ids equal in value (a tensor changed in place is another
    micro-batch), the same policy, scale and hidden dtype."""
    fa = FrozenPathAttention()
    policy = ContextPolicy.from_ttt(TTTConfig(context_policy="current_round"))
    rounds = torch.tensor([[0, 1, 1, 2, 2, 0]])
    h = torch.zeros(1, 6, 8)
    first = fa(policy, h, rounds, 0.25)
    assert fa(policy, h, rounds.clone(), 0.25) is first and fa.builds == 1
    rounds[0, 3] = 1  # in place: the same tensor object, other values
    assert fa(policy, h, rounds, 0.25) is not first and fa.builds == 2
    fa(policy, h, rounds, 0.5)
    fa(policy, h.double(), rounds, 0.5)
    fa(ContextPolicy.from_ttt(TTTConfig(context_policy="full")), h.double(), rounds, 0.5)
    fa(policy, h.double(), rounds[:, :5], 0.5)
    assert fa.builds == 6


@pytest.mark.parametrize("seed", [0, 7, 1234 * 5 + 3, 2**40 + 11, 2**63 + 5, 2**70 + 1])
def test_cpu_reseed_reproduces_deepspeeds_streams(seed):
    """seed_cpu_rngs leaves python, numpy and torch's CPU generator where DeepSpeed's set_random_seed
    (torch.manual_seed) leaves them, for DeepSpeed's seeds (base_seed * micro-batch + layer: they grow)."""
    def draws():
        return (random.random(), np.random.rand(4).tolist(), torch.rand(5), torch.randn(3, dtype=torch.float64),
                torch.get_rng_state())

    set_random_seed(seed)
    ref = draws()
    torch.rand(7), random.random(), np.random.rand(2)  # move every stream
    pipeline.seed_cpu_rngs(seed)
    got = draws()
    assert got[0] == ref[0] and got[1] == ref[1]
    for a, b in zip(got[2:], ref[2:]):
        assert torch.equal(a, b)


def test_layer_seed_fn_seeds_an_accelerator_where_there_is_one(monkeypatch):
    """With an accelerator the module keeps DeepSpeed's seeding (torch.manual_seed seeds its generators)."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert pipeline.layer_seed_fn() is set_random_seed
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert pipeline.layer_seed_fn() is pipeline.seed_cpu_rngs


def test_pipeline_module_reseeds_with_layer_seed_fn(tiny_qwen3_config, monkeypatch):
    """TTTPipelineModule hands DeepSpeed its seed_fn (before: none, so DeepSpeed's torch.manual_seed)."""
    seen = {}

    class Stop(Exception):
        pass

    def spy(self, **kwargs):
        seen.update(kwargs)
        raise Stop
    monkeypatch.setattr(PipelineModule, "__init__", spy)
    ttt = TTTConfig(adaptive_layers=2)
    with pytest.raises(Stop):
        TTTPipelineModule(tiny_qwen3_config, ttt, resolve_layout(1, 8, ttt), seed=3)
    assert seen["seed_layers"] and seen["base_seed"] == 3
    assert seen["seed_fn"] is pipeline.layer_seed_fn()
    if not torch.accelerator.is_available():
        assert seen["seed_fn"] is pipeline.seed_cpu_rngs


def test_frozen_layers_without_activation_checkpointing_have_the_same_gradients(tiny_qwen3_config):
    """The main job's layout runs its frozen layers without DeepSpeed's recompute; what the recompute
    gave (the non-reentrant checkpoint the interval-1 configs use) is the same loss and gradients, bit for
    bit, since the recompute repeats the forward exactly."""
    cfg = json.loads((REPO / "ds_configs" / "cpu_tiny_pp1_dp2.json").read_text())
    assert cfg["pipeline"]["activation_checkpoint_interval"] == 0
    ttt = TTTConfig(adaptive_layers=2, context_policy="current_round", trainable_scope="all")
    micro = batch([2, 3], seed=4)
    results = []
    for checkpointed in (False, True):
        layers = frozen_stage(tiny_qwen3_config, ttt)
        x = micro
        for layer in layers:
            if checkpointed and isinstance(layer, DecoderPipe):
                x = non_reentrant_checkpoint(lambda *inputs, layer=layer: layer(inputs), *x)
            else:
                x = layer(x)
        loss = (x[0].float() ** 2).mean()
        loss.backward()
        assert isinstance(layers[0], EmbedPipe) and layers[0].embed_tokens.weight.grad is not None
        results.append((loss.detach(), [p.grad for layer in layers for p in layer.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
