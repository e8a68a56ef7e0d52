"""The OpenAI-compatible server and the main job's kind of export (compact vocabulary) in every loader.

  * the real `openai` client against a running server (uvicorn on 127.0.0.1, an ephemeral port): a
    multi-round tool-calling loop whose tool calls run in the sandboxed runner, `ttt.updates` growing
    by one per tool result, the server's fast weights equal to AgentSession.observe's; SSE streaming;
    prefix lookup; "ttt": false; divergence; malformed requests; concurrent sessions; 409 / 429 / LRU;
  * the trimmed export loads in evaluation, the memory test, the JSONL service, the runner and the
    HTTP server (CLIs), and is refused without its tokenizer or with a changed one;
  * --attention-backend auto equals reference at small N (evaluation output, a session's NLLs).
Run: python -m pytest tests/unit/test_serve_http.py
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from ds_ttt.serve import AgentModel, AgentSession
from ds_ttt.serve.conversations import ConversationStore
from ds_ttt.serve.frontends.http import bind, create_app, make_server
from ds_ttt.serve.tools import BashToolRunner
from tests.unit.serve_cases import ACTION, SYSTEM, TASKS, TOOL_COMMAND, TOOLS, build_trimmed_export

REPO = pathlib.Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory):
    root = tmp_path_factory.mktemp("trimmed")
    build_trimmed_export(root)
    return root


@pytest.fixture(scope="module")
def agent(trimmed):
    return AgentModel.load(trimmed / "export")


@pytest.fixture(scope="module")
def server(agent):
    store = ConversationStore(agent, max_sessions=4, max_new_tokens=48, busy_timeout=120)
    sock = bind("127.0.0.1", 0)
    srv = make_server(create_app(store, "export"), sock)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", store
    srv.should_exit = True
    thread.join(timeout=30)


def client(url):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def start(task=TASKS[3]):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def as_sent(message) -> dict:
    """The assistant message as a client sends it back (reasoning dropped, as most clients do)."""
    d = message.model_dump(exclude_none=True)
    return {"role": "assistant", "content": d.get("content"), "tool_calls": d.get("tool_calls")}


def replay_locally(agent, task, outputs):
    """An AgentSession doing what the server's session did: generate (greedy), observe each output."""
    s = AgentSession(agent, max_new_tokens=48)
    s.reset(task, system=SYSTEM, tools=TOOLS)
    for out in outputs:
        s.act()
        s.observe([out])
    return s


