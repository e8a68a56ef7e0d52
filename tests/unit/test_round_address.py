"""The memory's round address (ttt.round_address) and the per-token write rate (ttt.write_rate):
the pool against a direct computation, chunks composing, exactness at init (bit for bit), event loop
== whole-sequence forward, no round seeing an earlier one, second-order gradients (finite differences
and gradgradcheck), the write rate's effect on the step, export round trip, serving == training and
batched decode == one session at a time.
Run: python -m pytest tests/unit/test_round_address.py
"""

from __future__ import annotations

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.model.fast_weights import ADDRESS_SCORE_CAP, KeyHistory, PrimeMLP, round_address
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from tests.unit.test_memory_key import CFG, batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def make(seed=0, randomize=True, dtype=torch.float64, layers=2, **ttt):
    """A tiny model with `layers` adaptive layers; `randomize` gives the address and rate nonzero weights."""
    torch.manual_seed(seed)
    ttt = {"context_policy": "current_round", "round_address": True, **ttt}
    model = TTTQwen3ForCausalLM(tiny_qwen3_config(**CFG), TTTConfig(prime_init_std=0.2, inner_lr=0.5,
                                                                    adaptive_layers=layers, **ttt))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.adaptive_layers:
            p = layer.prime_mlp
            p.down_proj.weight.copy_(0.2 * torch.randn(p.down_proj.weight.shape, generator=g))
            if randomize:
                for t, std in ((p.key_shift, 0.5), (p.address_query, 1.0), (p.address_proj, 0.3),
                               (p.write_rate, 1.0), (p.write_rate_bias, 0.5)):
                    if t is not None:
                        t.copy_(std * torch.randn(t.shape, generator=g))
    return model.to(dtype)


def direct_pool(x, q, seg):
    """a_t by its definition: a softmax (soft-capped scores) over the tokens of t's segment up to t."""
    b, t, c = x.shape
    out = torch.zeros_like(x)
    score = ADDRESS_SCORE_CAP * torch.tanh(x @ q / ADDRESS_SCORE_CAP)
    for i in range(b):
        for j in range(t):
            idx = [k for k in range(j + 1) if seg[i, k] == seg[i, j]]
            w = torch.softmax(score[i, idx], 0)
            out[i, j] = (w[:, None] * x[i, idx]).sum(0)
    return out


def test_pool_matches_its_definition_and_chunks_compose():
    torch.manual_seed(0)
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    q = torch.randn(6, dtype=torch.float64)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3]])
    a, _ = round_address(x, q, None, seg)
    torch.testing.assert_close(a, direct_pool(x, q, seg), rtol=0, atol=1e-12)
    # one segment in chunks of 4 + 1 + 6, the state carried between them == at once
    whole, last_whole = round_address(x, q, None, None)
    parts, prev = [], None
    for lo, hi in ((0, 4), (4, 5), (5, 11)):
        got, prev = round_address(x[:, lo:hi], q, prev, None)
        parts.append(got)
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(prev, last_whole, rtol=0, atol=1e-12)
    # a carried state continues only the chunk's first segment
    first, prev = round_address(x[:, :5], q, None, seg[:, :5])
    second, _ = round_address(x[:, 5:], q, prev, seg[:, 5:])
    torch.testing.assert_close(torch.cat([first, second], 1), direct_pool(x, q, seg), rtol=0, atol=1e-12)


