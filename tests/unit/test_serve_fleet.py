"""The OpenAI-compatible server in front of an agent fleet: the fields harnesses send, its own replies
accepted back, API keys and session ownership, copy-on-write reuse, bounds, cancellation, seeds.

Every test talks to a real uvicorn server on 127.0.0.1 (an ephemeral port) with the real `openai`
client (or httpx for what the client cannot send), serving the tiny tool-calling export of
tests/unit/serve_cases.py. Batched decoding and the load test: tests/unit/test_serve_batch.py.
Run: python -m pytest tests/unit/test_serve_fleet.py
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
import torch

from ds_ttt.serve import AgentModel, AgentSession
from ds_ttt.serve.conversations import ConversationStore
from ds_ttt.serve.frontends.http import bind, create_app, make_server
from ds_ttt.serve.scheduler import DirectEngine
from ds_ttt.serve.session import DecodeOptions
from tests.unit.serve_cases import SYSTEM, TASKS, TOOL_COMMAND, TOOLS, build_trimmed_export

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    root = tmp_path_factory.mktemp("trimmed")
    build_trimmed_export(root)
    return AgentModel.load(root / "export")


@contextlib.contextmanager
def serving(store: ConversationStore, **app_options):
    sock = bind("127.0.0.1", 0)
    srv = make_server(create_app(store, "export", **app_options), sock)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        store.engine.stop()


def client(url, key="unused"):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)


def start(task=TASKS[3]):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def is_error_object(r: httpx.Response) -> bool:
    err = r.json().get("error")
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])


class SlowEngine(DirectEngine):
    """The direct path with a pause per generated token (so a client can go away mid-reply), and a
    record of the store's memory while requests run."""

    def __init__(self, store_ref: list, pause: float = 0.0):
        self.store_ref, self.pause, self.seen = store_ref, pause, []

    def run(self, fn, cancel=None):
        self.seen.append(self.store_ref[0].memory())
        return super().run(fn, cancel)

    def generate(self, decodes, cancel=None):
        for d in decodes:
            inner = d.on_token

            def on_token(tok, inner=inner):
                time.sleep(self.pause)
                if inner is not None:
                    inner(tok)
            d.on_token = on_token
        return super().generate(decodes, cancel)


# ---- the fields harnesses send ------------------------------------------------------------------
def test_fields_harnesses_send(agent, capfd):
    store = ConversationStore(agent, max_sessions=16, max_new_tokens=48, max_context=512)
    with serving(store, max_tokens_cap=64) as url:
        c = client(url)
        card = c.models.list().data[0]
        assert card.model_extra["context_length"] == 512 and card.model_extra["max_model_len"] == 512
        base = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=48)
        assert base.choices[0].finish_reason == "tool_calls"
        # stop null / a string / a list; parallel_tool_calls false; unknown fields ignored (and logged)
        for extra in ({"stop": None}, {"stop": ["\n\n\n\n"]}, {"parallel_tool_calls": False},
                      {"tool_choice": "auto"}, {"frobnicate": 1}):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": start(), "tools": TOOLS,
                                                                "max_tokens": 48, **extra}, timeout=600)
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"] == \
                base.choices[0].message.tool_calls[0].function.model_dump(), extra
        assert "ignored unknown request field(s): frobnicate" in capfd.readouterr().err
        # a stop string cuts the reply before it (finish "stop", no tool call)
        r = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=48, stop="<tool_call>")
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
        assert "<tool_call>" not in (r.choices[0].message.content or "")
        # tool_choice none: no tool call is generated; required / named: a call of the tool
        r = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=48, tool_choice="none")
        assert not r.choices[0].message.tool_calls and "<tool_call>" not in (r.choices[0].message.content or "")
        for choice in ("required", {"type": "function", "function": {"name": "bash"}}):
            r = c.chat.completions.create(model="export", messages=start(TASKS[0]), tools=TOOLS, max_tokens=48,
                                          tool_choice=choice)
            calls = r.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "bash", (choice, r.choices[0].message)
        bad = httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": start(), "tools": TOOLS,
                                                              "tool_choice": {"type": "function",
                                                                              "function": {"name": "python"}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
        # logprobs / top_logprobs: one entry per generated token, the greedy token is the top one
        r = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=48, logprobs=True,
                                      top_logprobs=3)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens - 1  # all but the closing <|im_end|>
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        text = "".join(e.token for e in content)
        assert TOOL_COMMAND in text
        # sampling edge cases: top_p 0 with a temperature is the greedy token (was a 500)
        r = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=48, temperature=1.0,
                                      top_p=0.0)
        assert r.choices[0].message.tool_calls[0].function == base.choices[0].message.tool_calls[0].function
        # n > 1: each choice is a conversation of its own
        r = c.chat.completions.create(model="export", messages=start(TASKS[2]), tools=TOOLS, max_tokens=48, n=3,
                                      temperature=1.0)
        ids = [ch.model_extra["ttt"]["session_id"] for ch in r.choices]
        assert len(r.choices) == 3 and len(set(ids)) == 3 and r.model_extra["ttt"]["session_id"] == ids[0]
        assert r.usage.completion_tokens == sum(len(store.get(i).session.history[-1].action_token_nll) for i in ids)
        # the max_tokens cap and the served context length
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": start(), "max_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "export",
                                                            "messages": start("word " * 600)}, timeout=600)
        assert r.status_code == 400 and "maximum context length is 512 tokens" in r.json()["error"]["message"]


