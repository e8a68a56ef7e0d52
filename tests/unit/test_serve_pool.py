"""The decode pool (ds_ttt/serve/kv_pool.py) and the batched decode's one attention call per layer.

  * a decode step of B rows makes ONE attention call per layer (not one per row);
  * `pooled_attention` over rows of different lengths, holes and policies (full, window,
    current_round) equals each row's own attention over its visible slice, in fp64;
  * the pool grows (rows and slots) while rows are in it, keeping every row's contents;
  * a cache that leaves the pool gets its slots back in private buffers and frees its row, which the
    next cache reuses; the scheduler leaves no row held after its replies end;
  * batched greedy replies through the pool equal the unbatched ones, under every policy.
Run: python -m pytest tests/unit/test_serve_pool.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_ttt.model.context import ContextPolicy
from ds_ttt.serve import AgentModel, AgentSession
from ds_ttt.serve.batch import batched_decode_logits
from ds_ttt.serve.pooled_chunk import pooled_attention
from ds_ttt.serve.kv_cache import KVCache
from ds_ttt.serve.kv_pool import KVPool
from ds_ttt.serve.scheduler import BatchScheduler
from tests.unit.test_serve import make_model, tok  # noqa: F401 - the tokenizer fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

TASKS = ["List the files.", "Print the date and then the uptime of the machine.", "Say hi.",
         "Find the port of the api service and write it to PORT, then check it."]


def agent_for(tok, policy: str) -> AgentModel:
    return AgentModel(make_model(context_policy=policy, window=6 if policy == "window" else 0), tok)


def started(agent, n: int) -> list:
    decodes = []
    for i in range(n):
        s = AgentSession(agent, max_new_tokens=10)
        s.reset(TASKS[i % len(TASKS)])
        decodes.append(s.begin_decode())
    return decodes


def test_a_decode_step_makes_one_attention_call_per_layer(tok, monkeypatch):
    agent = agent_for(tok, "full")
    decodes = started(agent, 4)
    real = F.scaled_dot_product_attention
    calls = {"n": 0}

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)
    with torch.inference_mode():
        for d in decodes:
            d.step(d.first_logits())
        monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
        batched_decode_logits(agent, decodes, pool=KVPool.for_model(agent.model))
    assert calls["n"] == len(agent.model.model.layers)  # one per layer, whatever B is


@pytest.mark.parametrize("policy", ["full", "window", "current_round"])
def test_pooled_attention_equals_each_rows_own_in_fp64(policy):
    torch.manual_seed(3)
    pol = ContextPolicy(kind=policy, window=5 if policy == "window" else 0)
    rows_total, hkv, hq, cap, d = 7, 2, 6, 40, 8
    k_pool = torch.randn(rows_total, hkv, cap, d, dtype=torch.float64)
    v_pool = torch.randn(rows_total, hkv, cap, d, dtype=torch.float64)
    pool = KVPool([k_pool], [v_pool], max_capacity=cap)
    rows = [5, 0, 3, 2]  # out of order, holes at 1 and 4 (6 is past the span)
    slots = [31, 0, 17, 9]  # lengths differ; slot 0 sees itself only
    los = [pol.visible_from(s) for s in slots]
    span, length = max(rows) + 1, max(slots) + 1
    mask = pool.visibility(rows, los, slots, span, length)
    q = torch.randn(len(rows), hq, 1, d, dtype=torch.float64)
    out = pooled_attention(q, k_pool, v_pool, torch.tensor(rows), span, length, mask)
    for b, (r, lo, slot) in enumerate(zip(rows, los, slots)):
        own = F.scaled_dot_product_attention(q[b:b + 1], k_pool[r:r + 1, :, lo:slot + 1], v_pool[r:r + 1, :, lo:slot + 1],
                                             enable_gqa=True)
        torch.testing.assert_close(out[b:b + 1], own, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out).all()
    # rows 0..B-1 in order: read as one view, no query scatter
    q4 = q[:3]
    out4 = pooled_attention(q4, k_pool, v_pool, None, 3, length, pool.visibility([0, 1, 2], los[:3], slots[:3], 3, length))
    for b in range(3):
        own = F.scaled_dot_product_attention(q4[b:b + 1], k_pool[b:b + 1, :, los[b]:slots[b] + 1],
                                             v_pool[b:b + 1, :, los[b]:slots[b] + 1], enable_gqa=True)
        torch.testing.assert_close(out4[b:b + 1], own, rtol=1e-12, atol=1e-12)


def filled_cache(model, capacity: int, used: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.for_model(model, capacity=capacity, max_capacity=256)
    for layer in range(len(cache.k)):
        shape = (1, cache.k[0].shape[1], used, cache.k[0].shape[3])
        cache.write(layer, 0, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return cache


def test_pool_grows_mid_batch_and_a_leaving_cache_frees_its_row():
    model = make_model()
    pool = KVPool.for_model(model, rows=1, capacity=4)
    a, b, c = filled_cache(model, 8, 5, 1), filled_cache(model, 8, 8, 2), filled_cache(model, 30, 20, 3)
    want = {id(x): ([t[:, :, :x.used].clone() for t in x.k], [t[:, :, :x.used].clone() for t in x.v]) for x in (a, b, c)}
    assert pool.admit(a) == 0 and pool.capacity >= 8
    assert pool.admit(b) == 1 and pool.rows == 2  # rows doubled, a kept
    a.write(0, 5, torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))  # writes go to the row in place
    assert pool.admit(c) == 2 and pool.capacity >= 30 and pool.rows == 4  # slots and rows grown mid-batch
    assert pool.grows == 4 and pool.span == 3 and pool.rows_in_use == 3
    for x in (a, b, c):
        ks, vs = want[id(x)]
        for layer in range(len(ks)):
            assert torch.equal(x.view(layer, 0, ks[layer].shape[2])[0], ks[layer])
            assert torch.equal(x.view(layer, 0, vs[layer].shape[2])[1], vs[layer])
            assert x.k[layer].shape[2] == x.capacity  # its own capacity, not the pool's
    assert torch.equal(a.view(0, 5, 6)[0], torch.ones(1, 2, 1, 8))
    b.leave_pool()
    assert b.pool is None and pool.rows_in_use == 2 and pool.span == 3
    assert torch.equal(b.k[1][:, :, :8], want[id(b)][0][1])  # its slots back in private buffers
    d = filled_cache(model, 8, 3, 4)
    d_v2 = d.v[2][:, :, :3].clone()
    assert pool.admit(d) == 1  # the freed row, reused (lowest first)
    assert torch.equal(d.view(2, 0, 3)[1], d_v2)
    c.leave_pool()
    assert pool.span == 2
    del d  # dropped while pooled (a failed reply): its row is freed
    assert pool.rows_in_use == 1
    with pytest.raises(ValueError, match="another pool"):
        KVPool.for_model(model).admit(a)
    a.leave_pool()
    assert pool.rows_in_use == 0 and pool.rows == 1 and pool.capacity == 1  # the last row out: memory released
    assert pool.admit(b) == 0 and torch.equal(b.k[1][:, :, :8], want[id(b)][0][1])  # and it regrows


@pytest.mark.parametrize("policy", ["full", "window", "current_round"])
def test_batched_replies_through_the_pool_equal_unbatched(tok, policy):
    agent = agent_for(tok, policy)
    mine, theirs = [], []
    for i in range(3):
        s = AgentSession(agent, max_new_tokens=12)
        s.reset(TASKS[i])
        if i == 1:  # one session a round further (current_round: a new round's slots)
            s.act(max_new_tokens=5)
            s.observe(["ok"])
        mine.append(s.fork())
        theirs.append(s.fork())
    scheduler = BatchScheduler(agent, max_batch=8)
    try:
        decodes = [s.begin_decode() for s in mine]
        scheduler.generate(decodes)
        replies = [s.end_decode(d) for s, d in zip(mine, decodes)]
        stats = scheduler.stats()
    finally:
        scheduler.stop()
    assert stats["steps"] > 0 and stats["mean_batch"] > 1
    assert stats["pool"]["rows_in_use"] == 0 and stats["pool"]["admitted"] == 3  # every row given back
    assert all(s._state().cache.pool is None for s in mine)
    for s, t, reply in zip(mine, theirs, replies):
        assert reply == t.act()
        assert s.history[-1].action_ids == t.history[-1].action_ids
        torch.testing.assert_close(torch.tensor(s.history[-1].action_token_nll),
                                   torch.tensor(t.history[-1].action_token_nll), rtol=1e-5, atol=1e-5)
        n = s._state().num_slots
        for x, y in zip(s._state().cache.k, t._state().cache.k):
            torch.testing.assert_close(x[:, :, :n], y[:, :, :n], rtol=1e-5, atol=1e-5)
        assert s.observe(["done"]) == pytest.approx(t.observe(["done"]), rel=1e-5)  # observe after the pool