def test_fresh_address_and_rate_reproduce_the_model_without_them_bit_for_bit():
    ids, kinds, rounds = batch()
    for extra in (dict(key_shift=3), dict()):
        base = make(randomize=False, round_address=False, **extra)
        new = make(randomize=False, write_rate=True, **extra)  # same seed: same weights, address and rate at zero
        sd = new.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in base.state_dict().items())
        assert {k for k in sd if k not in base.state_dict()} == {
            "model.layers.2.prime_mlp.address_query", "model.layers.2.prime_mlp.address_proj",
            "model.layers.3.prime_mlp.address_query", "model.layers.3.prime_mlp.address_proj",
            "model.layers.2.prime_mlp.write_rate", "model.layers.2.prime_mlp.write_rate_bias"}  # rate: first layer only
        a = base.trajectory_loss(ids, kinds, rounds, create_graph=True)
        b = new.trajectory_loss(ids, kinds, rounds, create_graph=True)
        assert torch.equal(a.loss, b.loss)
        assert all(torch.equal(x, y) for x, y in zip(a.final_weights[0], b.final_weights[0]))
        ga = torch.autograd.grad(a.loss, base.initial_fast_weights())
        gb = torch.autograd.grad(b.loss, new.initial_fast_weights())
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.parametrize("extra", [dict(), dict(key_shift=3, write_rate=True)])
def test_event_loop_equals_whole_sequence_forward_with_an_address(extra):
    model = make(**extra)
    ids, kinds, rounds = batch()
    with torch.no_grad():
        out = model.trajectory_loss(ids, kinds, rounds, update=False, record=True, create_graph=False)
        logp = model(ids, rounds).log_softmax(-1)
    nll = -logp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    pos = torch.cat([r.label_positions for r in out.records[0]])
    got = torch.cat([r.token_nll for r in out.records[0]])
    torch.testing.assert_close(got, nll[pos], rtol=0, atol=1e-10)
    # and the address changes what the model computes (the test above is not vacuous)
    with torch.no_grad():
        off = make(**extra)
        for layer in off.adaptive_layers:
            layer.prime_mlp.address_proj.zero_()
        assert not torch.allclose(off(ids, rounds), model(ids, rounds), atol=1e-6)


def test_no_round_sees_an_earlier_round_through_the_address():
    ids, kinds, rounds = batch()
    other = ids.clone()
    other[0, 8:19] = (other[0, 8:19] + 5) % CFG["vocab_size"]  # every token of round 1 changed
    r2 = rounds[0, :-1] == 2
    model = make(key_shift=2)
    with torch.no_grad():
        a, b = (model(x, rounds)[0, :-1][r2] for x in (ids, other))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="round_address.*current_round"):
        TTTConfig(round_address=True, context_policy="full").validate()
    with pytest.raises(ValueError, match="write_rate"):
        TTTConfig(write_rate=1).validate()


def test_meta_gradient_of_the_address_and_rate_against_finite_differences():
    model = make(key_shift=2, write_rate=True)
    ids, kinds, rounds = batch()
    ids, kinds, rounds = ids[:, :33], kinds[:, :33], rounds[:, :33]
    mlps = [layer.prime_mlp for layer in model.adaptive_layers]
    params = [mlps[0].address_query, mlps[1].address_proj, mlps[0].write_rate, mlps[0].write_rate_bias]
    out = model.trajectory_loss(ids, kinds, rounds, create_graph=True)
    grads = torch.autograd.grad(out.loss, params)
    eps = 1e-6
    for p, g, idx in zip(params, grads, [(3,), (1, 7), (5,), (0,)]):
        assert float(g.abs().max()) > 0
        orig = float(p[idx].detach())
        vals = []
        for d in (eps, -eps):
            with torch.no_grad():
                p[idx] = orig + d
            vals.append(float(model.trajectory_loss(ids, kinds, rounds, create_graph=True).loss))
        with torch.no_grad():
            p[idx] = orig
        assert float(g[idx]) == pytest.approx((vals[0] - vals[1]) / (2 * eps), rel=1e-5, abs=1e-9)


