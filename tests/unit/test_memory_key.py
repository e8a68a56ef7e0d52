"""The memory key with context (ttt.key_shift) and the levers on the write (inner_loss, inner_clip,
fast_matrices, inner_steps): exactness at init, chunked == whole-sequence execution, no history across
rounds under current_round, second-order gradients, serving == training, export round trip, per-row
fast weights.
Run: python -m pytest tests/unit/test_memory_key.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.fast_weights import KeyHistory, PrimeMLP, shift_keys, split_linear
from ds_ttt.model.inner_step import inner_sgd_step, trainable_fast_weights
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

CFG = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
           head_dim=8, vocab_size=97)


def make(seed=0, randomize_shift=True, dtype=torch.float64, **ttt):
    torch.manual_seed(seed)
    model = TTTQwen3ForCausalLM(tiny_qwen3_config(**CFG), TTTConfig(prime_init_std=0.2, inner_lr=0.5, **ttt))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.2)
            if randomize_shift and layer.prime_mlp.key_shift is not None:
                layer.prime_mlp.key_shift.normal_(0, 0.5)
    return model.to(dtype)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    rounds = [0] * 8 + [1] * 11 + [2] * 14 + [3] * 9
    kinds = [0] * 8 + [1] * 4 + [2] * 7 + [1] * 5 + [2] * 9 + [1] * 4 + [2] * 5
    ids = torch.randint(0, CFG["vocab_size"], (1, len(rounds)), generator=g)
    return ids, torch.tensor([kinds]), torch.tensor([rounds])


def test_shift_keys_matches_a_direct_convolution_and_chunks_compose():
    torch.manual_seed(0)
    x = torch.randn(2, 9, 5, dtype=torch.float64)
    a = torch.randn(3, 5, dtype=torch.float64)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]] * 2)
    u = shift_keys(x, a, KeyHistory(segments_BT=seg))
    ref = x.clone()
    for t in range(9):
        for j in range(1, 4):
            if t - j >= 0 and seg[0, t - j] == seg[0, t]:
                ref[:, t] += a[j - 1] * x[:, t - j]
    torch.testing.assert_close(u, ref, rtol=0, atol=1e-12)
    # one segment, in chunks of 4 + 5 carried by KeyHistory == at once
    whole = shift_keys(x, a, None)
    h = KeyHistory()
    first = shift_keys(x[:, :4], a, h)
    second = shift_keys(x[:, 4:], a, KeyHistory(prev_BSC=h.last_BSC))
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=0, atol=1e-12)


def test_zero_initialized_shift_reproduces_no_shift_exactly():
    ids, kinds, rounds = batch()
    for policy in ("full", "current_round"):
        base = make(context_policy=policy)
        shifted = make(context_policy=policy, key_shift=3, randomize_shift=False)  # same seed, shift left at 0
        assert all(torch.equal(shifted.state_dict()[k], v) for k, v in base.state_dict().items())
        a = base.trajectory_loss(ids, kinds, rounds, create_graph=True)
        b = shifted.trajectory_loss(ids, kinds, rounds, create_graph=True)
        assert torch.equal(a.loss, b.loss)
        ga = torch.autograd.grad(a.loss, base.initial_fast_weights())
        gb = torch.autograd.grad(b.loss, shifted.initial_fast_weights())
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.parametrize("policy", ["full", "window", "current_round"])
def test_event_loop_equals_whole_sequence_forward_with_a_shift(policy):
    model = make(context_policy=policy, window=12 if policy == "window" else 0, key_shift=3)
    ids, kinds, rounds = batch()
    with torch.no_grad():
        out = model.trajectory_loss(ids, kinds, rounds, update=False, record=True, create_graph=False)
        logp = model(ids, rounds).log_softmax(-1)
    nll = -logp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    pos = torch.cat([r.label_positions for r in out.records[0]])
    got = torch.cat([r.token_nll for r in out.records[0]])
    torch.testing.assert_close(got, nll[pos], rtol=0, atol=1e-10)


def test_current_round_keys_never_see_an_earlier_round():
    """Round 2's frozen-W predictions must not depend on round 1's tokens under current_round (the
    shift would leak them through the key); under full context they do."""
    ids, kinds, rounds = batch()
    other = ids.clone()
    other[0, 8:19] = (other[0, 8:19] + 5) % CFG["vocab_size"]  # every token of round 1 changed
    r2 = rounds[0, :-1] == 2  # positions inside round 2
    for policy, should_differ in (("current_round", False), ("full", True)):
        model = make(context_policy=policy, key_shift=2)
        with torch.no_grad():
            a, b = (model(x, rounds)[0, :-1][r2] for x in (ids, other))
        assert (not torch.allclose(a, b, atol=1e-9)) == should_differ, policy


def test_second_order_gradients_through_the_shift_gradcheck():
    model = make(context_policy="full", key_shift=2)
    ids, kinds, rounds = batch()
    ids, kinds, rounds = ids[:, :27], kinds[:, :27], rounds[:, :27]
    shifts = [layer.prime_mlp.key_shift for layer in model.adaptive_layers]

    def loss_of(*a):
        with torch.no_grad():
            for p, v in zip(shifts, a):
                p.copy_(v)
        return model.trajectory_loss(ids, kinds, rounds, create_graph=True).loss

    # the meta-gradient w.r.t. the shift (it flows through the inner step: the updated W was written
    # with the shifted keys) against central finite differences
    out = model.trajectory_loss(ids, kinds, rounds, create_graph=True)
    grads = torch.autograd.grad(out.loss, shifts)
    base = [p.detach().clone() for p in shifts]
    eps = 1e-6
    for li, (p, g) in enumerate(zip(shifts, grads)):
        for idx in [(0, 0), (1, 7), (0, 31)]:
            plus = [b.clone() for b in base]
            minus = [b.clone() for b in base]
            plus[li][idx] += eps
            minus[li][idx] -= eps
            fd = (loss_of(*plus) - loss_of(*minus)) / (2 * eps)
            assert float(g[idx].detach()) == pytest.approx(float(fd), rel=1e-5, abs=1e-9)
        assert float(g.abs().max()) > 0
    loss_of(*base)
    # and gradgradcheck of the shift itself (its double backward is what the meta-gradient uses)
    x = torch.randn(1, 6, 4, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    prev = torch.randn(1, 2, 4, dtype=torch.float64, requires_grad=True)
    f = lambda x, a, prev: shift_keys(x, a, KeyHistory(prev_BSC=prev)).sin()  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, a, prev))
    assert torch.autograd.gradgradcheck(f, (x, a, prev))


def test_shift_trains_under_the_prime_scope_and_validates():
    model = make(key_shift=3)
    model.set_trainable_scope("prime")
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {f"model.layers.{i}.prime_mlp.key_shift" for i in (3,)} <= names
    with pytest.raises(ValueError, match="key_shift"):
        TTTConfig(key_shift=9).validate()
    with pytest.raises(ValueError, match="window"):
        TTTConfig(key_shift=4, context_policy="window", window=4).validate()
    for field, bad in (("inner_loss", "max"), ("inner_clip", "layer"), ("fast_matrices", "gate"), ("inner_steps", 0)):
        with pytest.raises(ValueError, match=field):
            TTTConfig(**{field: bad}).validate()


def test_inner_step_levers_against_hand_computed_updates():
    torch.manual_seed(0)
    w = tuple(torch.randn(3, 2, dtype=torch.float64, requires_grad=True) for _ in range(3))
    x = torch.randn(2, dtype=torch.float64)
    loss_of = lambda: sum(((wi @ x) ** 2).sum() * (i + 1) for i, wi in enumerate(w))  # noqa: E731
    g = torch.autograd.grad(loss_of(), w)
    # per-matrix clip: each gradient scaled to norm <= 1 on its own
    res = inner_sgd_step(loss_of(), w, lr=0.1, max_norm=1.0, create_graph=False, per_matrix=True)
    for wi, gi, new in zip(w, g, res.weights):
        torch.testing.assert_close(new, wi - 0.1 * gi * min(1.0, 1.0 / (float(gi.norm()) + 1e-6)))
    # down only: gate and up unchanged, down moved with its own norm as the global one
    res = inner_sgd_step(loss_of(), w, lr=0.1, max_norm=1.0, create_graph=False, trainable=trainable_fast_weights("down", 3))
    assert torch.equal(res.weights[0], w[0]) and torch.equal(res.weights[1], w[1])
    torch.testing.assert_close(res.weights[2], w[2] - 0.1 * g[2] * min(1.0, 1.0 / (float(g[2].norm()) + 1e-6)))
    torch.testing.assert_close(res.grad_norm, g[2].norm())


# a sum differs from a mean only where the clip does not bind (same direction); per-matrix only where it does
@pytest.mark.parametrize("levers,clip", [(dict(inner_loss="sum"), 0.0), (dict(inner_steps=2), 1.0),
                                         (dict(fast_matrices="down"), 1.0), (dict(inner_clip="per_matrix"), 0.05)])
def test_each_lever_changes_the_write(levers, clip):
    ids, kinds, rounds = batch()
    with torch.no_grad():
        base = make(key_shift=2, inner_max_norm=clip).trajectory_loss(ids, kinds, rounds, create_graph=False)
        lever = make(key_shift=2, inner_max_norm=clip, **levers).trajectory_loss(ids, kinds, rounds, create_graph=False)
    assert any(not torch.allclose(a, b) for a, b in zip(base.final_weights[0], lever.final_weights[0]))
    if levers.get("fast_matrices") == "down":
        w0 = make(key_shift=2).initial_fast_weights()
        assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(lever.final_weights[0], w0)) if i % 3 != 2)


def test_per_row_fast_weights_equal_one_row_at_a_time():
    torch.manual_seed(0)
    mlp = PrimeMLP(8, 16).to(torch.bfloat16)
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    rows = [tuple(w.float() + 0.01 * torch.randn_like(w.float()) for w in mlp.initial_weights()) for _ in range(3)]
    batched = tuple(torch.stack(ws) for ws in zip(*rows))
    got = mlp(x, batched)
    for b in range(3):
        torch.testing.assert_close(got[b], mlp(x[b:b + 1], rows[b])[0], rtol=0, atol=0)
    # the split keeps the delta (a per-row delta far below half a bf16 ulp of W_0 still counts)
    w0 = mlp.gate_proj.weight
    tiny = torch.stack([w0.float() + 1e-5, w0.float() - 1e-5])
    out = split_linear(x[:2], w0, tiny)
    assert not torch.equal(out[0], out[1])


def test_export_round_trip_keeps_the_shift(tmp_path):
    from ds_ttt.data.tokenizer import load_tokenizer
    from ds_ttt.export import export_model
    from ds_ttt.loading import load_export

    tok = load_tokenizer()
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(**{**CFG, "vocab_size": tiny_qwen3_config().vocab_size})
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(key_shift=3))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.key_shift.normal_()
    export_model(model, tmp_path, tokenizer=tok)
    loaded = load_export(tmp_path)
    for a, b in zip(model.adaptive_layers, loaded.adaptive_layers):
        assert torch.equal(a.prime_mlp.key_shift, b.prime_mlp.key_shift)
    assert loaded.ttt.key_shift == 3


@pytest.mark.parametrize("policy,levers", [("current_round", {}), ("full", {}), ("window", {}),
                                           ("current_round", dict(inner_steps=2, inner_loss="sum")),
                                           ("full", dict(fast_matrices="down", inner_clip="per_matrix"))])
def test_serving_equals_training_with_a_shift(policy, levers):
    """A served session replaying a real trajectory (act with force, observe) reaches the fast weights
    and per-round losses of the training event loop, with the key history carried across chunks,
    decode steps and inner updates."""
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.render import render_trajectory
    from ds_ttt.data.tokenizer import load_tokenizer
    from ds_ttt.evaluation.runner import evaluate_trajectory
    from ds_ttt.serve import AgentModel, AgentSession
    from tests.unit.test_serve import replay

    tok = load_tokenizer()
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(**{**CFG, "vocab_size": tiny_qwen3_config().vocab_size})
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(key_shift=3, context_policy=policy, window=64 if policy == "window" else 0,
                                               prime_init_std=0.2, **levers))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.3)
            layer.prime_mlp.key_shift.normal_(0, 0.5)
    model.eval().requires_grad_(False)
    traj = generate_memory_world(5, num_distractors=1)
    agent = AgentModel(model, tok)
    session = AgentSession(agent)
    replay(session, traj)  # act(force=...) / observe per round, as tests/unit/test_serve.py replays
    rendered = render_trajectory(traj, tok)
    metrics, _ = evaluate_trajectory(model, rendered, "ttt", tokenizer=tok)
    for h, m in zip(session.history, [m for m in metrics if m.round > 0]):
        assert h.action_nll == pytest.approx(m.action_nll, rel=1e-5, abs=1e-5)
        if m.obs_tokens:
            assert h.obs_nll == pytest.approx(m.obs_nll, rel=1e-5, abs=1e-5)
    ids, kinds, rounds = (torch.tensor([x]) for x in (rendered.input_ids, rendered.kinds, rendered.rounds))
    with torch.no_grad():
        out = model.trajectory_loss(ids, kinds, rounds, create_graph=False)
    for a, b in zip(session.fast_weights, out.final_weights[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # greedy decoding through the cache (one token per step, history carried) equals a full forward
    fork = session.fork()
    fork.act(max_new_tokens=6)
    generated = fork.history[-1].action_ids[:len(fork.history[-1].action_token_nll)]
    assert len(generated) >= 2
    seq = [torch.tensor([x]) for x in (fork.input_ids, fork.kinds, fork.rounds)]
    with torch.no_grad():
        full = model.trajectory_loss(*seq, record=True, create_graph=False)
    pred = {int(p): int(a) for p, a in zip(full.records[0][-1].label_positions, full.records[0][-1].argmax)}
    first = len(session.input_ids) + len(agent.prompt_ids)  # position of the first generated token
    assert [pred[first - 1 + k] for k in range(len(generated))] == generated
