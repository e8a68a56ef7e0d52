"""The checkpointed event loop that stores updates, not weights (ds_ttt/model/event_checkpoint.py), and
the clipped write that saves only what its backward needs (inner_step.ClippedSGD).

Run: .venv/bin/python -m pytest tests/unit/test_event_checkpoint.py
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ds_ttt.config import TTTConfig
from ds_ttt.model import event_checkpoint
from ds_ttt.model.event_checkpoint import FastWeightChain
from ds_ttt.model.fast_weights import inner_loop_weights
from ds_ttt.model.inner_step import (ClippedSGD, _ClipSpec, apply_update, inner_sgd_step,
                                     trainable_fast_weights)
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM


def _model(dtype=torch.float32, *, hidden=64, width=128, layers=3, adaptive=2, scope="prime", **ttt):
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=width,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=adaptive, trainable_scope=scope, **ttt)).to(dtype)
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    model.set_trainable_scope()
    return model


def _trajectory(events: int, *, round_tokens=32, prompt=8, vocab=128, seed=0):
    obs = round_tokens - 12
    kinds = [0] * prompt + ([0] * 2 + [1] * 8 + [0] + [2] * obs + [0]) * events
    rounds = [0] * prompt + [r for r in range(1, events + 1) for _ in range(round_tokens)]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, len(kinds)), generator=g), torch.tensor([kinds]), torch.tensor([rounds])


def _chains(monkeypatch):
    """Collect every FastWeightChain the loop makes."""
    made = []
    real = event_checkpoint.FastWeightChain.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        made.append(self)
    monkeypatch.setattr(event_checkpoint.FastWeightChain, "__init__", spy)
    return made


@pytest.mark.parametrize("fast", ["all", "down"])
def test_rebuilt_weights_are_the_forward_weights_bit_for_bit(monkeypatch, fast):
    """A bf16 model: the W the forward ended with is what the chain rebuilds from W_0 and the stored
    updates (what every event's backward uses), bit for bit."""
    chains = _chains(monkeypatch)
    ids, kinds, rounds = _trajectory(5)
    model = _model(torch.bfloat16, checkpoint_events=True, fast_matrices=fast, inner_lr=1.0, inner_max_norm=1.0)
    out = model.trajectory_loss(ids, kinds, rounds, create_graph=True)
    (chain,) = chains
    assert len(chain.events) == 6 and out.num_updates == 5
    rebuilt = chain.weights(len(chain.events))
    for got, want, f in zip(out.final_weights[0], rebuilt, chain.fast):
        assert got.dtype == want.dtype == (torch.float32 if f else torch.bfloat16)
        assert torch.equal(got, want)


@pytest.mark.parametrize("fast", ["all", "down"])
def test_checkpointed_update_equals_the_plain_one_to_bf16_rounding(fast):
    """One update in a bf16 model, checkpointed (gradient from its factors) and plain (autograd's dL/dW):
    both gradients are bf16 roundings of the same product summed in other orders, so the updated
    weights differ by a few bf16 ulps (2^-7 relative) of the update at most; matrices that are not
    fast are W_0 itself in both."""
    ids, kinds, rounds = _trajectory(1)
    outs = {}
    for ck in (True, False):
        model = _model(torch.bfloat16, checkpoint_events=ck, fast_matrices=fast, inner_lr=1.0, inner_max_norm=1.0)
        outs[ck] = model.trajectory_loss(ids, kinds, rounds, create_graph=True)
    fast_mask = trainable_fast_weights(fast, 6)
    for a, b, f, w0 in zip(outs[True].final_weights[0], outs[False].final_weights[0], fast_mask,
                           model.initial_fast_weights()):
        if f:
            moved = (a - w0.float()).abs().max()
            assert moved > 0 and (a - b).abs().max() <= 3 * 2 ** -7 * moved
        else:
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_updates_are_stored_in_the_compute_dtype_and_factors_when_smaller(monkeypatch):
    """Per event the chain keeps the gradient's factors (rounds shorter than in x out / (in + out)) or
    the gradient, in bf16: never an fp32 copy of a fast matrix."""
    chains = _chains(monkeypatch)
    model = _model(torch.bfloat16, checkpoint_events=True, fast_matrices="down", hidden=64, width=256)
    ids, kinds, rounds = _trajectory(4, round_tokens=32)
    model.trajectory_loss(ids, kinds, rounds, create_graph=True)
    (chain,) = chains
    fast_fp32_bytes = sum(w.numel() * 4 for w, f in zip(chain.initial, chain.fast) if f)
    for steps in chain.events[1:]:
        (kept, coefs), = steps
        for k, f in zip(kept, chain.fast):
            if not f:
                assert k is None
                continue
            dy, x, finite = k  # 32 tokens x (64 + 256) < 64 x 256: factors
            assert dy.dtype == x.dtype == torch.bfloat16 and dy.shape[-2] == x.shape[-2] == 32
    per_event = chain.stored_bytes() / 4
    assert per_event == 2 * (32 * (64 + 256) * 2 + 1)  # 2 layers: down factors in bf16, a 1-byte skip flag
    assert per_event < fast_fp32_bytes / 2  # below even the dense bf16 gradient (the fp32 copy: / 1)


def _held_and_peak(model, event_counts):
    """Per event count: bytes held after the forward and the step's peak, above what was allocated right
    before the step, from torch's profiler (one session: its CPU allocator counts only what is allocated
    while it runs, so every number is taken relative to the step's own start)."""
    trajectories = {e: _trajectory(e, round_tokens=64) for e in event_counts}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for e, (ids, kinds, rounds) in trajectories.items():
            with record_function(f"step{e}"):
                with record_function(f"forward{e}"):
                    out = model.trajectory_loss(ids, kinds, rounds, create_graph=True)
                    loss = out.loss
                    del out
                loss.backward()
                del loss
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in trace
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)

    def span(name):
        ev = next(x for x in trace if x.get("name") == name and x.get("ph") == "X")
        return ev["ts"], ev["ts"] + ev["dur"]
    out = {}
    for e in event_counts:
        (s0, s1), (_, f1) = span(f"step{e}"), span(f"forward{e}")
        base = ([a for t, a in mem if t < s0] or [0])[-1]
        out[e] = ([a for t, a in mem if t <= f1][-1] - base, max(a for t, a in mem if s0 <= t <= s1) - base)
    return out


