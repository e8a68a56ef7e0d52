"""The batched prefill (ds_ttt/serve/prefill.py): several new sessions' round 0 in one padded forward.

  * batched_prefill over sessions of different task lengths (with and without a system block from the
    prefix cache; a model with a key state, whose rows are grouped by length) gives the caches, key
    state and first-reply logits of the one-at-a-time prefill, under every context policy, with one
    attention call per layer per batch;
  * the BatchScheduler prefills new sessions that wait together in one batch, and their greedy
    replies equal the unbatched ones.
Tolerance: the padded batch reduces in another order (longer key rows, a larger matrix product), so
the comparison is to fp32 rounding accumulated over the layers (1e-5), not bit for bit.
Run: python -m pytest tests/unit/test_serve_prefill.py
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from ds_ttt.serve import AgentModel, AgentSession
from ds_ttt.serve.kv_pool import KVPool
from ds_ttt.serve.prefill import batched_prefill
from ds_ttt.serve.prefix_cache import PrefixCache
from ds_ttt.serve.round0 import render_round0
from ds_ttt.serve.scheduler import BatchScheduler
from tests.unit.test_serve import make_model, tok  # noqa: F401 - the tokenizer fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

TASKS = ["List the files.", "Print the date and then the uptime of the machine, twice.", "Say hi.",
         "Find the port of the api service and write it to PORT, then check it.", "Say ho."]
SYSTEM = "You are a careful terminal agent."


def messages(i: int, system: bool) -> list[dict]:
    return ([{"role": "system", "content": SYSTEM}] if system else []) + [{"role": "user", "content": TASKS[i]}]


def assert_same_round0(a: AgentSession, b: AgentSession) -> None:
    sa, sb = a._state(), b._state()
    assert sa.ids == sb.ids and sa.prompt_slots == sb.prompt_slots and sa.cache.pool is None
    n = sa.num_slots
    for x, y in zip(sa.cache.k + sa.cache.v, sb.cache.k + sb.cache.v):
        torch.testing.assert_close(x[:, :, :n], y[:, :, :n], rtol=1e-5, atol=1e-5)
    assert sa.cache.key_round[0] == sb.cache.key_round[0] == n
    for x, y in zip(sa.cache.key_round[1], sb.cache.key_round[1]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    da, db = a.begin_decode(max_new_tokens=4), b.begin_decode(max_new_tokens=4)
    with torch.inference_mode():
        torch.testing.assert_close(da.first_logits(), db.first_logits(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy,ttt", [("full", {}), ("window", {"window": 5}), ("current_round", {}),
                                        ("current_round", {"key_shift": 2})])
def test_batched_prefill_equals_one_at_a_time(tok, policy, ttt, monkeypatch):
    model = make_model(context_policy=policy, **ttt)
    if ttt.get("key_shift"):
        with torch.no_grad():
            for layer in model.adaptive_layers:
                layer.prime_mlp.key_shift.normal_(0, 0.3)
    agent = AgentModel(model, tok)
    prefix = PrefixCache()
    alone, batched = [], []
    cases = [(0, True), (1, True), (2, False), (3, False), (4, True)]  # "Say hi." / "Say ho.": equal lengths
    for i, system in cases:
        s = AgentSession(agent, prefix_cache=prefix)
        s.reset_messages(messages(i, system))
        alone.append(s)
    r0s = []
    for i, system in cases:
        s = AgentSession(agent, prefix_cache=prefix)
        r0s.append(s.begin_reset(messages(i, system)))
        batched.append(s)
    assert [r0.cached > 0 for r0 in r0s] == [system for _, system in cases]  # blocks from the prefix cache
    real = F.scaled_dot_product_attention
    calls = {"n": 0}

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    pool = KVPool.for_model(model)
    batched_prefill(agent, r0s, pool)
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    groups = len({len(r0.rest) for r0 in r0s}) if ttt.get("key_shift") else 1
    assert calls["n"] == groups * len(model.model.layers)
    assert pool.rows_in_use == 0
    for s, r0 in zip(batched, r0s):
        s.end_reset(r0)
    for a, b in zip(batched, alone):
        assert_same_round0(a, b)


def test_scheduler_prefills_waiting_sessions_together(tok):
    agent = AgentModel(make_model(context_policy="current_round"), tok)
    scheduler = BatchScheduler(agent, max_batch=8)
    entered, gate = threading.Event(), threading.Event()
    try:
        blocker = threading.Thread(target=scheduler.run, args=(lambda: entered.set() or gate.wait(),))
        blocker.start()  # the scheduler waits inside this chunk while the resets queue up
        entered.wait(60)  # (a reset queued before the scheduler took the chunk would be run with it, alone)
        mine = [AgentSession(agent, max_new_tokens=8) for _ in range(4)]
        results = [None] * 4
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, scheduler.reset(mine[i], messages(i, True)))) for i in range(4)]
        for t in threads:
            t.start()
        while len(scheduler._resets) < 4:
            threading.Event().wait(0.01)
        gate.set()
        for t in threads + [blocker]:
            t.join(60)
        assert scheduler.prefill_batches == 1 and scheduler.prefill_rows == 4
        decodes = [s.begin_decode() for s in mine]
        scheduler.generate(decodes)
        replies = [s.end_decode(d) for s, d in zip(mine, decodes)]
    finally:
        gate.set()
        scheduler.stop()
    for i, (s, reply) in enumerate(zip(mine, replies)):
        t = AgentSession(agent, max_new_tokens=8)
        assert results[i] == t.reset_messages(messages(i, True))
        assert reply == t.act()
        assert s.history[-1].action_ids == t.history[-1].action_ids


def test_a_second_reset_does_not_read_the_previous_episode(tok):
    """Round 0 of a new episode is one segment, whatever the session's previous episode was: a reset whose
    system block ends exactly where the previous episode's round 0 ended (its prompt_slots) gives the
    state of a fresh session (failed on the code before: the rest of round 0 took that slot for a new
    round's start and restarted the key state there)."""
    model = make_model(context_policy="current_round", key_shift=2, adaptive_layers=2)  # the first one's key
    with torch.no_grad():  # state reaches the second one's keys/values in the cache
        for layer in model.adaptive_layers:
            layer.prime_mlp.key_shift.normal_(0, 0.3)
    agent = AgentModel(model, tok)
    first = AgentSession(agent)
    first.reset_messages(messages(0, True))
    target = first._state().prompt_slots
    system, words = SYSTEM, 0
    while True:  # lengthen the system prompt until its block is exactly the first episode's round 0
        block = render_round0([{"role": "system", "content": system}, {"role": "user", "content": "x"}], None, tok).block
        if block >= target:
            break
        words += 1
        system = SYSTEM + " ok" * words
    assert block == target, f"no system prompt of {target} block tokens found (got {block})"
    second = [{"role": "system", "content": system}, {"role": "user", "content": TASKS[1]}]
    first.reset_messages(second)
    fresh = AgentSession(agent)
    fresh.reset_messages(second)
    sa, sb = first._state(), fresh._state()
    assert sa.ids == sb.ids
    n = sa.num_slots
    for x, y in zip(sa.cache.k + sa.cache.v + sa.cache.key_round[1], sb.cache.k + sb.cache.v + sb.cache.key_round[1]):
        assert torch.equal(x[..., :n, :] if x.dim() == 4 else x, y[..., :n, :] if y.dim() == 4 else y)
    da, db = first.begin_decode(max_new_tokens=4), fresh.begin_decode(max_new_tokens=4)
    with torch.inference_mode():
        assert torch.equal(da.first_logits(), db.first_logits())
