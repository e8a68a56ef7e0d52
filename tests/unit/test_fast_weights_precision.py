"""Fast weights in bf16 models: inner updates below half a bf16 ulp must still take effect.

The Qwen3-8B recipe moves each prime weight by ~2.7e-6 per inner step, far below half a bf16 ulp of
a typical weight; updating bf16 weights in bf16 rounds the step away while autograd differentiates as
if it had happened. The inner loop carries fp32 fast weights (ds_ttt/model/fast_weights.py).

    python -m pytest tests/unit/test_fast_weights_precision.py
"""

from __future__ import annotations

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.fast_weights import inner_loop_weights, split_linear
from ds_ttt.model.inner_step import inner_sgd_step
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

INNER_LR = 0.01


def recall_trajectory(fact_len=64, num_rounds=6, vocab=256, seed=1):
    """Each round: an action that types a fixed fact, then an observation that shows it. The inner
    steps learn the fact from the observations, so later actions get cheaper (a measurable effect)."""
    g = torch.Generator().manual_seed(seed)
    fact = torch.randint(0, vocab, (fact_len,), generator=g).tolist()
    ids, kinds, rounds = [1, 2, 3, 4], [0] * 4, [0] * 4
    for r in range(1, num_rounds + 1):
        ids += [5, 6] + fact + [7] + fact + [8]
        kinds += [0, 0] + [1] * fact_len + [0] + [2] * fact_len + [0]
        rounds += [r] * (2 * fact_len + 4)
    return tuple(torch.tensor(x)[None] for x in (ids, kinds, rounds))


def recall_model(dtype, **ttt):
    """The same bf16-representable weights in `dtype` (prime W_0 random, so no weight sits at zero)."""
    cfg = tiny_qwen3_config(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, vocab_size=256)
    torch.manual_seed(0)
    settings = dict(adaptive_layers=1, inner_lr=INNER_LR, inner_max_norm=1.0, checkpoint_events=False,
                    context_policy="current_round")
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(**{**settings, **ttt}))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            for w in layer.prime_mlp.initial_weights():
                w.normal_(0.0, 0.05)
    return model.to(torch.bfloat16).to(dtype)


def half_bf16_ulp(w: torch.Tensor) -> torch.Tensor:
    """Half the spacing of bf16 numbers at each element of the (bf16-representable) tensor w."""
    _, exponent = torch.frexp(w.float())  # |w| = m * 2**e with m in [0.5, 1)
    return torch.ldexp(torch.ones_like(w.float()), exponent - 8) / 2  # 8 significant bits


def effect_of_updates(model) -> float:
    ids, kinds, rounds = recall_trajectory()
    with torch.no_grad():
        on = model.trajectory_loss(ids, kinds, rounds, create_graph=False)
        off = model.trajectory_loss(ids, kinds, rounds, create_graph=False, update=False)
    return float(on.loss) - float(off.loss)


def test_first_inner_step_is_below_bf16_resolution():
    """The premise of the precision test: one inner step moves almost every weight by less than half
    a bf16 ulp, so an update done in bf16 would round it away."""
    model = recall_model(torch.float32)
    ids, kinds, rounds = recall_trajectory(num_rounds=1)
    w0 = tuple(w.detach().clone().requires_grad_(True) for w in model.initial_fast_weights())
    h = model.run_layers(model.prefix_layers, model.model.embed_tokens(ids), rounds)
    from ds_ttt.model.event_loop import SuffixModules, run_event_loop
    suffix = SuffixModules(model.adaptive_layers, model.model.norm, model.lm_head, model.model.rotary_emb)
    out = run_event_loop(suffix, model.ttt, h.detach(), ids, kinds, rounds, create_graph=False, fast_weights=w0)
    assert out.num_updates == 1
    below = sum(int(((w1 - w).abs() < half_bf16_ulp(w)).sum()) for w1, w in zip(out.final_weights[0], w0))
    assert below / sum(w.numel() for w in w0) > 0.9


def test_bf16_inner_updates_have_the_fp32_effect():
    e32 = effect_of_updates(recall_model(torch.float32))
    e16 = effect_of_updates(recall_model(torch.bfloat16))
    assert e32 < -0.01  # the updates matter: later actions are cheaper
    assert abs(e16 - e32) <= 0.1 * abs(e32), (e16, e32)


def test_fast_weights_are_fp32_and_the_meta_gradient_reaches_bf16_w0():
    ids, kinds, rounds = recall_trajectory(fact_len=16, num_rounds=3)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = recall_model(dtype, checkpoint_events=True)
        model.set_trainable_scope("prime")
        out = model.trajectory_loss(ids, kinds, rounds)
        assert all(w.dtype == torch.float32 for w in out.final_weights[0])
        out.loss.backward()
        grads[dtype] = torch.cat([w.grad.float().flatten() for w in model.initial_fast_weights()])
        assert all(w.grad.dtype == dtype for w in model.initial_fast_weights())
    cos = torch.nn.functional.cosine_similarity(grads[torch.float32], grads[torch.bfloat16], dim=0)
    assert torch.isfinite(grads[torch.bfloat16]).all() and cos > 0.99, float(cos)


def test_inner_loop_weights_copies_or_casts():
    w_bf16 = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    (meta,) = inner_loop_weights((w_bf16,), differentiable=True)
    assert meta.dtype == torch.float32 and meta.grad_fn is not None  # differentiable back to W_0
    meta.sum().backward()
    assert w_bf16.grad is not None and w_bf16.grad.dtype == torch.bfloat16
    (leaf,) = inner_loop_weights((w_bf16,), differentiable=False)
    assert leaf.dtype == torch.float32 and leaf.is_leaf and leaf.requires_grad
    w64 = torch.randn(2, dtype=torch.float64)
    assert inner_loop_weights((w64,), differentiable=False)[0].dtype == torch.float64


@pytest.mark.parametrize("scale", [1e-3, 1e-5])
def test_split_linear_keeps_a_sub_ulp_delta(scale):
    """x W^T with W = W_0 + delta (delta far below W_0's bf16 ulp) against the fp64 product."""
    torch.manual_seed(0)
    x = torch.randn(64, 128).to(torch.bfloat16)
    w0 = (torch.randn(96, 128) * 0.05).to(torch.bfloat16)
    delta = torch.randn(96, 128) * 0.05 * scale
    w = w0.float() + delta
    exact = x.double() @ w.double().T
    exact_delta_effect = x.double() @ delta.double().T
    got = split_linear(x, w0, w).double()
    naive = (x @ w.to(torch.bfloat16).T).double()  # the old path: W rounded to bf16 first
    base = (x @ w0.T).double()
    err_split = ((got - base) - exact_delta_effect).norm() / exact_delta_effect.norm()
    err_naive = ((naive - base) - exact_delta_effect).norm() / exact_delta_effect.norm()
    assert err_naive > 0.5  # the delta is (mostly) lost when W is cast whole
    # what split_linear cannot avoid is bf16 rounding of its output, ~2**-9 of |x W^T| per element
    bound = 3 * 2.0 ** -9 * exact.abs().mean() / exact_delta_effect.abs().mean()
    assert err_split < max(float(bound), 0.05), (float(err_split), float(bound))


def test_skipped_step_is_decided_on_the_device_without_nan():
    w = (torch.randn(4, dtype=torch.float32, requires_grad=True),)
    loss = (w[0] * torch.tensor(float("inf"))).sum()
    res = inner_sgd_step(loss, w, lr=0.1, max_norm=1.0, create_graph=False)
    assert res.skipped.dtype == torch.bool and bool(res.skipped)
    assert torch.equal(res.weights[0], w[0])