def test_memory_per_event_is_the_stored_update_not_a_copy_of_the_weights():
    """What a step keeps per event (torch's profiler, bf16, gate/up/down all fast) is about its stored
    update: half an fp32 copy of the fast matrices (their gradients in bf16; 64-token rounds exceed
    64 x 512 / (64 + 512) = 57 tokens, so dense) plus the keys, values and hidden states, not the one
    fp32 copy per event that checkpointing W_{r-1} kept (the code before: ~1.0 on this probe held after
    the forward, more at the peak)."""
    model = _model(torch.bfloat16, checkpoint_events=True, fast_matrices="all", hidden=64, width=512, layers=2,
                   adaptive=1)
    unit = 3 * 64 * 512 * 4  # one fp32 copy of gate, up and down of the adaptive layer
    got = _held_and_peak(model, (2, 6))
    held_slope = (got[6][0] - got[2][0]) / 4 / unit
    peak_slope = (got[6][1] - got[2][1]) / 4 / unit
    assert 0.45 < held_slope < 0.65, held_slope
    assert peak_slope < 0.75, peak_slope


def test_each_event_runs_its_forward_once_in_the_forward_pass():
    """The inner gradient is taken on the event's live graph: no recompute in the forward pass (the
    non-reentrant checkpoint before ran every event twice there); the backward recomputes each once."""
    model = _model(torch.float32, checkpoint_events=True)
    calls = []
    model.adaptive_layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    ids, kinds, rounds = _trajectory(4)
    out = model.trajectory_loss(ids, kinds, rounds, create_graph=True)
    assert len(calls) == 5  # the prompt's event and four rounds
    out.loss.backward()
    assert len(calls) == 10