def test_decode_options_end_ban_and_force(agent):
    """parallel_tool_calls=false ends the action at its first </tool_call>; a banned id is never chosen;
    forced ids follow </think>. Driven with chosen logits (the tiny model writes one call anyway)."""
    tok = agent.tokenizer
    close, open_, think_end = (tok.convert_tokens_to_ids(t) for t in ("</tool_call>", "<tool_call>", "</think>"))
    s = AgentSession(agent, max_new_tokens=16)
    s.reset(TASKS[0], system=SYSTEM, tools=TOOLS)
    V = agent.model.config.vocab_size

    def onehot(i):
        x = torch.full((V,), -10.0)
        x[i] = 10.0
        return x
    for end, keeps_going in (((close,), False), ((), True)):
        d = s.begin_decode(options=DecodeOptions(end_ids=end))
        assert d.step(onehot(close)) is keeps_going
    d = s.begin_decode(options=DecodeOptions(ban_ids=(open_,)))
    d.step(onehot(open_))
    assert d.action[-1] != open_
    forced = tuple(tok.encode('\n\n<tool_call>\n{"name":', add_special_tokens=False))
    d = s.begin_decode(options=DecodeOptions(force_after_think=forced))
    d.step(onehot(think_end))
    for f in forced:
        d.step(onehot(close))  # whatever the logits say
    assert d.action == [think_end, *forced]


def test_the_server_accepts_its_own_reply_cut_inside_a_tool_call(agent):
    store = ConversationStore(agent, max_sessions=8, max_new_tokens=48)
    with serving(store) as url:
        c = client(url)
        for budget in range(4, 30):
            r = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=budget)
            if r.choices[0].finish_reason == "length" and "<tool_call>" in (r.choices[0].message.content or ""):
                break
        else:
            pytest.fail("no budget cut the reply inside its tool call")
        sid = r.model_extra["ttt"]["session_id"]
        n = len(store.get(sid).session.input_ids)
        sent = start() + [r.choices[0].message.model_dump(exclude_none=True),
                          {"role": "user", "content": "Your reply was cut; go on."}]
        r2 = c.chat.completions.create(model="export", messages=sent, tools=TOOLS, max_tokens=48,
                                       extra_body={"session_id": sid})
        assert r2.model_extra["ttt"]["session_id"] == sid  # the same session continued, no replay
        assert r2.usage.prompt_tokens_details.cached_tokens == n and r2.model_extra["ttt"]["updates"] == 1
        # a chat-control token other than the tool-call markup is still refused in assistant text
        bad = [*start(), {"role": "assistant", "content": "x<|im_start|>"}, {"role": "user", "content": "go"}]
        e = httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": bad})
        assert e.status_code == 400 and e.json()["error"]["param"] == "messages[2].content"


