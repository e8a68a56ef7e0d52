"""Batched decode across sessions, and the bounded loopback load test.

  * `batched_decode_logits` over B sessions with different histories and fast weights (and a model
    with the key shift, whose per-row history must carry across decode steps) equals each session's
    unbatched forward; replies decoded by the BatchScheduler at temperature 0 are token for token the
    replies of the unbatched path, with the same NLLs and the same fast weights after observing;
  * the server with the BatchScheduler: concurrent multi-round tool loops give exactly what each
    conversation gives alone on the unbatched server;
  * load (bounded: 32 sessions x 3 rounds, a deadline): 32 concurrent tool loops through the real
    `openai` client, malformed requests mixed in, a client that disconnects mid-stream. The server
    stays up, the memory held stays within its budget, no conversation sees another's tokens or
    updates (each one's messages and fast weights are its own), every error is an OpenAI error object.
Run: python -m pytest tests/unit/test_serve_batch.py
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest
import torch

from ds_ttt.serve import AgentModel, AgentSession
from ds_ttt.serve.batch import batched_decode_logits
from ds_ttt.serve.conversations import ConversationStore
from ds_ttt.serve.scheduler import BatchScheduler, DirectEngine
from ds_ttt.serve.session import DecodeOptions
from tests.unit.serve_cases import SYSTEM, TASKS, TOOLS, TTT, build_trimmed_export
from tests.unit.test_serve_fleet import client, is_error_object, serving, start

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    root = tmp_path_factory.mktemp("trimmed")
    build_trimmed_export(root)
    return AgentModel.load(root / "export")


@pytest.fixture(scope="module")
def shift_agent(agent):
    """The same model with a key shift of width 2 (random, so the history matters) and a nonzero
    prime down projection (so per-row W matters)."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    torch.manual_seed(1)
    model = TTTQwen3ForCausalLM(agent.model.config, TTTConfig(**TTT, key_shift=2))
    missing, unexpected = model.load_state_dict(agent.model.state_dict(), strict=False)
    assert not unexpected and all("key_shift" in k for k in missing)
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.key_shift.normal_(0, 0.3)
            layer.prime_mlp.down_proj.weight.normal_(0, 0.05)
    return AgentModel(model, agent.tokenizer)


@pytest.fixture(scope="module")
def address_agent(agent):
    """The same model with a key shift, the round address and the write rate, all random (so the
    address's running pool matters), under current_round."""
    from ds_ttt.config import TTTConfig
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    torch.manual_seed(2)
    ttt = TTTConfig(**{**TTT, "context_policy": "current_round", "window": 0}, key_shift=2, round_address=True,
                    write_rate=True)
    model = TTTQwen3ForCausalLM(agent.model.config, ttt)
    missing, unexpected = model.load_state_dict(agent.model.state_dict(), strict=False)
    assert not unexpected and all(k.split(".prime_mlp.")[-1] in ("key_shift", "address_query", "address_proj",
                                                                 "write_rate", "write_rate_bias") for k in missing)
    with torch.no_grad():
        for layer in model.adaptive_layers:
            p = layer.prime_mlp
            for t, std in ((p.key_shift, 0.3), (p.address_query, 1.0), (p.address_proj, 0.2), (p.write_rate, 1.0)):
                if t is not None:
                    t.normal_(0, std)
            p.down_proj.weight.normal_(0, 0.05)
    return AgentModel(model, agent.tokenizer)


def sessions(agent, outputs_per_session):
    """Sessions at different points: task i, then one observed tool result per output (own W each)."""
    out = []
    for i, outputs in enumerate(outputs_per_session):
        s = AgentSession(agent, max_new_tokens=24)
        s.reset(TASKS[i % len(TASKS)], system=SYSTEM, tools=TOOLS)
        for o in outputs:
            s.act()
            s.observe([o])
        out.append(s)
    return out