def test_double_backward_of_the_pool_and_the_key():
    torch.manual_seed(0)
    x = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    q = torch.randn(4, dtype=torch.float64, requires_grad=True)
    prev = torch.cat([torch.randn(1, 1, 4), torch.rand(1, 1, 1).expand(1, 1, 4) + 0.5], 1).double().requires_grad_(True)
    seg = torch.tensor([[0, 0, 1, 1, 1]])
    f = lambda x, q, prev: round_address(x, q, prev, seg)[0].sin()  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, q, prev))
    assert torch.autograd.gradgradcheck(f, (x, q, prev))
    mlp = PrimeMLP(4, 6, 2, round_address=True, write_rate=True).double()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.5)
    names = ["key_shift", "address_query", "address_proj", "write_rate", "write_rate_bias"]

    def key(x, *ps):
        for n, p in zip(names, ps):
            mlp._parameters[n] = p  # the inputs themselves, so autograd differentiates w.r.t. them
        h = KeyHistory(segments_BT=seg)
        return mlp.key(x, h).sin().sum(-1) + h.write_rate_BT
    ps = tuple(getattr(mlp, n).detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradgradcheck(key, (x, *ps))


def test_write_rate_scales_each_label_of_the_inner_loss():
    """beta = 2 sigmoid(b) everywhere (w = 0): without a clip the step is beta times the plain step;
    a very negative bias writes (almost) nothing."""
    ids, kinds, rounds = batch()
    base = make(randomize=False, write_rate=False, inner_max_norm=0.0)
    w0 = base.initial_fast_weights()
    with torch.no_grad():
        plain = base.trajectory_loss(ids[:, :19], kinds[:, :19], rounds[:, :19], create_graph=False)
    for bias, beta in ((0.7, 2 * torch.sigmoid(torch.tensor(0.7, dtype=torch.float64))), (-60.0, 0.0)):
        model = make(randomize=False, write_rate=True, inner_max_norm=0.0)
        with torch.no_grad():
            model.adaptive_layers[0].prime_mlp.write_rate_bias.fill_(bias)
            got = model.trajectory_loss(ids[:, :19], kinds[:, :19], rounds[:, :19], create_graph=False)
        for a, p, w in zip(got.final_weights[0], plain.final_weights[0], w0):
            torch.testing.assert_close(a - w, float(beta) * (p - w), rtol=1e-9, atol=1e-12)
    assert any(not torch.equal(p, w) for p, w in zip(plain.final_weights[0], w0))


def test_export_round_trip_keeps_the_address_and_rate(tmp_path):
    from ds_ttt.data.tokenizer import load_tokenizer
    from ds_ttt.export import export_model
    from ds_ttt.loading import load_export

    tok = load_tokenizer()
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(**{**CFG, "vocab_size": tiny_qwen3_config().vocab_size})
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(context_policy="current_round", round_address=True, write_rate=True))
    with torch.no_grad():
        for p in model.adaptive_layers[0].prime_mlp.parameters():
            p.normal_()
    export_model(model, tmp_path, tokenizer=tok)
    loaded = load_export(tmp_path)
    assert loaded.ttt.round_address and loaded.ttt.write_rate
    for (n, a), b in zip(model.adaptive_layers[0].prime_mlp.named_parameters(),
                         loaded.adaptive_layers[0].prime_mlp.parameters()):
        assert torch.equal(a, b), n


def served_model(**ttt):
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(**{**CFG, "vocab_size": tiny_qwen3_config().vocab_size})
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(context_policy="current_round", round_address=True, prime_init_std=0.2,
                                               adaptive_layers=2, **ttt))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            p = layer.prime_mlp
            p.down_proj.weight.normal_(0, 0.3)
            for t, std in ((p.key_shift, 0.5), (p.address_query, 1.0), (p.address_proj, 0.3), (p.write_rate, 1.0)):
                if t is not None:
                    t.normal_(0, std)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("ttt", [dict(key_shift=3, write_rate=True), dict(inner_steps=2, write_rate=True)])
def test_serving_equals_training_with_an_address(ttt):
    """A served session replaying a real trajectory reaches the training event loop's per-round losses
    and fast weights, with the address's running pool carried across decode steps and inner updates."""
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.render import render_trajectory
    from ds_ttt.data.tokenizer import load_tokenizer
    from ds_ttt.evaluation.runner import evaluate_trajectory
    from ds_ttt.serve import AgentModel, AgentSession
    from tests.unit.test_serve import replay

    tok = load_tokenizer()
    model = served_model(**ttt)
    traj = generate_memory_world(5, num_distractors=1)
    agent = AgentModel(model, tok)
    session = AgentSession(agent)
    replay(session, traj)
    rendered = render_trajectory(traj, tok)
    metrics, _ = evaluate_trajectory(model, rendered, "ttt", tokenizer=tok)
    rounds_with_obs = 0
    for h, m in zip(session.history, [m for m in metrics if m.round > 0]):
        assert h.action_nll == pytest.approx(m.action_nll, rel=1e-5, abs=1e-5)
        if m.obs_tokens:
            rounds_with_obs += 1
            assert h.obs_nll == pytest.approx(m.obs_nll, rel=1e-5, abs=1e-5)
    assert rounds_with_obs >= 2
    ids, kinds, rounds = (torch.tensor([x]) for x in (rendered.input_ids, rendered.kinds, rendered.rounds))
    with torch.no_grad():
        out = model.trajectory_loss(ids, kinds, rounds, create_graph=False)
    for a, b in zip(session.fast_weights, out.final_weights[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # greedy decoding one token per step (the pool's running state carried) equals a full forward
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