def test_return_token_ids_as_vllm_with_logprobs_and_the_inner_loss(server, agent):
    """return_token_ids (vLLM's field, through the openai client's extra_body): prompt_token_ids on the reply,
    token_ids on each choice, equal to a local session's greedy tokens; logprobs as without it; the second
    reply's ttt.obs_loss is the loss the session's inner step took on the tool result."""
    url, _ = server
    c = client(url)
    messages, sid = start(), None
    local = AgentSession(agent, max_new_tokens=48)
    local.reset(messages[1]["content"], system=SYSTEM, tools=TOOLS)
    for k in range(2):
        body = {"return_token_ids": True} | ({"session_id": sid} if sid else {})
        r = c.chat.completions.create(model="export", messages=messages, tools=TOOLS, max_tokens=48, logprobs=True,
                                      extra_body=body)
        extra, choice = r.model_extra, r.choices[0]
        sid = extra["ttt"]["session_id"]
        prompt = list(local.input_ids) + list(agent.prompt_ids)
        local.act()
        assert extra["prompt_token_ids"] == prompt and len(prompt) == r.usage.prompt_tokens
        assert choice.model_extra["token_ids"] == local.history[-1].action_ids
        log = local.history[-1]  # OpenAI's logprobs leave out the closing <|im_end|>, as before
        assert [lp.logprob for lp in choice.logprobs.content] == pytest.approx(
            [-x for t, x in zip(log.action_ids, log.action_token_nll) if t not in agent.stop_ids], abs=1e-5)
        if k == 0:
            assert extra["ttt"]["obs_loss"] is None  # nothing observed yet
        else:
            assert extra["ttt"]["obs_loss"] == pytest.approx(local.history[-2].obs_nll, rel=1e-5)
        call = choice.message.tool_calls[0]
        messages += [as_sent(choice.message), {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
        local.observe(["ok"])
    plain = c.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=4)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra
    with pytest.raises(openai.BadRequestError, match="return_token_ids is not supported with stream"):
        c.chat.completions.create(model="export", messages=start(), stream=True, extra_body={"return_token_ids": True})


def test_openai_client_tool_loop_learns_one_update_per_tool_result(server, agent):
    url, store = server
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["export"]
    messages, sid, seen = start(), None, []
    with BashToolRunner(timeout=5) as runner:  # the tool calls really run, sandboxed
        for k in range(3):
            r = c.chat.completions.create(model="export", messages=messages, tools=TOOLS, max_tokens=48,
                                          extra_body={"session_id": sid} if sid else None)
            ttt = r.model_extra["ttt"]
            seen.append(ttt["updates"])
            assert ttt["policy"] == "current_round" and ttt["enabled"] is True and ttt["skipped"] == 0
            sid = sid or ttt["session_id"]
            assert ttt["session_id"] == sid  # the same conversation, every round
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            call = choice.message.tool_calls[0]
            assert call.function.name == "bash" and json.loads(call.function.arguments) == {"command": TOOL_COMMAND}
            assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
            output = runner.execute(call.model_dump())
            assert output == "ok"
            messages += [as_sent(choice.message), {"role": "tool", "tool_call_id": call.id, "content": output}]
    assert seen == [0, 1, 2]  # one inner update per tool result
    # without session_id the message prefix finds the conversation and continues a copy of it
    # (copy-on-write: a new session id; the original is not advanced)
    before = len(store.get(sid).session.input_ids)
    r = c.chat.completions.create(model="export", messages=messages, tools=TOOLS, max_tokens=48)
    assert r.model_extra["ttt"]["session_id"] != sid and r.model_extra["ttt"]["updates"] == 3
    assert r.usage.prompt_tokens_details.cached_tokens == before  # the copied cache: no replay
    assert len(store.get(sid).session.input_ids) == before and store.get(sid).session.round == 3
    # the server's fast weights are exactly AgentSession.observe's over the same conversation
    local = replay_locally(agent, messages[1]["content"], ["ok"] * 3)
    assert local.num_updates == 3
    assert [m.get("tool_calls", [{}])[0].get("function") for m in local.messages if m["role"] == "assistant"] == \
        [m["tool_calls"][0]["function"] for m in messages if m["role"] == "assistant"]
    child = r.model_extra["ttt"]["session_id"]
    for a, b in zip(store.get(child).session.fast_weights, local.fast_weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any((a - b).abs().max() > 0 for a, b in zip(local.fast_weights, agent.model.initial_fast_weights()))
    info = httpx.get(f"{url}/v1/sessions/{child}").json()
    assert info["updates"] == 3 and info["round"] == 4


def test_streaming_sends_openai_sse_chunks(server):
    url, _ = server
    stream = client(url).chat.completions.create(model="export", messages=start(TASKS[0]), tools=TOOLS,
                                                 max_tokens=48, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    # the deltas add up to the reply a non-streamed request gets (greedy: the same tokens)
    whole = client(url).chat.completions.create(model="export", messages=start(TASKS[0]), tools=TOOLS, max_tokens=48)
    for key in ("content", "reasoning_content"):
        streamed = "".join((getattr(ch.choices[0].delta, key, None) or (ch.choices[0].delta.model_extra or {}).get(key)
                            or "") for ch in chunks if ch.choices)
        sent = getattr(whole.choices[0].message, key, None) or (whole.choices[0].message.model_extra or {}).get(key) or ""
        assert streamed == sent, key
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "bash" and calls[0].id.startswith("call_")
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [ch.choices[0].finish_reason for ch in finals] == ["tool_calls"]
    assert finals[0].model_extra["ttt"]["updates"] == 0
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices


def test_frozen_requests_and_divergence_leave_sessions_unchanged(server, agent):
    url, store = server
    c = client(url)
    msgs = start(TASKS[1])
    r = c.chat.completions.create(model="export", messages=msgs, tools=TOOLS, max_tokens=48)
    sid = r.model_extra["ttt"]["session_id"]
    call = r.choices[0].message.tool_calls[0]
    msgs += [as_sent(r.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
    r = c.chat.completions.create(model="export", messages=msgs, tools=TOOLS, max_tokens=48,
                                  extra_body={"session_id": sid})
    assert r.model_extra["ttt"]["updates"] == 1
    before = store.get(sid).session
    snapshot = (len(before.input_ids), [w.clone() for w in before.fast_weights])
    # another tool output than the session saw: a new conversation; the old one is untouched
    edited = msgs[:-1] + [{"role": "tool", "tool_call_id": call.id, "content": "something else"}]
    r2 = c.chat.completions.create(model="export", messages=edited, tools=TOOLS, max_tokens=48,
                                   extra_body={"session_id": sid})
    assert r2.model_extra["ttt"]["session_id"] != sid and r2.model_extra["ttt"]["updates"] == 1
    after = store.get(sid).session
    assert len(after.input_ids) == snapshot[0]
    for a, b in zip(after.fast_weights, snapshot[1]):
        assert torch.equal(a, b)
    # "ttt": false answers with frozen weights: no update, W stays W_0
    r3 = c.chat.completions.create(model="export", messages=msgs, tools=TOOLS, max_tokens=48, extra_body={"ttt": False})
    ttt = r3.model_extra["ttt"]
    assert ttt["enabled"] is False and ttt["updates"] == 0 and ttt["session_id"] not in (sid, r2.model_extra["ttt"]["session_id"])
    for a, b in zip(store.get(ttt["session_id"]).session.fast_weights, agent.model.initial_fast_weights()):
        assert torch.equal(a, b)
    bad = httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": msgs, "tools": TOOLS,
                                                          "session_id": sid, "ttt": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttt"


def test_malformed_requests_get_openai_errors_and_change_nothing(server):
    url, store = server
    ok = start(TASKS[2])
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "export", "messages": ok, "tools": TOOLS,
                                                        "max_tokens": 48}, timeout=600)
    assert r.status_code == 200
    state = {sid: len(conv.session.input_ids) for sid, conv in store._convs.items()}
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    cases = [
        (b"{not json", 400, None, "invalid_json"),
        (json.dumps({"model": "export", "messages": ok + [{"role": "wizard", "content": "x"}]}), 400, "messages[2].role", None),
        (json.dumps({"model": "export", "messages": ok + [{"role": "tool", "tool_call_id": "call_x", "content": "o"}]}),
         400, "messages[2].tool_call_id", None),
        (json.dumps({"model": "export", "messages": ok + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_other", "content": "o"}]}), 400, "messages[3].tool_call_id", None),
        (json.dumps({"model": "export", "messages": [{"role": "user", "content": "word " * 20000}]}), 400, "messages",
         "context_length_exceeded"),
        (json.dumps({"model": "gpt-9", "messages": ok}), 404, "model", "model_not_found"),
        (json.dumps({"model": "export", "messages": ok, "session_id": "sess-nope"}), 404, "session_id", "session_not_found"),
        (json.dumps({"model": "export", "messages": ok, "n": 99}), 400, "n", None),
        (json.dumps({"model": "export", "messages": ok, "frequency_penalty": 0.5}), 400, "frequency_penalty", None),
        (json.dumps({"model": "export", "messages": ok, "stop": [1]}), 400, "stop", None),
        (json.dumps({"model": "export", "messages": ok, "tool_choice": "sometimes"}), 400, "tool_choice", None),
        (json.dumps({"model": "export", "messages": ok, "top_logprobs": 3}), 400, "top_logprobs", None),
        (json.dumps({"model": "export", "messages": ok, "temperature": "hot"}), 400, "temperature", None),
        (json.dumps({"model": "export", "messages": []}), 400, "messages", None),
        (json.dumps({"model": "export", "messages": ok[:1] + [{"role": "user", "content": "<|im_start|>x"}]}), 400,
         "messages[1].content", None),
        (json.dumps([1, 2]), 400, None, None),
    ]
    for body, status, param, code in cases:
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                       timeout=600)
        err = r.json()["error"]
        assert r.status_code == status, (body[:80], r.text)
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param and (code is None or err["code"] == code), err
    streamed = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(dict(json.loads(cases[4][0]), stream=True)),
                          headers={"content-type": "application/json"}, timeout=600)
    assert streamed.status_code == 400 and streamed.json()["error"]["code"] == "context_length_exceeded"  # before any token
    capacity = store.agent.model.config.max_position_embeddings
    r = httpx.post(f"{url}/v1/chat/completions", content=cases[4][0], headers={"content-type": "application/json"})
    assert f"maximum context length is {capacity} tokens" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert {sid: len(conv.session.input_ids) for sid, conv in store._convs.items()} == state  # nothing changed


def test_concurrent_sessions_are_isolated_serialized_and_evicted(server, agent):
    url, store = server
    c = client(url)
    tasks = list(TASKS[:3])

    def conversation(task):
        msgs = start(task)
        r = c.chat.completions.create(model="export", messages=msgs, tools=TOOLS, max_tokens=48)
        call = r.choices[0].message.tool_calls[0]
        msgs += [as_sent(r.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": f"out {task}"}]
        r = c.chat.completions.create(model="export", messages=msgs, tools=TOOLS, max_tokens=48,
                                      extra_body={"session_id": r.model_extra["ttt"]["session_id"]})
        return msgs, r.model_extra["ttt"]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(conversation, tasks))
    ids = [ttt["session_id"] for _, ttt in results]
    assert len(set(ids)) == 3 and all(ttt["updates"] == 1 for _, ttt in results)
    for task, (msgs, ttt) in zip(tasks, results):  # no shared state: each equals its conversation run alone
        local = replay_locally(agent, task, [f"out {task}"])
        for a, b in zip(store.get(ttt["session_id"]).session.fast_weights, local.fast_weights):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    # two identical requests to one session at once: serialized; the first extends it, the second
    # finds it moved on (its messages now diverge) and starts a new conversation
    msgs, ttt = results[0]
    sid, n0 = ttt["session_id"], len(store.get(ttt["session_id"]).session.input_ids)
    reply = store.get(sid).session.messages[-1]
    body = {"model": "export", "tools": TOOLS, "max_tokens": 48, "session_id": sid,
            # the reply sent back as the server gave it (its content too: the tiny model may emit a stray '</think>')
            "messages": msgs + [{"role": "assistant", "content": reply["content"], "tool_calls": reply["tool_calls"]},
                                {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "again"}]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600), range(2)))
    assert [r.status_code for r in both] == [200, 200]
    got = sorted(r.json()["ttt"]["session_id"] == sid for r in both)
    assert got == [False, True]
    assert store.get(sid).session.round == 3 and len(store.get(sid).session.input_ids) > n0

    # busy: a request that cannot get its session in time is a 409; all sessions busy: 429
    conv = store.get(sid)
    store.busy_timeout = 0.2
    conv.lock.acquire()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=dict(body, messages=msgs), timeout=600)
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
        held = [cv for cv in store._convs.values() if cv is not conv]
        for cv in held:
            cv.lock.acquire()
        try:
            r = httpx.post(f"{url}/v1/chat/completions",
                           json={"model": "export", "messages": start("Another task."), "max_tokens": 4}, timeout=600)
            assert r.status_code == 429 and r.json()["error"]["code"] == "sessions_exhausted"
        finally:
            for cv in held:
                cv.lock.release()
    finally:
        conv.lock.release()
        store.busy_timeout = 120
    # beyond --max-sessions the least recently used idle conversation is evicted
    order = list(store._convs)
    assert len(order) == store.max_sessions
    r = c.chat.completions.create(model="export", messages=start("One more task."), tools=TOOLS, max_tokens=4)
    assert order[0] not in store._convs and r.model_extra["ttt"]["session_id"] in store._convs
    assert httpx.get(f"{url}/v1/sessions/{order[0]}").status_code == 404


# ---- the main job's kind of export in every loader ------------------------------------------------
def load_script(rel):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_")[:-3], REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trimmed_export_loads_in_evaluation_memory_test_service_runner_and_http(trimmed, tmp_path):
    export = trimmed / "export"
    meta = json.loads((export / "ttt_config.json").read_text())
    assert meta["tokenizer"]["trimmed"] and (export / "qwen3_ids.json").is_file()
    tok_size = meta["tokenizer"]["size"]
    assert tok_size < 5000 and json.loads((export / "config.json").read_text())["vocab_size"] == -(-tok_size // 64) * 64
    # evaluation and the memory test (in process, as main.sh runs them)
    assert load_script("evals/evaluate.py").main(["--checkpoint", str(export), "--manifest", str(trimmed / "data"),
                                                  "--out", str(tmp_path / "eval"), "--limit", "1", "--no-plots"]) == 0
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert res["checkpoint"]["tokenizer"]["trimmed"] and res["attention_backend"] == "reference"
    assert res["summary"]["ttt"]["action_tokens"] > 0
    assert load_script("evals/memory_test.py").main(["--checkpoint", str(export), "--out", str(tmp_path / "mem"),
                                                     "--num-worlds", "1"]) == 0
    assert json.loads((tmp_path / "mem" / "results.json").read_text())["summary"]["ttt"]["num_readbacks"] == 2
    # the JSONL service
    reqs = [{"id": 1, "op": "reset", "session": "s", "task": "List the files.", "system": SYSTEM, "tools": TOOLS},
            {"id": 2, "op": "act", "session": "s", "max_new_tokens": 48},
            {"id": 3, "op": "observe", "session": "s", "outputs": ["ok"]}]
    proc = subprocess.run([sys.executable, "-m", "ds_ttt.serve", "--model", str(export)], capture_output=True, text=True,
                          input="\n".join(map(json.dumps, reqs)) + "\n", timeout=600, env=ENV, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["ok"] for r in out] == [True, True, True], out
    assert out[1]["result"]["message"]["tool_calls"][0]["function"]["name"] == "bash" and out[2]["result"]["updated"]
    # the runner: the model's bash calls run in the sandbox
    from ds_ttt.sandbox import cgroup_problem, isolation_problem

    isolated, capped = isolation_problem() is None, cgroup_problem() is None
    proc = subprocess.run([sys.executable, "-m", "ds_ttt.serve.frontends.task_cli", "--model", str(export), "--task", "List the files.",
                           "--max-rounds", "2", "--max-new-tokens", "48"] + ([] if isolated else ["--no-isolation"])
                          + ([] if capped else ["--no-cgroup-caps"]),
                          capture_output=True, text=True, timeout=600, env=ENV, cwd=REPO)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]  # one per round, then the summary
    assert proc.returncode in (0, 1) and lines, proc.stderr
    assert lines[-1]["num_rounds"] == len(lines) - 1 >= 1 and lines[-1]["attention_backend"] == "reference"
    assert lines[-1]["isolation"] == ("bwrap" if isolated else "none")
    assert (lines[-1]["cgroup_caps"] != "none") == capped  # what was used is recorded
    # the HTTP server, as a user starts it
    # (with its API key from the environment and a shorter context)
    srv = subprocess.Popen([sys.executable, "-m", "ds_ttt.serve.frontends.http", "--model", str(export), "--port", "0",
                            "--max-model-len", "1024"],
                           stderr=subprocess.PIPE, text=True, env=dict(ENV, DS_TTT_API_KEY="sk-env"), cwd=REPO)
    try:
        line = srv.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1)), line
        url = f"http://127.0.0.1:{port[0]}"
        assert httpx.get(url + "/health").json()["model"] == "export"
        denied = httpx.get(url + "/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        from openai import OpenAI

        keyed = OpenAI(base_url=url + "/v1", api_key="sk-env", max_retries=0, timeout=600)
        assert keyed.models.list().data[0].model_extra["context_length"] == 1024
        r = keyed.chat.completions.create(model="export", messages=start(), tools=TOOLS, max_tokens=48)
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        srv.terminate()
        srv.wait(timeout=60)


def test_trimmed_export_without_its_tokenizer_or_with_another_is_refused(trimmed, tmp_path):
    from ds_ttt.loading import load_for_inference

    copy = tmp_path / "export"
    shutil.copytree(trimmed / "export", copy)
    (copy / "qwen3_ids.json").unlink()
    with pytest.raises(ValueError, match="qwen3_ids.json: sha256 \\(file missing\\)"):
        load_for_inference(copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (copy / name).unlink()
    meta = json.loads((copy / "ttt_config.json").read_text())
    recorded = meta["tokenizer"]["sha256"]
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        load_for_inference(copy)
    meta["tokenizer"] = None  # an export written without a tokenizer at all
    (copy / "ttt_config.json").write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match="vocabulary is compact"):
        load_for_inference(copy)
    # another tokenizer than the recorded one: both hashes named
    shutil.rmtree(copy)
    shutil.copytree(trimmed / "export", copy)
    tj = json.loads((copy / "tokenizer.json").read_text())
    tj["added_tokens"][0]["content"] = "<|changed|>"
    (copy / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match=f"sha256 [0-9a-f]{{64}} but .*records {recorded}"):
        load_for_inference(copy)


def test_checkpoint_tokenizer_is_checked_against_the_training_manifest(trimmed, tmp_path, monkeypatch):
    from ds_ttt import loading
    from ds_ttt.loading import load_export, load_for_inference
    from ds_ttt.train.run_record import RunInfo

    data = tmp_path / "data"
    shutil.copytree(trimmed / "data", data)
    model = load_export(trimmed / "export")
    man_sha = __import__("hashlib").sha256((data / "manifest.json").read_bytes()).hexdigest()
    ckpt = tmp_path / "run" / "step_00000010"
    ckpt.mkdir(parents=True)
    info = RunInfo(checkpoint=ckpt, step=10, backbone=model.config.to_dict(), ttt=model.ttt.to_dict(), run={},
                   deepspeed={}, plan={}, manifest_path=str(data / "manifest.json"), manifest_sha256=man_sha,
                   model_source={"preset": "tiny"}, layout={})
    monkeypatch.setattr(loading, "load_training_checkpoint", lambda path, device="cpu": (model, info))
    loaded = load_for_inference(ckpt)
    assert loaded.provenance["tokenizer"]["trimmed"] and loaded.tokenizer.qwen3_ids is not None
    recorded = json.loads((data / "manifest.json").read_text())["tokenizer"]["hash"]
    (data / "tokenizer" / "tokenizer.json").write_text((data / "tokenizer" / "tokenizer.json").read_text() + " ")
    with pytest.raises(ValueError, match=f"tokenizer.json: sha256 [0-9a-f]{{64}} but the training manifest .* {recorded}"):
        load_for_inference(ckpt)
    shutil.rmtree(data / "tokenizer")
    with pytest.raises(FileNotFoundError, match=f"trained with tokenizer sha256 {recorded}"):
        load_for_inference(ckpt)


def test_checkpoint_tokenizer_is_checked_against_the_hash_recorded_at_training(trimmed, tmp_path, monkeypatch):
    """run_config.json's "tokenizer" (written by the trainer, run_record.manifest_tokenizer) is the record: it
    holds without the manifest, and a changed tokenizer is refused naming both hashes."""
    from ds_ttt import loading
    from ds_ttt.data.manifest import load_manifest
    from ds_ttt.loading import load_export, load_for_inference
    from ds_ttt.train.run_record import RunInfo
    from ds_ttt.train.run_record import manifest_tokenizer

    data = tmp_path / "data"
    shutil.copytree(trimmed / "data", data)
    record = manifest_tokenizer(load_manifest(data / "manifest.json"))
    assert record == {"dir": str((data / "tokenizer").resolve()),
                      "sha256": json.loads((data / "manifest.json").read_text())["tokenizer"]["hash"]}
    (data / "manifest.json").unlink()  # the manifest is gone; the training record still verifies
    model = load_export(trimmed / "export")
    ckpt = tmp_path / "run" / "step_00000010"
    ckpt.mkdir(parents=True)
    info = RunInfo(checkpoint=ckpt, step=10, backbone=model.config.to_dict(), ttt=model.ttt.to_dict(), run={},
                   deepspeed={}, plan={}, manifest_path=str(data / "manifest.json"), manifest_sha256="0" * 64,
                   model_source={"preset": "tiny"}, layout={}, raw={"tokenizer": record})
    monkeypatch.setattr(loading, "load_training_checkpoint", lambda path, device="cpu": (model, info))
    loaded = load_for_inference(ckpt)
    assert loaded.provenance["tokenizer"]["trimmed"] and loaded.provenance["tokenizer"]["recorded_in"].endswith(
        "run_config.json")
    tj = data / "tokenizer" / "tokenizer.json"
    tj.write_text(tj.read_text() + " ")
    with pytest.raises(ValueError, match=f"tokenizer.json: sha256 [0-9a-f]{{64}} but .*run_config.json.* {record['sha256']}"):
        load_for_inference(ckpt)


# ---- --attention-backend auto == reference at small N ----------------------------------------------
def test_auto_attention_backend_equals_reference(trimmed, tmp_path):
    from ds_ttt.evaluation.heldout import run_heldout

    res = {b: run_heldout(str(trimmed / "export"), str(trimmed / "data"), str(tmp_path / b), limit=1, plots=False,
                          progress=False, attention_backend=b) for b in ("reference", "auto")}
    assert res["reference"]["attention_backend"] == "reference" and res["auto"]["attention_backend"] == "cpu"
    assert res["auto"]["attention_backend_requested"] == "auto"
    for mode in ("ttt", "frozen"):
        a, b = res["auto"]["summary"][mode], res["reference"]["summary"][mode]
        assert a["action_tokens"] == b["action_tokens"] > 0
        for key in ("action_nll", "obs_nll", "action_token_acc"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # a served session: the same action and observation NLLs and the same adapted fast weights
    sessions = {}
    for b in ("reference", "auto"):
        agent = AgentModel.load(trimmed / "export", attention_backend=b)
        assert agent.attention_backend == ("cpu" if b == "auto" else "reference")
        s = AgentSession(agent, max_new_tokens=48)
        s.reset("List the files.", system=SYSTEM, tools=TOOLS)
        for _ in range(2):
            s.act(force=ACTION)
            s.observe(["ok"])
        generated = s.act()
        sessions[b] = (s, generated)
    (ref, gen_ref), (auto, gen_auto) = sessions["reference"], sessions["auto"]
    for h_ref, h_auto in zip(ref.history, auto.history):
        assert h_auto.action_nll == pytest.approx(h_ref.action_nll, rel=1e-4, abs=1e-6)
        if h_ref.obs_nll is not None:
            assert h_auto.obs_nll == pytest.approx(h_ref.obs_nll, rel=1e-4, abs=1e-6)
    assert gen_auto == gen_ref
    for a, b in zip(auto.fast_weights, ref.fast_weights):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("text", [
    '<think>\nI will list.\n</think>\n\nHere we go.<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>',
    "<think>\n\n</think>\n\nThe answer is 42.\n<|im_end|>",
    "<think>\nüñí ✓ 漢字\n\nsecond line</think>plain<|im_end|>",
    "no think block at all <|im_end|>",
])
def test_stream_deltas_are_monotone_and_add_up_to_the_parse(text):
    from ds_ttt.data.render import parse_assistant_message
    from ds_ttt.serve.openai_api import provisional_message

    sent = {}
    for i in range(1, len(text) + 1):
        for key, value in provisional_message(text[:i]).items():
            assert value.startswith(sent.get(key, "")), (text[:i], key, value)
            sent[key] = value
    final = parse_assistant_message(text)
    assert sent.get("content", "") == final["content"]
    assert sent.get("reasoning_content", "") == (final.get("reasoning_content") or "")
