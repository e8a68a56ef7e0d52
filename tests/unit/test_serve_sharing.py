"""What sessions share on the server: one copy of W_0, and the system-prompt cache.

  * every session starts from the same fp32 W_0 storage (AgentModel.initial_weights); an observation
    makes only the matrices it updates the session's own (`fast_matrices="down"`: gate/up stay shared
    for good), so the batched decode runs one product for a shared matrix and stacks only the others,
    with logits equal to each session's own forward; the memory accounting counts owned matrices;
  * round 0 is prefilled as system block + rest: the cache's copy of the block is bit for bit what a
    miss computes (keys/values, key-shift history, logits, replies), the split prefill equals one
    whole-prompt prefill to rounding, the cache is scoped by API key (`salt`), respects the memory
    budget (`admit`), and the server reports its hits as `cached_tokens`.
Run: python -m pytest tests/unit/test_serve_sharing.py
"""

from __future__ import annotations

import pytest
import torch

from ds_ttt.serve import AgentModel, AgentSession
from ds_ttt.serve.batch import WeightStacks, batched_decode_logits, storage_key
from ds_ttt.serve.conversations import ConversationStore, session_bytes
from ds_ttt.serve.openai_api import parse_chat_request
from ds_ttt.serve.prefix_cache import PrefixCache
from ds_ttt.serve.round0 import render_round0
from ds_ttt.serve.session_chunk import run_chunk
from tests.unit.serve_cases import SYSTEM, TASKS, TOOLS, TTT, build_trimmed_export

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """The trimmed export with a key shift (random, so its history matters), a nonzero prime down
    projection, and only the down projections fast (the main job's `fast_matrices`)."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    root = tmp_path_factory.mktemp("trimmed")
    build_trimmed_export(root)
    base = AgentModel.load(root / "export")
    torch.manual_seed(3)
    model = TTTQwen3ForCausalLM(base.model.config, TTTConfig(**TTT, key_shift=2, fast_matrices="down"))
    missing, unexpected = model.load_state_dict(base.model.state_dict(), strict=False)
    assert not unexpected and all("key_shift" in k for k in missing)
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.key_shift.normal_(0, 0.3)
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    return AgentModel(model, base.tokenizer)


def new_session(agent, task=TASKS[0], **kw):
    s = AgentSession(agent, max_new_tokens=16, **kw)
    s.reset(task, system=SYSTEM, tools=TOOLS)
    return s


def test_sessions_share_w0_and_own_only_what_they_update(agent):
    a, b, c = (new_session(agent, t) for t in TASKS[:3])
    for x, y in zip(a.fast_weights, b.fast_weights):
        assert storage_key(x) == storage_key(y)  # one W_0 for all (a copy per session before)
    c.act()
    c.observe(["a result that moves the down projection"])
    gate, up, down = c.fast_weights
    w0 = agent.initial_weights()
    assert storage_key(gate) == storage_key(w0[0]) and storage_key(up) == storage_key(w0[1])
    assert storage_key(down) != storage_key(w0[2]) and not torch.equal(down, w0[2])
    # memory: a session counts its cache and the matrices it owns; W_0 is the store's, once
    cache_bytes = sum(t.nbytes for t in a._state().cache.k + a._state().cache.v)
    assert session_bytes(a) == cache_bytes
    assert session_bytes(c) == sum(t.nbytes for t in c._state().cache.k + c._state().cache.v) + down.nbytes

    # the batch: shared matrices stay one [F, D] product, the diverged one is stacked per row
    rows = [s.fork() for s in (a, b, c)]
    alone = [s.fork() for s in (a, b, c)]
    dr = [s.begin_decode(max_new_tokens=8) for s in rows]
    da = [s.begin_decode(max_new_tokens=8) for s in alone]
    stacks = WeightStacks()
    with torch.inference_mode():
        lr_, la = [d.first_logits() for d in dr], [d.first_logits() for d in da]
        for step in range(6):
            for d, x in zip(dr + da, lr_ + la):
                d.step(x)
            lr_ = list(batched_decode_logits(agent, dr, stacks))
            la = [d.forward_next() for d in da]
            for x, y in zip(lr_, la):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
            if step == 0:
                assert [w.dim() for w in stacks.weights] == [2, 2, 3]  # gate, up shared; down per row
    assert [d.action for d in dr] == [d.action for d in da]


def test_system_prompt_cache_hit_is_bitwise_a_miss(agent):
    cache = PrefixCache(max_entries=2)
    miss = AgentSession(agent, max_new_tokens=16, prefix_cache=cache)
    assert miss.reset(TASKS[1], system=SYSTEM, tools=TOOLS)["cached_tokens"] == 0
    hit = AgentSession(agent, max_new_tokens=16, prefix_cache=cache)
    got = hit.reset(TASKS[1], system=SYSTEM, tools=TOOLS)
    block = render_round0([{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[1]}], TOOLS,
                          agent.tokenizer).block
    assert 0 < block < len(hit.input_ids) and got["cached_tokens"] == block and cache.hits == 1
    plain = new_session(agent, TASKS[1])  # no cache at all
    n = len(plain.input_ids)
    for s in (miss, hit):
        for x, y in zip(s._state().cache.k + s._state().cache.v, plain._state().cache.k + plain._state().cache.v):
            assert torch.equal(x[:, :, :n], y[:, :, :n])
        for x, y in zip(s._state().cache.key_round[1], plain._state().cache.key_round[1]):
            assert torch.equal(x, y)
    assert hit.act() == miss.act() == plain.act()
    # another scope (another API key) does not see the entry
    other = AgentSession(agent, max_new_tokens=16, prefix_cache=cache)
    assert other.reset_messages([{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[1]}],
                                tools=TOOLS, cache_salt="key-b")["cached_tokens"] == 0


def test_split_prefill_equals_one_whole_prefill(agent):
    """System block + rest computes what one causal pass over round 0 computes (to rounding)."""
    s = new_session(agent, TASKS[2])
    ids, n = s.input_ids, len(s.input_ids)
    kv = type(s._state().cache).for_model(agent.model, capacity=n, max_capacity=n)
    with torch.inference_mode():
        run_chunk(agent.model, ids, 0, 0, kv, agent.initial_weights(), [])
    for x, y in zip(s._state().cache.k + s._state().cache.v, kv.k + kv.v):
        torch.testing.assert_close(x[:, :, :n], y, rtol=1e-5, atol=1e-5)


def test_prefix_cache_admit_and_eviction(agent):
    s = new_session(agent)
    n = len(s.input_ids)
    cache = PrefixCache(max_entries=1)
    twin = s._state().cache.clone(n)
    twin.key_tail = None  # (a history that does not end at the block's end is refused)
    cache.admit = lambda nbytes: False  # over the budget: not kept
    cache.store(s.input_ids[:10], twin)
    assert len(cache) == 0
    cache.admit = None
    cache.store(s.input_ids[:10], twin)
    cache.store(s.input_ids[:12], twin)
    assert len(cache) == 1 and cache.nbytes > 0  # the older entry evicted
    fresh = s._state().cache.clone(n)
    assert cache.restore(s.input_ids[:10], fresh) == 0 and cache.restore(s.input_ids[:12], fresh) == 12


def test_server_reports_prompt_cache_hits_per_key(agent):
    store = ConversationStore(agent, max_new_tokens=8, max_context=512, memory_budget=1 << 30)

    def chat(task, owner):
        body = {"model": "export", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
                "tools": TOOLS, "max_tokens": 8, "temperature": 0}
        return store.chat(parse_chat_request(body, served_model="export"), owner=owner)

    first, second, other = chat(TASKS[0], "a"), chat(TASKS[1], "a"), chat(TASKS[2], "b")
    assert first.cached_tokens == 0 and second.cached_tokens > 0 and other.cached_tokens == 0
    mem = store.memory()
    assert mem["prefix_cache_entries"] == 2 and mem["prefix_cache_bytes"] > 0
    assert mem["held_bytes"] >= mem["prefix_cache_bytes"] + store.shared_bytes


def test_row_stats_equal_the_per_row_values():
    """The batched scheduler chooses greedy tokens from row_stats: the same argmax, logsumexp and NLL, bit
    for bit, as Decode.step computes from one row (ties included: the first maximum)."""
    from ds_ttt.serve.decode import row_stats

    torch.manual_seed(0)
    logits = torch.randn(6, 1216)
    logits[2, 7] = logits[2, 900] = logits[2].max() + 1  # a tie: the first index wins
    for row, st in zip(logits, row_stats(logits)):
        lse = torch.logsumexp(row, -1)
        assert st.argmax == int(row.argmax()) and st.lse == float(lse)
        assert st.argmax_nll == float(lse - row[int(row.argmax())])
    assert row_stats(logits)[2].argmax == 7
