"""The TTT Qwen3 model on one device: base-model equality, inner/outer gradients, checkpointing,
context policies and Hugging Face checkpoint loading.  Run: python -m pytest tests/unit/test_model.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3ForCausalLM

from ds_ttt.config import TTTConfig
from ds_ttt.model.inner_step import inner_sgd_step
from ds_ttt.model.hf_adapter import load_hf_qwen3
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

# A 4-round trajectory: round 0 = prompt (context); each later round = header (context), action,
# observation.  kinds: 0 context, 1 action, 2 observation.
ROUND = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 2, 0]


def trajectory(num_rounds=3, prompt=6, vocab=256, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    kinds = [0] * prompt + ROUND * num_rounds
    rounds = [0] * prompt + [r for r in range(1, num_rounds + 1) for _ in ROUND]
    t = len(kinds)
    ids = torch.randint(0, vocab, (batch, t), generator=g)
    return ids, torch.tensor(kinds).expand(batch, t).clone(), torch.tensor(rounds).expand(batch, t).clone()


def make_model(cfg, dtype=torch.float32, perturb_prime=True, **ttt):
    torch.manual_seed(0)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(**ttt)).to(dtype)
    if perturb_prime:  # leave the zero init so updates and the policy tests have something to move
        with torch.no_grad():
            for layer in model.adaptive_layers:
                layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    return model


def test_untrained_ttt_model_equals_transformers_qwen3(tiny_qwen3_config):
    hf = Qwen3ForCausalLM(tiny_qwen3_config).eval()
    ours = TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig())
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert unexpected == []
    assert missing and all(".prime_" in n for n in missing)
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
        # The event loop with updates off computes the same logits position by position.
        kinds = torch.ones_like(ids)
        rec = ours.trajectory_loss(ids, kinds, torch.zeros_like(ids), update=False, record=True).records
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    ref_nll = torch.nn.functional.cross_entropy(ref[0, :-1], ids[0, 1:], reduction="none")
    torch.testing.assert_close(rec[0][0].token_nll, ref_nll, rtol=1e-5, atol=1e-5)


def test_prime_down_projection_starts_at_zero(tiny_qwen3_config):
    model = TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig())
    assert model.num_adaptive == 2 and model.first_adaptive == 6
    for layer in model.adaptive_layers:
        assert torch.count_nonzero(layer.prime_mlp.down_proj.weight) == 0
    assert not hasattr(model.prefix_layers[0], "prime_mlp")


def test_inner_step_matches_hand_derived_clipped_sgd():
    w = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True),
         torch.randn(5, dtype=torch.float64, requires_grad=True))
    target = torch.randn(3, 4, dtype=torch.float64)
    loss = ((w[0] - target) ** 2).sum() + (w[1] ** 3).sum()
    res = inner_sgd_step(loss, w, lr=0.1, max_norm=1.0, create_graph=True)
    g = (2 * (w[0] - target), 3 * w[1] ** 2)
    norm = torch.sqrt((g[0] ** 2).sum() + (g[1] ** 2).sum())
    assert norm > 1.0  # the clip is active in this case
    coef = 1.0 / (norm + 1e-6)
    for new, old, gi in zip(res.weights, w, g):
        torch.testing.assert_close(new, old - 0.1 * coef * gi)
    torch.testing.assert_close(res.grad_norm, norm.detach())
    # and it is differentiable (second order) with respect to the old weights
    assert res.weights[0].requires_grad and res.weights[0].grad_fn is not None


def test_non_finite_inner_gradient_skips_the_update():
    w = (torch.randn(4, requires_grad=True),)
    loss = (w[0] * torch.tensor(float("nan"))).sum()
    res = inner_sgd_step(loss, w, lr=0.1, max_norm=1.0, create_graph=True)
    assert bool(res.skipped)
    torch.testing.assert_close(res.weights[0], w[0], rtol=0, atol=0)  # W' = W, decided on the device
    res.weights[0].sum().backward()  # and the skipped step's graph passes no NaN to W
    assert torch.isfinite(w[0].grad).all()


def test_event_loop_counts_skipped_updates(tiny_qwen3_config):
    model = make_model(tiny_qwen3_config)
    ids, kinds, rounds = trajectory()
    with torch.no_grad():
        model.adaptive_layers[0].prime_mlp.up_proj.weight[0, 0] = float("inf")
    out = model.trajectory_loss(ids, kinds, rounds, create_graph=False)
    assert out.num_updates == 0 and out.num_skipped == 3


def _tiny64():
    return tiny_qwen3_config(num_hidden_layers=2, hidden_size=8, intermediate_size=12, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=4, vocab_size=32)


def test_meta_gradient_through_three_inner_steps_matches_finite_differences():
    """Outer loss as a function of W_0 passes through two differentiable inner updates."""
    cfg = _tiny64()
    model = make_model(cfg, dtype=torch.float64, adaptive_layers=1, prime_intermediate_size=4,
                       inner_lr=0.5, checkpoint_events=False)
    ids, kinds, rounds = trajectory(num_rounds=3, vocab=32)
    w0 = tuple(p.detach().clone().requires_grad_(True) for p in model.initial_fast_weights())
    from ds_ttt.model.event_loop import SuffixModules, run_event_loop

    def outer(*ws):
        h = model.run_layers(model.prefix_layers, model.model.embed_tokens(ids), rounds)
        suffix = SuffixModules(model.adaptive_layers, model.model.norm, model.lm_head, model.model.rotary_emb)
        out = run_event_loop(suffix, model.ttt, h, ids, kinds, rounds, create_graph=True, fast_weights=ws)
        assert out.num_updates == 3
        return out.loss

    assert torch.autograd.gradcheck(outer, w0, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_inner_gradient_matches_finite_differences_and_gradgradcheck():
    cfg = _tiny64()
    model = make_model(cfg, dtype=torch.float64, adaptive_layers=1, prime_intermediate_size=4)
    ids, kinds, _ = trajectory(num_rounds=1, vocab=32)
    obs = kinds[0, 1:] == 2
    w0 = tuple(p.detach().clone().requires_grad_(True) for p in model.initial_fast_weights())

    def obs_loss(*ws):
        h = model.run_layers(model.prefix_layers, model.model.embed_tokens(ids), None)
        layer = model.adaptive_layers[0]
        pos = model.position_embeddings(h, torch.arange(ids.shape[1])[None])
        from ds_ttt.ops.flashbob import attention
        h, _ = layer(h, pos, lambda q, k, v: attention(q, k, v, causal=True, backend="reference"), ws)
        logits = model.lm_head(model.model.norm(h))[0, :-1]
        return torch.nn.functional.cross_entropy(logits[obs], ids[0, 1:][obs])

    assert torch.autograd.gradcheck(obs_loss, w0, eps=1e-6, atol=1e-6, rtol=1e-4)
    assert torch.autograd.gradgradcheck(obs_loss, w0, eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("policy", [dict(), dict(context_policy="window", window=9),
                                    dict(context_policy="current_round")])
def test_checkpointed_and_plain_event_loops_agree(tiny_qwen3_config, policy):
    """The checkpointed loop (event_checkpoint.py: stored updates, W rebuilt, each event's backward a
    recompute) computes the plain loop's loss and gradients up to fp64 rounding: its first forward
    takes the inner gradient without create_graph (autograd's first-order formulas round differently
    from the differentiable ones), and its gradients sum per event, not through one graph."""
    results = []
    for ck in (False, True):
        model = make_model(tiny_qwen3_config, dtype=torch.float64, checkpoint_events=ck, trainable_scope="all",
                           obs_loss_weight=0.3, **policy)
        ids, kinds, rounds = trajectory(batch=2)
        kinds[1, -7:] = -1  # a shorter second trajectory (right padding)
        out = model.trajectory_loss(ids, kinds, rounds)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), grads, out.num_updates))
    (l0, g0, u0), (l1, g1, u1) = results
    assert u0 == u1 == 5  # 3 + 2: padding removed the last observation of row 1
    torch.testing.assert_close(l0, l1, rtol=1e-13, atol=0)
    assert g0.keys() == g1.keys() and len(g0) == len(list(model.parameters()))
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-12, atol=1e-14, msg=name)


def test_padding_changes_no_loss_and_no_gradient(tiny_qwen3_config):
    ids, kinds, rounds = trajectory(batch=1)
    runs = []
    for pad in (0, 11):
        model = make_model(tiny_qwen3_config, trainable_scope="all", context_policy="current_round")
        p_ids = torch.cat([ids, torch.randint(0, 256, (1, pad))], 1)
        p_kinds = torch.cat([kinds, torch.full((1, pad), -1)], 1)
        p_rounds = torch.cat([rounds, torch.full((1, pad), int(rounds.max()))], 1)
        out = model.trajectory_loss(p_ids, p_kinds, p_rounds)
        out.loss.backward()
        runs.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-6, atol=1e-7)
    for n in runs[0][1]:
        torch.testing.assert_close(runs[0][1][n], runs[1][1][n], rtol=1e-5, atol=1e-6, msg=n)


def _late_nll(model, ids, kinds, rounds, update):
    with torch.no_grad():
        rec = model.trajectory_loss(ids, kinds, rounds, update=update, record=True, create_graph=False).records[0]
    return rec[-1].token_nll  # the last round


@pytest.mark.parametrize("policy,edit", [
    # window 4 over 8 layers reaches 8 * 3 = 24 tokens back; round 3 starts at position 32
    (dict(context_policy="window", window=4), 2),
    (dict(context_policy="current_round"), 6 + 4),  # an action token of round 1
])
def test_context_policy_hides_what_it_claims_and_fast_weights_carry_it(tiny_qwen3_config, policy, edit):
    model = make_model(tiny_qwen3_config, inner_lr=1.0, **policy)
    ids, kinds, rounds = trajectory()
    edited = ids.clone()
    edited[0, edit] = (ids[0, edit] + 1) % 256
    frozen_a, frozen_b = _late_nll(model, ids, kinds, rounds, False), _late_nll(model, edited, kinds, rounds, False)
    torch.testing.assert_close(frozen_a, frozen_b, rtol=0, atol=0)  # invisible to attention
    ttt_a, ttt_b = _late_nll(model, ids, kinds, rounds, True), _late_nll(model, edited, kinds, rounds, True)
    assert (ttt_a - ttt_b).abs().max() > 1e-6  # but it reaches the later round through W
    # and the whole-sequence masked forward (the frozen prefix path) agrees with the event loop
    with torch.no_grad():
        logits = model(ids, rounds)
    last = rounds[0] == rounds[0].max()
    pos = last.nonzero().squeeze(1)[:-1]
    ref = torch.nn.functional.cross_entropy(logits[0, pos], ids[0, pos + 1], reduction="none")
    torch.testing.assert_close(frozen_a, ref, rtol=1e-5, atol=1e-5)


def test_full_policy_sees_everything(tiny_qwen3_config):
    model = make_model(tiny_qwen3_config)
    ids, kinds, rounds = trajectory()
    edited = ids.clone()
    edited[0, 2] += 1
    assert (_late_nll(model, ids, kinds, rounds, False) - _late_nll(model, edited, kinds, rounds, False)).abs().max() > 1e-6


def test_save_pretrained_checkpoint_loads_and_matches(tmp_path, tiny_qwen3_config):
    hf = Qwen3ForCausalLM(tiny_qwen3_config).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with an index, like Qwen3-8B
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_hf_qwen3(tmp_path, TTTConfig())
    ids = torch.randint(0, 256, (1, 17))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_trainable_scopes(tiny_qwen3_config):
    model = TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig())
    model.set_trainable_scope("prime")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".prime_" in n}
    model.set_trainable_scope("suffix")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "lm_head.weight" in trained and "model.layers.6.mlp.up_proj.weight" in trained
    assert "model.layers.5.mlp.up_proj.weight" not in trained and "model.embed_tokens.weight" not in trained


@pytest.mark.parametrize("field,value,msg", [
    ("adaptive_layers", 9, "exceeds"), ("context_policy", "sliding", "context_policy"),
    ("window", 4, "only used"), ("trainable_scope", "head", "trainable_scope"), ("inner_lr", float("nan"), "inner_lr"),
])
def test_ttt_config_errors_name_the_field(tiny_qwen3_config, field, value, msg):
    with pytest.raises(ValueError, match=msg):
        TTTConfig(**{field: value}).validate(tiny_qwen3_config.num_hidden_layers)


def test_ttt_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown key"):
        TTTConfig.from_dict({"inner_lr": 0.1, "inner_learning_rate": 0.2})
    assert dataclasses.asdict(TTTConfig.from_dict({"inner_lr": 0.2}))["inner_lr"] == 0.2


def test_to_dtype_keeps_rope_frequencies_in_fp32(tiny_qwen3_config):
    model = TTTQwen3ForCausalLM(tiny_qwen3_config, TTTConfig()).to_dtype(torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_record_mode_scores_every_position_and_keeps_the_loss(tiny_qwen3_config):
    model = make_model(tiny_qwen3_config)
    ids, kinds, rounds = trajectory()
    plain = model.trajectory_loss(ids, kinds, rounds, create_graph=False)
    rec = model.trajectory_loss(ids, kinds, rounds, create_graph=False, record=True)
    torch.testing.assert_close(plain.loss, rec.loss)
    assert sum(len(e.labels) for e in rec.records[0]) == ids.shape[1] - 1


def test_prime_init_std_scales_only_the_prime_gate_and_up(tiny_qwen3_config):
    base = make_model(tiny_qwen3_config, perturb_prime=False, adaptive_layers=2)
    wide = make_model(tiny_qwen3_config, perturb_prime=False, adaptive_layers=2, prime_init_std=0.5)
    for (name, p), (_, q) in zip(base.named_parameters(), wide.named_parameters()):
        if ".prime_mlp.gate_proj" in name or ".prime_mlp.up_proj" in name:
            assert 0.4 < float(q.std()) < 0.6 and float(p.std()) < 0.05, name
        else:  # the prime re-init comes last, so every other tensor is drawn identically
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    ids, kinds, rounds = trajectory()
    with torch.no_grad():  # down_proj is zero: W_0 computes the same function
        torch.testing.assert_close(base(ids), wide(ids), rtol=0, atol=0)
        # ...but not the same inner step: the update of down is an outer product with the prime activations
        nb = base.trajectory_loss(ids, kinds, rounds, create_graph=False, record=True).records[0]
        nw = wide.trajectory_loss(ids, kinds, rounds, create_graph=False, record=True).records[0]
    moved = [float((w.obs_nll_after - b.obs_nll_after).abs().max()) for b, w in zip(nb, nw) if b.obs_nll_after is not None]
    assert moved and max(moved) > 0


@pytest.mark.parametrize("bad", [0.0, -0.1, float("inf")])
def test_prime_init_std_is_validated(bad):
    with pytest.raises(ValueError, match="prime_init_std"):
        TTTConfig(prime_init_std=bad).validate()


def test_observation_labels_with_end_add_the_closing_token_only():
    from ds_ttt.model.event_loop import observation_labels

    kinds = torch.tensor([0, 2, 2, 0, 0, 1, 2, 0, 2, 1, -1])
    assert observation_labels(kinds, with_end=False).tolist() == (kinds == 2).tolist()
    got = observation_labels(kinds, with_end=True).nonzero().squeeze(1).tolist()
    assert got == [1, 2, 3, 6, 7, 8]  # an observation followed by an action adds nothing


def test_obs_loss_with_end_changes_only_the_observation_term(tiny_qwen3_config):
    ids, kinds, rounds = trajectory()
    outs = {}
    for with_end in (False, True):
        model = make_model(tiny_qwen3_config, adaptive_layers=2, obs_loss_with_end=with_end, obs_loss_weight=1.0)
        with torch.no_grad():
            outs[with_end] = model.trajectory_loss(ids, kinds, rounds, create_graph=False, update=False)
    # ROUND has one observation span closed by a context token per round: one extra label per round
    assert outs[True].num_obs_tokens == outs[False].num_obs_tokens + 3
    torch.testing.assert_close(outs[True].action_nll_sum, outs[False].action_nll_sum)


def tied_config(cfg):
    """The same tiny backbone with Qwen3-0.6B..4B's tied embeddings (no lm_head.weight on disk)."""
    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg.tie_word_embeddings = True
    return cfg


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_tied_and_untied_checkpoints_load(tmp_path, tiny_qwen3_config, tied):
    cfg = tied_config(tiny_qwen3_config) if tied else tiny_qwen3_config
    torch.manual_seed(3)
    hf = Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tied)  # transformers drops the tied copy
    model = load_hf_qwen3(tmp_path, TTTConfig())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 256, (1, 17))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_tied_checkpoint_with_a_differing_head_is_refused(tmp_path, tiny_qwen3_config):
    from safetensors.torch import save_file
    hf = Qwen3ForCausalLM(tied_config(tiny_qwen3_config))
    hf.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1.0
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_hf_qwen3(tmp_path, TTTConfig())


