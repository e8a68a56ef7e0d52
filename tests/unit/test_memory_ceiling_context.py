"""benchmarks/memory_ceiling_context.py: the nearest-neighbour ideal memory on hand-built keys (identical keys
overwrite and fail a two-key world, distinct ones pass), the context pool against its definition, and the
extracted prime input against what the event loop feeds the prime MLP of a tiny Qwen3; and the soft novelty
pool of benchmarks/memory_ceiling_novelty.py (a second readback's key nearest its own write, not the first
readback's; beta 0 the mean pool; the per-position view against its definition)."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "memory_ceiling_context.py"
C, A, O = 0, 1, 2  # context, action, observation
HEADER = [90, 91, 92]
# Two keys written by rounds 1 and 2 (commands name 10 and 11), read back by rounds 3 and 4.
TWO_KEYS = [([50, 10], [7, 8]), ([50, 11], [5, 6]), ([60, 10], [7, 8]), ([60, 11], [5, 6])]
READBACKS = [{"round": 3}, {"round": 4}]


@pytest.fixture(scope="module")
def mcc():
    spec = importlib.util.spec_from_file_location("memory_ceiling_context", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def world(rounds_spec):
    ids, kinds, rounds = [1, 2], [C, C], [0, 0]
    for r, (act, obs) in enumerate(rounds_spec, start=1):
        for part, kind in ((act, A), (HEADER, C), (obs, O)):
            ids += part
            kinds += [kind] * len(part)
            rounds += [r] * len(part)
    return ids, kinds, rounds


def simulate(mcc, ids, kinds, rounds, vecs, rule="overwrite", window=None):
    from memory_ceiling_keys import simulate_world

    views = {"v": mcc.unit(np.asarray(vecs, dtype=np.float32))}
    return simulate_world(ids, kinds, rounds, READBACKS, mcc.vector_key_fn("v", window), tags=views,
                          write_rule=rule, make_memory=mcc.NearestMemory)


def test_identical_keys_overwrite_and_distinct_keys_pass(mcc):
    ids, kinds, rounds = world(TWO_KEYS)
    same = np.ones((len(ids), 4))
    assert not simulate(mcc, ids, kinds, rounds, same)["passed"]  # the second value overwrites the first
    r = simulate(mcc, ids, kinds, rounds, same, "first")  # one key: every read gets the world's first write, 7
    assert not r["passed"]
    # the key at t: one-hot of the round's name (token 10 or 11) and of the token at t, with some noise
    rng = np.random.default_rng(0)
    name = {r_: act[1] for r_, (act, _) in enumerate(TWO_KEYS, start=1)}
    distinct = np.zeros((len(ids), 200))
    for t, (tok, r_) in enumerate(zip(ids, rounds)):
        distinct[t, name.get(r_, 0)] = 1.0
        distinct[t, 100 + tok] = 1.0
    noisy = distinct + 0.05 * rng.standard_normal(distinct.shape)
    assert simulate(mcc, ids, kinds, rounds, noisy)["passed"]  # read by the nearest, not an exact match
    assert simulate(mcc, ids, kinds, rounds, noisy, window=2)["passed"]
    # without the name the two values share a key again
    no_name = distinct.copy()
    no_name[:, :100] = 0
    assert not simulate(mcc, ids, kinds, rounds, no_name)["passed"]


def test_context_pool_is_a_softmax_pool_over_the_round_or_its_command(mcc):
    rng = np.random.default_rng(1)
    ids, kinds, rounds = world(TWO_KEYS)
    tool_call = 50  # round 1 and 2's command starts at 50; rounds 3 and 4 have none: their command pool is empty
    x = rng.standard_normal((len(ids), 8)).astype(np.float32)
    pooled = mcc.context_pool(x, ids, kinds, rounds)
    cmd = mcc.context_pool(x, ids, kinds, rounds, tool_call)
    for t in range(len(ids)):
        js = [j for j in range(t + 1) if rounds[j] == rounds[t]]
        s = np.array([x[t] @ x[j] for j in js], dtype=np.float64) / np.sqrt(8)
        w = np.exp(s - s.max())
        np.testing.assert_allclose(pooled[t], (w / w.sum()) @ x[js], rtol=1e-5, atol=1e-6)
        cj = [j for j in js if kinds[j] == A and any(ids[i] == tool_call for i in js if i <= j and kinds[i] == A)]
        if not cj:
            assert not cmd[t].any()
            continue
        s = np.array([x[t] @ x[j] for j in cj], dtype=np.float64) / np.sqrt(8)
        w = np.exp(s - s.max())
        np.testing.assert_allclose(cmd[t], (w / w.sum()) @ x[cj], rtol=1e-5, atol=1e-6)


def test_extracted_prime_input_is_what_the_event_loop_feeds_the_prime_mlp(mcc):
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.fast_weights import KeyHistory
    from ds_ttt.model.presets import tiny_qwen3_config
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    torch.manual_seed(0)
    cfg = tiny_qwen3_config(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(adaptive_layers=2, context_policy="current_round", key_shift=3,
                                               round_address=True)).eval()
    with torch.no_grad():  # the key's slow weights away from zero, so the shift and the address matter
        for layer in model.adaptive_layers:
            for p in (layer.prime_mlp.key_shift, layer.prime_mlp.address_query, layer.prime_mlp.address_proj):
                p.normal_(0.0, 0.3)
    ids, kinds, rounds = world(TWO_KEYS)
    views = mcc.hidden_views(model, ids, rounds)
    fed: dict[int, list] = {}
    hooks = [layer.prime_mlp.register_forward_pre_hook(
        lambda _m, args, i=layer.layer_idx: fed.setdefault(i, []).append(args[0][0].detach()))
        for layer in model.adaptive_layers]
    try:
        with torch.no_grad():
            model.trajectory_loss(torch.tensor([ids]), torch.tensor([kinds]), torch.tensor([rounds]), update=False)
    finally:
        for h in hooks:
            h.remove()
    first = model.adaptive_layers[0]
    for layer in model.adaptive_layers:
        real = torch.cat(fed[layer.layer_idx]).numpy()
        assert real.shape == views[f"prime_L{layer.layer_idx}"].shape == (len(ids), 32)
        np.testing.assert_allclose(views[f"prime_L{layer.layer_idx}"], real, rtol=1e-4, atol=1e-5)
    # and it is the key (shift + round address) of the hidden state after attention, x
    key = first.prime_mlp.key(torch.from_numpy(views["x"])[None], KeyHistory(segments_BT=torch.tensor([rounds])))
    np.testing.assert_allclose(views[f"prime_L{first.layer_idx}"], key[0].detach().numpy(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(views["x"], views[f"prime_L{first.layer_idx}"], atol=1e-3)  # the key is not x alone
    assert views["attn"].shape == (len(ids), 4 * 8)


@pytest.fixture(scope="module")
def mcn():
    path = SCRIPT.parent / "memory_ceiling_novelty.py"
    spec = importlib.util.spec_from_file_location("memory_ceiling_novelty", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_soft_novelty_key_tells_the_second_readback_from_the_first(mcc, mcn):
    # Write a (command W(a)), write b (W(b), after W(a)), read a (R(a), after W(b)), read b (R(b), after R(a)):
    # R(a) and R(b) differ only in the name (token 10 vs 11); a random unit vector per token id.
    rng = np.random.default_rng(2)
    emb = mcc.unit(rng.standard_normal((100, 64)))
    w_a, w_b, r_a, r_b = [20, 21, 22, 10, 30], [20, 21, 22, 11, 30], [40, 41, 10, 30], [40, 41, 11, 30]
    prompt = []

    def key(cur, prev, beta):
        return mcc.unit(mcn.soft_novelty_key(emb[cur], emb[prev], beta)[None])[0]

    for beta in (16.0, 64.0):
        written = {"W(a)": key(w_a, prompt, beta), "W(b)": key(w_b, w_a, beta), "R(a)": key(r_a, w_b, beta)}
        read = key(r_b, r_a, beta)
        sims = {k: float(v @ read) for k, v in written.items()}
        assert max(sims, key=sims.get) == "W(b)", sims  # its own write, not the first readback's key
    # the mean pool (beta 0) confuses it with the first readback, the same command up to the name
    written = {"W(a)": key(w_a, prompt, 0.0), "W(b)": key(w_b, w_a, 0.0), "R(a)": key(r_a, w_b, 0.0)}
    read = key(r_b, r_a, 0.0)
    assert max(written, key=lambda k: float(written[k] @ read)) == "R(a)"


def test_soft_novelty_key_with_beta_zero_is_the_mean_pool(mcc, mcn):
    rng = np.random.default_rng(3)
    v = mcc.unit(rng.standard_normal((7, 16)))
    np.testing.assert_allclose(mcn.soft_novelty_key(v[:4], v[4:], 0.0), v[:4].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mcn.soft_novelty_key(v[:4], v[:0], 5.0), v[:4].mean(0), rtol=1e-5, atol=1e-6)
    # a token of the previous command is weighted exp(-beta) against one orthogonal to it
    e = np.eye(3, dtype=np.float32)
    np.testing.assert_allclose(mcn.soft_novelty_weights(e[:2], e[:1], 2.0), np.array([np.exp(-2.0), 1.0]) /
                               (1 + np.exp(-2.0)), rtol=1e-6)


def test_soft_novelty_view_pools_the_round_scope_before_each_position(mcc, mcn):
    # per position p, the key over the round's command tokens (from <tool_call>, 50, on) at positions <= p,
    # against the previous round's command tokens
    rng = np.random.default_rng(4)
    ids, kinds, rounds = world(TWO_KEYS)
    v = mcc.unit(rng.standard_normal((len(ids), 8)))
    view = mcn.soft_novelty_view(v, ids, kinds, rounds, "command", 50, 4.0)
    cmd = {r: [q for q in range(len(ids)) if rounds[q] == r and kinds[q] == A and ids[q] != 60 and
               any(ids[i] == 50 and rounds[i] == r for i in range(q + 1))] for r in range(5)}
    for p in range(len(ids)):
        r = rounds[p]
        cur = [q for q in cmd[r] if q <= p]
        if not cur:
            assert not view[p].any()
            continue
        prev = cmd.get(r - 1, [])
        np.testing.assert_allclose(view[p], mcn.soft_novelty_key(v[cur], v[prev], 4.0), rtol=1e-5, atol=1e-6)


def test_soft_novelty_mean_variant_scores_against_the_previous_rounds_mean(mcc, mcn):
    # score_s = -beta cos(v_s, m), m the mean of the previous round's unit rows, by hand
    rng = np.random.default_rng(5)
    v = mcc.unit(rng.standard_normal((9, 12)))
    cur, prev, beta = v[:4].astype(np.float64), v[4:].astype(np.float64), 3.0
    m = prev.mean(0)
    score = -beta * (cur @ m) / (np.linalg.norm(cur, axis=1) * np.linalg.norm(m))
    w = np.exp(score) / np.exp(score).sum()
    np.testing.assert_allclose(mcn.soft_novelty_weights(v[:4], v[4:], beta, "mean"), w, rtol=1e-6)
    np.testing.assert_allclose(mcn.soft_novelty_key(v[:4], v[4:], beta, "mean"), w @ cur, rtol=1e-5, atol=1e-6)
    # not the max-cosine score (a check that can tell the two apart), and the sum scores as the mean
    assert not np.allclose(mcn.soft_novelty_weights(v[:4], v[4:], beta, "max"), w, rtol=1e-3)
    np.testing.assert_allclose(mcn.soft_novelty_weights(v[:4], v[4:], beta, "mean"),
                               mcn.soft_novelty_weights(v[:4], np.concatenate([v[4:], v[4:]]), beta, "mean"))
    # no previous round: every score 0, the mean pool
    np.testing.assert_allclose(mcn.soft_novelty_key(v[:4], v[:0], beta, "mean"), v[:4].mean(0), rtol=1e-5, atol=1e-6)


def test_soft_novelty_mean_variant_tells_the_second_readback_from_the_first(mcc, mcn):
    # as test_soft_novelty_key_tells_the_second_readback_from_the_first, R(a) and R(b) differing in one token
    rng = np.random.default_rng(2)
    emb = mcc.unit(rng.standard_normal((100, 64)))
    w_a, w_b, r_a, r_b = [20, 21, 22, 10, 30], [20, 21, 22, 11, 30], [40, 41, 10, 30], [40, 41, 11, 30]

    def key(cur, prev, beta):
        return mcc.unit(mcn.soft_novelty_key(emb[cur], emb[prev], beta, "mean")[None])[0]

    for beta in (16.0, 64.0):
        written = {"W(a)": key(w_a, [], beta), "W(b)": key(w_b, w_a, beta), "R(a)": key(r_a, w_b, beta)}
        read = key(r_b, r_a, beta)
        sims = {k: float(v @ read) for k, v in written.items()}
        assert max(sims, key=sims.get) == "W(b)", sims
    written = {"W(a)": key(w_a, [], 0.0), "W(b)": key(w_b, w_a, 0.0), "R(a)": key(r_a, w_b, 0.0)}
    assert max(written, key=lambda k: float(written[k] @ key(r_b, r_a, 0.0))) == "R(a)"