def test_inner_gradient_in_training_is_the_deployed_one():
    """The inner step of meta-training takes dL_obs/dW with the earlier events' cache held fixed, as
    evaluation and serving do: training (create_graph) and inference reach the same W. Before, the
    first update's gradient also flowed into round 0's cache (computed with the same W_0)."""
    model = _model(torch.float64, checkpoint_events=False)
    ids, kinds, rounds = _trajectory(3)
    train = model.trajectory_loss(ids, kinds, rounds, create_graph=True).final_weights[0]
    with torch.no_grad():
        infer = model.trajectory_loss(ids, kinds, rounds, create_graph=False).final_weights[0]
    for a, b in zip(train, infer):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_meta_gradient_through_checkpointed_events_matches_finite_differences():
    """gradcheck of the outer loss in W_0 through three checkpointed inner updates (fp64): the rebuilt
    weights, the per-event recompute and ClippedSGD's hand-written backward together."""
    cfg = tiny_qwen3_config(num_hidden_layers=2, hidden_size=8, intermediate_size=12, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=4, vocab_size=32)
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=1, prime_intermediate_size=4, inner_lr=0.5,
                                               checkpoint_events=True)).to(torch.float64)
    ids, kinds, rounds = _trajectory(3, round_tokens=13, prompt=6, vocab=32)
    from ds_ttt.model.event_loop import SuffixModules, run_event_loop
    w0 = tuple(p.detach().clone().requires_grad_(True) for p in model.initial_fast_weights())
    with torch.no_grad():
        h = model.run_layers(model.prefix_layers, model.model.embed_tokens(ids), rounds)
    suffix = SuffixModules(model.adaptive_layers, model.model.norm, model.lm_head, model.model.rotary_emb)

    def outer(*ws):
        out = run_event_loop(suffix, model.ttt, h, ids, kinds, rounds, create_graph=True, fast_weights=ws)
        assert out.num_updates == 3
        return out.loss

    assert torch.autograd.gradcheck(outer, w0, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_fast_matrices_down_casts_nothing_else():
    """gate and up stay W_0 in the compute dtype (no fp32 copy, no zero delta); down gets its fp32 copy."""
    model = _model(torch.bfloat16, fast_matrices="down")
    w0 = model.initial_fast_weights()
    ws = inner_loop_weights(w0, differentiable=True, trainable=trainable_fast_weights("down", len(w0)))
    for i, (w, p) in enumerate(zip(ws, w0)):
        if i % 3 == 2:
            assert w.dtype == torch.float32 and w is not p
        else:
            assert w is p


@pytest.mark.parametrize("max_norm,per_matrix", [(1.0, False), (1.0, True), (0.0, False), (100.0, False)])
def test_clipped_sgd_backward_matches_autograd(max_norm, per_matrix):
    """ClippedSGD's hand-written backward against autograd of the same expression (fp64), the clip
    binding, per matrix, off, and not binding."""
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    gs = [torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    cot = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2)]

    def reference(ws, gs):
        norms = [torch.linalg.vector_norm(x) for x in gs]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        if max_norm <= 0:
            cs = [None, None]
        elif per_matrix:
            cs = [torch.clamp(max_norm / (n + 1e-6), max=1.0) for n in norms]
        else:
            cs = [torch.clamp(max_norm / (norm + 1e-6), max=1.0)] * 2
        return [w - 0.3 * (x if c is None else x * c) for w, x, c in zip(ws, gs, cs)]

    got = ClippedSGD.apply(_ClipSpec(lr=0.3, max_norm=max_norm, per_matrix=per_matrix, save_dtype=torch.float64),
                           *ws, *gs)
    want = reference(ws, gs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
    dg_got = torch.autograd.grad(got, [*ws, *gs], cot)
    dg_want = torch.autograd.grad(want, [*ws, *gs], cot)
    for a, b in zip(dg_got, dg_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    spec = _ClipSpec(lr=0.3, max_norm=max_norm, per_matrix=per_matrix, save_dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda *t: ClippedSGD.apply(spec, *t), (*ws, *gs))


def test_clipped_sgd_skips_a_non_finite_gradient_and_passes_no_nan_back():
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    g = torch.tensor([1.0, float("nan"), 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    (new,) = ClippedSGD.apply(_ClipSpec(lr=0.1, max_norm=1.0, per_matrix=False, save_dtype=torch.float64), w, g)
    assert torch.equal(new, w)
    dw, dg = torch.autograd.grad(new.sum(), (w, g))
    assert torch.equal(dw, torch.ones_like(w)) and torch.equal(dg, torch.zeros_like(g))


def test_the_write_is_one_definition_in_place_and_out_of_place():
    """apply_update (the rebuild) computes W - lr (g c) exactly as the plain expression rounds it."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 32, generator=gen)
    g = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    c = torch.tensor(0.37)
    assert torch.equal(apply_update(w, g, c, 0.1), w - 0.1 * (g.float() * c))
    assert torch.equal(apply_update(w, g, None, 0.1), w - 0.1 * g.float())


def test_inner_sgd_step_in_factors_equals_the_autograd_gradient():
    """taps: the gradient taken as (dL/dy)^T x equals autograd's dL/dW (fp64)."""
    from ds_ttt.model.fast_weights import FactorTaps, fast_linear
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    w = w0.clone().requires_grad_(True)
    x = torch.randn(1, 9, 7, generator=gen, dtype=torch.float64)
    with FactorTaps((w,)) as taps:
        y = fast_linear(x, w0, w)
    loss = (y.sin() ** 2).sum()
    a = inner_sgd_step(loss, (w,), lr=0.1, max_norm=0.0, create_graph=True, taps=taps)
    b = inner_sgd_step((fast_linear(x, w0, w).sin() ** 2).sum(), (w,), lr=0.1, max_norm=0.0, create_graph=True)
    torch.testing.assert_close(a.weights[0], b.weights[0], rtol=1e-14, atol=1e-14)
    dy, xs = a.factors[0]
    assert dy.shape == (1, 9, 5) and xs.shape == (1, 9, 7)


@pytest.mark.parametrize("variant", [
    dict(inner_steps=2), dict(first_order=True), dict(inner_clip="per_matrix", inner_max_norm=0.05),
    dict(inner_max_norm=0.0), dict(key_shift=2), dict(key_shift=2, context_policy="current_round", round_address=True,
                                                      write_rate=True),
    dict(context_policy="window", window=9, fast_matrices="down"), dict(inner_loss="sum", obs_loss_weight=0.5),
])
def test_checkpointed_loop_equals_the_plain_one_for_every_inner_step_setting(variant):
    """Loss and every parameter's gradient, checkpointed (stored updates, rebuilt W, factored inner
    gradient, stand-ins) against the plain loop, in fp64: equal to fp64 rounding for every setting of
    the inner step and the key (more inner steps, first order, per-matrix or no clip, key shift carried
    across events, round address and write rate, a window, only down fast, summed inner loss)."""
    ids, kinds, rounds = _trajectory(3, round_tokens=24)
    results = []
    for ck in (False, True):
        model = _model(torch.float64, checkpoint_events=ck, scope="all", inner_lr=0.5, **variant)
        out = model.trajectory_loss(ids, kinds, rounds, create_graph=True)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        out.num_updates))
    (l0, g0, u0), (l1, g1, u1) = results
    assert u0 == u1 == 3
    torch.testing.assert_close(l0, l1, rtol=1e-12, atol=0)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-9, atol=1e-12, msg=name)