@pytest.mark.parametrize("which", ["agent", "shift_agent", "address_agent"])
def test_batched_forward_equals_each_sessions_own(which, request):
    ag = request.getfixturevalue(which)
    base = sessions(ag, [[], ["ok"], ["a longer output\nwith lines"], ["x", "y"]])
    assert len({float(s.fast_weights[-1].detach().sum()) for s in base}) == 4  # four different W
    mine, theirs = [s.fork() for s in base], [s.fork() for s in base]
    dm = [s.begin_decode(max_new_tokens=12) for s in mine]
    dt = [s.begin_decode(max_new_tokens=12) for s in theirs]
    with torch.inference_mode():
        lm = [d.first_logits() for d in dm]
        lt = [d.first_logits() for d in dt]
        for _ in range(8):  # eight decode steps, each row its own position, slot, cache, W, history
            for d, x in zip(dm + dt, lm + lt):
                d.step(x)
            assert [d.action for d in dm] == [d.action for d in dt]
            lm = list(batched_decode_logits(ag, dm))
            lt = [d.forward_next() for d in dt]
            for a, b in zip(lm, lt):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_batch_scheduler_replies_are_the_unbatched_replies(agent):
    scheduler = BatchScheduler(agent, max_batch=8)
    try:
        for opts in (DecodeOptions(), DecodeOptions(logprobs=True, top_logprobs=2, stop=("echo",))):
            base = sessions(agent, [[], ["ok"], ["one", "two"], ["three"], []])
            a, b = [s.fork() for s in base], [s.fork() for s in base]
            da = [s.begin_decode(max_new_tokens=40, options=opts) for s in a]
            db = [s.begin_decode(max_new_tokens=40, options=opts) for s in b]
            threads = [threading.Thread(target=scheduler.generate, args=([d],)) for d in db]
            for t in threads:  # one generate per request, concurrently: they share the batch
                t.start()
            for t in threads:
                t.join(timeout=300)
            DirectEngine().generate(da)
            ma = [s.end_decode(d) for s, d in zip(a, da)]
            mb = [s.end_decode(d) for s, d in zip(b, db)]
            la, lb = [m.pop("logprobs", None) for m in ma], [m.pop("logprobs", None) for m in mb]
            assert ma == mb
            for xa, xb in zip(la, lb):  # the same tokens; their logprobs equal to float rounding
                assert (xa is None) == (xb is None)
                for ea, eb in zip(xa or [], xb or []):
                    assert ea["token"] == eb["token"] and abs(ea["logprob"] - eb["logprob"]) < 1e-4
                    assert [t["token"] for t in ea["top_logprobs"]] == [t["token"] for t in eb["top_logprobs"]]
            for x, y in zip(a, b):
                assert x.input_ids == y.input_ids
                torch.testing.assert_close(x.history[-1].action_token_nll, y.history[-1].action_token_nll,
                                           rtol=1e-4, atol=1e-4)
                x.observe(["next"]), y.observe(["next"])  # the inner step after a batched reply is exact
                for wx, wy in zip(x.fast_weights, y.fast_weights):
                    torch.testing.assert_close(wx, wy, rtol=1e-5, atol=1e-6)
        assert scheduler.steps > 0 and scheduler.rows / scheduler.steps > 1.5  # rows really shared forwards
        stats = scheduler.stats()  # GET /health "scheduler": the counters benchmarks/serve_concurrency.py reads
        assert stats["rows"] == scheduler.rows and stats["decode_seconds"] > 0 and stats["chunk_seconds"] > 0
    finally:
        scheduler.stop()


def tool_loop(url, task, tag, rounds, key="unused"):
    """A conversation through the real client: `rounds` replies, each tool call answered with
    'out {tag} {round}'; returns (messages, session id, ttt of every reply)."""
    c = client(url, key)
    msgs, sid, seen = start(task), None, []
    for k in range(rounds):
        r = c.chat.completions.create(model="export", messages=msgs, tools=TOOLS, max_tokens=40,
                                      extra_body={"session_id": sid} if sid else None)
        ttt = r.model_extra["ttt"]
        sid = sid or ttt["session_id"]
        assert ttt["session_id"] == sid
        seen.append(ttt)
        msg = r.choices[0].message
        msgs.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": f"out {tag} {k}"})
    return msgs, sid, seen