# ---- access and isolation -----------------------------------------------------------------------
def test_api_keys_and_session_ownership(agent):
    store = ConversationStore(agent, max_sessions=8, max_new_tokens=48, busy_timeout=0.5)
    with serving(store, api_keys=["sk-a", "sk-b"]) as url:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-a"}):
            for r in (httpx.get(f"{url}/v1/models", headers=headers),
                      httpx.post(f"{url}/v1/chat/completions", headers=headers,
                                 json={"model": "export", "messages": start()})):
                assert r.status_code == 401 and is_error_object(r) and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health").status_code == 200
        a, b = client(url, "sk-a"), client(url, "sk-b")
        r = a.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=48)
        sid = r.model_extra["ttt"]["session_id"]
        call = r.choices[0].message.tool_calls[0]
        more = start() + [r.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
        hb = {"Authorization": "Bearer sk-b"}
        # another key can neither read, continue nor delete it: to that key it does not exist
        assert httpx.get(f"{url}/v1/sessions/{sid}", headers=hb).status_code == 404
        assert httpx.delete(f"{url}/v1/sessions/{sid}", headers=hb).status_code == 404
        r = httpx.post(f"{url}/v1/chat/completions", headers=hb, json={"model": "export", "messages": more,
                                                                        "tools": TOOLS, "session_id": sid})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        # nor find it by prefix: the same messages from key b start from scratch
        r = b.chat.completions.create(model="export", messages=more, tools=TOOLS, max_tokens=48)
        assert r.model_extra["ttt"]["session_id"] != sid and r.usage.prompt_tokens_details.cached_tokens == 0
        assert store._convs[sid].session.round == 1  # untouched
        # the owner can
        ha = {"Authorization": "Bearer sk-a"}
        assert httpx.get(f"{url}/v1/sessions/{sid}", headers=ha).json()["round"] == 1
        assert httpx.delete(f"{url}/v1/sessions/{sid}", headers=ha).json()["deleted"] is True
        assert httpx.get(f"{url}/v1/sessions/{sid}", headers=ha).status_code == 404


def test_prefix_reuse_is_copy_on_write(agent):
    store = ConversationStore(agent, max_sessions=8, max_new_tokens=48, busy_timeout=0.5)
    with serving(store) as url:
        c = client(url)
        r = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=48)
        sid = r.model_extra["ttt"]["session_id"]
        call = r.choices[0].message.tool_calls[0]
        conv = store.get(sid)
        before = (conv.session, len(conv.session.input_ids), [w.clone() for w in conv.session.fast_weights])
        more = start() + [r.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
        conv.lock.acquire()  # the original is busy: the copy neither waits for it nor touches it
        try:
            r = c.chat.completions.create(model="export", messages=more, tools=TOOLS, max_tokens=48)
        finally:
            conv.lock.release()
        assert r.model_extra["ttt"]["session_id"] != sid and r.model_extra["ttt"]["updates"] == 1
        assert r.usage.prompt_tokens_details.cached_tokens == before[1]
        assert store.get(sid) is conv and conv.session is before[0] and len(conv.session.input_ids) == before[1]
        assert all(torch.equal(a, b) for a, b in zip(conv.session.fast_weights, before[2]))
        # the owner continues its own conversation by id, unaffected
        r = c.chat.completions.create(model="export", messages=more, tools=TOOLS, max_tokens=48,
                                      extra_body={"session_id": sid})
        assert r.model_extra["ttt"]["session_id"] == sid and r.model_extra["ttt"]["updates"] == 1


# ---- bounds -------------------------------------------------------------------------------------
def test_body_limit_queue_429_and_memory_budget(agent):
    probe = ConversationStore(agent, max_new_tokens=48, max_context=256)
    one = probe.weight_bytes + probe.slot_bytes * 256  # a session at the full context
    ref: list = []
    engine = SlowEngine(ref)
    store = ConversationStore(agent, max_sessions=16, max_new_tokens=48, max_context=256, memory_budget=2 * one,
                              max_active=1, max_queue=0, busy_timeout=0.5, retry_after=3, engine=engine)
    ref.append(store)
    with serving(store, max_body_bytes=4096) as url:
        r = httpx.post(f"{url}/v1/chat/completions", content=b"{" + b" " * 5000 + b"}",
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and is_error_object(r)
        # memory: every request reserved its upper bound while it ran, and the total stayed in budget
        c = client(url)
        ids = [c.chat.completions.create(model="export", messages=start(t), tools=TOOLS, max_tokens=16)
               .model_extra["ttt"]["session_id"] for t in TASKS]
        assert engine.seen and all(m["reserved_bytes"] > 0 for m in engine.seen)
        assert all(m["held_bytes"] + m["reserved_bytes"] <= 2 * one for m in engine.seen)
        assert len(store) < len(TASKS) and ids[-1] in store._convs  # the oldest idle ones made room
        # all held sessions busy: no room, 429 with Retry-After
        for conv in store._convs.values():
            conv.lock.acquire()
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": start("x"),
                                                                "max_tokens": 200})
            assert r.status_code == 429 and r.json()["error"]["code"] == "memory_exhausted"
            assert r.headers["retry-after"] == "3"
            # the queue: one request running (waiting for its busy session), none may wait -> 429
            sid = next(iter(store._convs))
            waiting = threading.Thread(target=httpx.post, args=(f"{url}/v1/chat/completions",),
                                       kwargs={"json": {"model": "export", "messages": start(), "session_id": sid},
                                               "timeout": 30})
            waiting.start()
            deadline = time.time() + 10
            while store.memory()["active"] == 0 and time.time() < deadline:
                time.sleep(0.01)
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": start()})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
            waiting.join()
        finally:
            for conv in store._convs.values():
                conv.lock.release()
    with pytest.raises(ValueError, match="memory-budget"):
        ConversationStore(agent, max_context=256, memory_budget=one - 1)