def test_untied_config_without_head_names_the_fix(tmp_path, tiny_qwen3_config):
    Qwen3ForCausalLM(tied_config(tiny_qwen3_config)).save_pretrained(tmp_path)
    import json
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KeyError, match="tie_word_embeddings"):
        load_hf_qwen3(tmp_path, TTTConfig())


def test_tied_embedding_trains_with_the_head(tiny_qwen3_config):
    """The tied matrix is embedding and LM head at once: 'suffix' (which trains the head) and 'all'
    train it, 'prime' does not; its gradient is the sum of both uses."""
    model = make_model(tied_config(tiny_qwen3_config), adaptive_layers=2)
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed
    for scope, trains in (("prime", False), ("suffix", True), ("all", True)):
        model.set_trainable_scope(scope)
        assert embed.requires_grad == trains, scope
    ids, kinds, rounds = trajectory()
    model.trajectory_loss(ids, kinds, rounds).loss.backward()
    both = embed.grad.clone()
    # the same weights untied: the head gradient plus the embedding gradient
    untied = make_model(tiny_qwen3_config, adaptive_layers=2)
    untied.load_state_dict(model.state_dict())
    untied.set_trainable_scope("suffix")
    untied.model.embed_tokens.weight.requires_grad_(True)
    untied.trajectory_loss(ids, kinds, rounds).loss.backward()
    torch.testing.assert_close(both, untied.lm_head.weight.grad + untied.model.embed_tokens.weight.grad)
    assert float(untied.model.embed_tokens.weight.grad.abs().sum()) > 0  # both terms really contribute