def test_batched_server_equals_the_unbatched_server(agent):
    work = [(TASKS[i % len(TASKS)], f"s{i}") for i in range(4)]
    results = {}
    for name, engine in (("direct", DirectEngine()), ("batched", BatchScheduler(agent, max_batch=8))):
        store = ConversationStore(agent, max_sessions=16, max_new_tokens=40, engine=engine)
        with serving(store) as url:
            with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
                out = list(pool.map(lambda tw: tool_loop(url, tw[0], tw[1], 3), work))
            results[name] = [(msgs, [t["updates"] for t in seen],
                              [w.clone() for w in store.get(sid).session.fast_weights]) for msgs, sid, seen in out]
        if name == "batched":
            assert engine.rows / max(engine.steps, 1) > 1.5
    for (ma, ua, wa), (mb, ub, wb) in zip(results["direct"], results["batched"]):
        strip = [{k: v for k, v in m.items() if k != "tool_calls"} | {"calls": [c["function"] for c in
                                                                               m.get("tool_calls") or []]}
                 for m in ma]
        strip_b = [{k: v for k, v in m.items() if k != "tool_calls"} | {"calls": [c["function"] for c in
                                                                                 m.get("tool_calls") or []]}
                   for m in mb]
        assert [{k: v for k, v in m.items() if k != "tool_call_id"} for m in strip] == \
            [{k: v for k, v in m.items() if k != "tool_call_id"} for m in strip_b]
        assert ua == ub
        for x, y in zip(wa, wb):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_load_32_sessions_malformed_requests_and_a_disconnect(agent):
    num, rounds, deadline_sec = 32, 3, 400
    probe = ConversationStore(agent, max_new_tokens=40, max_context=512)
    budget = 40 * (probe.weight_bytes + probe.slot_bytes * 512)
    engine = BatchScheduler(agent, max_batch=16)
    store = ConversationStore(agent, max_sessions=64, max_new_tokens=40, max_context=512, memory_budget=budget,
                              max_active=16, max_queue=64, busy_timeout=300, engine=engine)
    peak = {"bytes": 0}
    stop = threading.Event()

    def watch():
        while not stop.wait(0.05):
            m = store.memory()
            peak["bytes"] = max(peak["bytes"], m["held_bytes"] + m["reserved_bytes"])
    errors = []

    def malformed(url):
        bodies = [b"{nope", json.dumps({"model": "export", "messages": []}).encode(),
                  json.dumps({"model": "export", "messages": start(), "temperature": "hot"}).encode(),
                  json.dumps({"model": "export", "messages": start(), "session_id": "sess-none"}).encode(),
                  json.dumps({"model": "export", "messages": start("word " * 700)}).encode()]
        for body in bodies:
            r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                           timeout=300)
            errors.append((r.status_code, is_error_object(r)))

    def disconnect(url):
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300,
                          json={"model": "export", "messages": start("Go away."), "tools": TOOLS, "max_tokens": 40,
                                "stream": True}) as r:
            next(r.iter_lines())
    started = time.time()
    threading.Thread(target=watch, daemon=True).start()
    with serving(store) as url:
        with concurrent.futures.ThreadPoolExecutor(num + 2) as pool:
            loops = [pool.submit(tool_loop, url, TASKS[i % len(TASKS)], f"s{i}", rounds) for i in range(num)]
            extra = [pool.submit(malformed, url), pool.submit(disconnect, url)]
            done = [f.result(timeout=deadline_sec) for f in loops]
            for f in extra:
                f.result(timeout=deadline_sec)
        assert httpx.get(f"{url}/health").json()["status"] == "ok"  # still up
    stop.set()
    assert time.time() - started < deadline_sec
    assert peak["bytes"] <= budget, (peak, budget)
    assert errors and all(status in (400, 404) and ok for status, ok in errors), errors
    # no leakage: each conversation holds its own messages only, and its updates are its own rounds
    sids = [sid for _, sid, _ in done]
    assert len(set(sids)) == num
    for i, (msgs, sid, seen) in enumerate(done):
        stored = store.get(sid).session
        tool_texts = [m["content"] for m in stored.messages if m["role"] == "tool"]
        assert all(t.startswith(f"out s{i} ") for t in tool_texts), (i, tool_texts)
        assert [t["updates"] for t in seen] == list(range(len(seen)))
    # ... and equal fast weights to the same conversation run alone (a sample of them)
    for i in (0, 17, 31):
        msgs, sid, seen = done[i]
        stored = store.get(sid).session
        alone = AgentSession(agent, max_new_tokens=40, max_context=512)
        alone.reset(TASKS[i % len(TASKS)], system=SYSTEM, tools=TOOLS)
        for k in range(stored.num_updates):
            alone.act()
            alone.observe([f"out s{i} {k}"])
        assert alone.num_updates == stored.num_updates == len(seen) - 1
        for a, b in zip(stored.fast_weights, alone.fast_weights):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