def test_idle_expiry_and_fresh_seeds(agent):
    store = ConversationStore(agent, max_sessions=8, max_new_tokens=48, idle_timeout=60)
    with serving(store) as url:
        c = client(url)
        a = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=8)
        b = c.chat.completions.create(model="export", messages=start(TASKS[0]), tools=TOOLS, max_tokens=8)
        seeded = c.chat.completions.create(model="export", messages=start(TASKS[1]), tools=TOOLS, max_tokens=8, seed=7)
        ia, ib, isd = (x.model_extra["ttt"]["session_id"] for x in (a, b, seeded))
        seeds = {store.get(i).session.generator.initial_seed() for i in (ia, ib)}
        assert len(seeds) == 2 and 0 not in seeds  # a fresh random seed per session
        assert store.get(isd).session.generator.initial_seed() == 7
        assert store.expire(now=time.monotonic() + 30) == []
        assert sorted(store.expire(now=time.monotonic() + 61)) == sorted([ia, ib, isd])
        assert httpx.get(f"{url}/v1/sessions/{ia}").status_code == 404


def test_a_client_that_disconnects_cancels_and_commits_nothing(agent, capfd):
    ref: list = []
    store = ConversationStore(agent, max_sessions=8, max_new_tokens=48, engine=SlowEngine(ref, pause=0.1))
    ref.append(store)
    with serving(store) as url:
        # streaming: read the first chunk, then go away
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                          json={"model": "export", "messages": start(), "tools": TOOLS, "max_tokens": 48,
                                "stream": True}) as r:
            next(r.iter_lines())
        # not streaming: the client times out
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": start(TASKS[0]),
                                                            "tools": TOOLS, "max_tokens": 48}, timeout=0.5)
        deadline = time.time() + 20
        err = ""
        while err.count("cancelled") < 2 and time.time() < deadline:
            time.sleep(0.2)
            err += capfd.readouterr().err
        assert err.count("cancelled") == 2, err
        assert len(store) == 0 and store.memory()["active"] == 0  # nothing was committed
        assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_fork_copies_the_cache_at_its_used_length(agent):
    s = AgentSession(agent, max_new_tokens=48)
    s.reset(TASKS[0], system=SYSTEM, tools=TOOLS)
    s.act()
    used = s._state().num_slots
    assert s._state().cache.capacity > used
    twin = s.fork()
    assert twin._state().cache.capacity == used
    twin.observe(["ok"])  # and it grows on demand
    assert twin.act() and twin._state().cache.capacity >= twin._state().num_slots