def test_first_order_applies_the_write_but_does_not_differentiate_it():
    """first_order: the meta-gradient of g(W'), W' = W - lr*clip(dL/dW), is dg/dW' at W' (the write is a
    constant shift); second order differs by the Hessian term. The step itself is the same."""

    torch.manual_seed(0)
    a, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    inner = lambda w: ((w * a).sum() ** 2 + (w ** 3 * b).sum())  # noqa: E731 - a curved inner loss
    outer = lambda w: (torch.sin(w) * b).sum()  # noqa: E731
    steps = {}
    for first in (False, True):
        res = inner_sgd_step(inner(w), (w,), lr=0.3, max_norm=2.0, create_graph=True, first_order=first)
        (steps[first],) = res.weights
        (grad,) = torch.autograd.grad(outer(steps[first]), w)
        steps[f"grad_{first}"] = grad
    assert torch.equal(steps[True], steps[False])  # the same write
    w_new = steps[True].detach().requires_grad_(True)
    (expected,) = torch.autograd.grad(outer(w_new), w_new)
    assert torch.allclose(steps["grad_True"], expected, rtol=0, atol=1e-12)
    assert not torch.allclose(steps["grad_False"], expected, atol=1e-3)  # second order is not that


def test_first_order_event_loop_keeps_the_loss_and_changes_only_the_meta_gradient():
    cfg = _tiny64()
    ids, kinds, rounds = trajectory(num_rounds=3, vocab=32)
    out = {}
    for first in (False, True):
        model = make_model(cfg, dtype=torch.float64, adaptive_layers=1, prime_intermediate_size=4, inner_lr=0.5,
                           checkpoint_events=False, obs_loss_weight=1.0, first_order=first)
        res = model.trajectory_loss(ids, kinds, rounds)
        res.loss.backward()
        grads = [p.grad.clone() for p in model.adaptive_layers[0].prime_mlp.initial_weights()]
        with torch.no_grad():
            evaluated = model.trajectory_loss(ids, kinds, rounds, create_graph=False).loss
        out[first] = (res.loss.detach(), grads, evaluated)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][2], out[False][2])
    assert all(torch.isfinite(g).all() for g in out[True][1])
    assert any(not torch.allclose(g1, g2) for g1, g2 in zip(out[True][1], out[False][1]))
    with pytest.raises(ValueError, match="first_order must be true or false"):
        TTTConfig(first_order="yes").validate()
