"""Serving: AgentSession replays a trajectory with the same tokens and per-round losses as evaluate's ttt
mode (every context policy), greedy generation equals a full forward, the JSONL service answers
malformed requests with error objects while sessions survive, and the sandboxed bash runner.
Run: python -m pytest tests/unit/test_serve.py
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

from ds_ttt.config import TTTConfig
from ds_ttt.data.render import render_trajectory
from ds_ttt.evaluation.runner import evaluate_trajectory
from ds_ttt.export import export_model
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM
from ds_ttt.serve import AgentModel, AgentSession, SessionError
from ds_ttt.serve.episode import run_episode
from ds_ttt.serve.tools import BashToolRunner
from ds_ttt.serve.service import Service


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    from ds_ttt.data.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def trajectory():
    from ds_ttt.data.generator import generate_memory_world

    return generate_memory_world(5, num_distractors=1)  # real bash outputs, 7 rounds


def make_model(**ttt):
    torch.manual_seed(0)  # full Qwen3 vocabulary (real tokens), otherwise tiny
    cfg = tiny_qwen3_config(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8)
    model = TTTQwen3ForCausalLM(cfg, TTTConfig(**ttt))
    with torch.no_grad():
        for layer in model.adaptive_layers:
            layer.prime_mlp.down_proj.weight.normal_(0, 0.3)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, tok):
    out = tmp_path_factory.mktemp("export")
    export_model(make_model(context_policy="current_round"), out, tokenizer=tok)
    return out


def replay(session, traj):
    msgs = traj["messages"]
    session.reset(msgs[1]["content"], system=msgs[0]["content"], tools=traj["tools"])
    i = 2
    while i < len(msgs):
        session.act(force=msgs[i])
        i += 1
        outs = []
        while i < len(msgs) and msgs[i]["role"] == "tool":
            outs.append(msgs[i]["content"])
            i += 1
        if outs:
            session.observe(outs)


@pytest.mark.parametrize("policy", ["current_round", "window", "full"])
def test_session_replay_equals_evaluate_ttt_mode(policy, trajectory, tok, export_dir):
    if policy == "current_round":  # through the export directory, as served
        agent = AgentModel.load(export_dir)
    else:
        agent = AgentModel(make_model(context_policy=policy, window=64 if policy == "window" else 0), tok)
    session = AgentSession(agent, track_after=True)
    replay(session, trajectory)
    rendered = render_trajectory(trajectory, tok)
    assert session.input_ids == rendered.input_ids
    assert session.kinds == rendered.kinds and session.rounds == rendered.rounds

    metrics, info = evaluate_trajectory(agent.model, rendered, "ttt", tokenizer=tok)
    metrics = [m for m in metrics if m.round > 0]
    num_rounds = sum(m["role"] == "assistant" for m in trajectory["messages"])
    assert [h.round for h in session.history] == [m.round for m in metrics] == list(range(1, num_rounds + 1))
    assert sum(h.updated for h in session.history) == info["num_updates"] == num_rounds - 1
    for h, m in zip(session.history, metrics):
        assert h.action_nll == pytest.approx(m.action_nll, rel=1e-5, abs=1e-5)
        if m.obs_tokens:
            assert h.obs_tokens == m.obs_tokens
            assert h.obs_nll == pytest.approx(m.obs_nll, rel=1e-5, abs=1e-5)
            assert h.obs_nll_after == pytest.approx(m.obs_nll_after, rel=1e-5, abs=1e-5)
        else:
            assert h.obs_nll is None
    # and the adapted fast weights equal the training event loop's
    ids, kinds, rounds = (torch.tensor([x]) for x in (rendered.input_ids, rendered.kinds, rendered.rounds))
    with torch.no_grad():
        out = agent.model.trajectory_loss(ids, kinds, rounds, create_graph=False)
    for a, b in zip(session.fast_weights, out.final_weights[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any((a - b).abs().max() > 0 for a, b in zip(session.fast_weights, agent.model.initial_fast_weights()))


def test_session_inner_step_with_observation_end_equals_training(trajectory, tok):
    rendered = render_trajectory(trajectory, tok)
    ids, kinds, rounds = (torch.tensor([x]) for x in (rendered.input_ids, rendered.kinds, rendered.rounds))
    finals = {}
    for with_end in (False, True):
        agent = AgentModel(make_model(context_policy="current_round", obs_loss_with_end=with_end), tok)
        session = AgentSession(agent)
        replay(session, trajectory)
        with torch.no_grad():
            out = agent.model.trajectory_loss(ids, kinds, rounds, create_graph=False)
        for a, b in zip(session.fast_weights, out.final_weights[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        finals[with_end] = session.fast_weights
    # the closing token is a real extra label: the adapted weights differ
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(finals[False], finals[True]))


def test_greedy_generation_equals_full_forward_and_errors_keep_state(tok):
    agent = AgentModel(make_model(context_policy="current_round"), tok)
    session = AgentSession(agent)
    with pytest.raises(SessionError, match="reset"):
        session.act()
    session.reset("List the files.")
    with pytest.raises(SessionError, match="follow act"):
        session.observe("x")
    msg = session.act(max_new_tokens=6)
    assert msg["role"] == "assistant" and msg["truncated"] is True
    session.observe(["some output\nline 2"])
    msg2 = session.act(max_new_tokens=5)
    n = len(session.input_ids)
    with pytest.raises(SessionError):
        session.observe([3])
    assert len(session.input_ids) == n  # a failed request changes nothing
    # every generated token is the argmax of a whole-sequence forward (W_0 in round 1; the final
    # round is generated with W_1, so compare round 1 only against the plain forward)
    ids = torch.tensor([session.input_ids])
    with torch.no_grad():
        logits = agent.model(ids, torch.tensor([session.rounds]))[0]
    gen = session.history[0].action_ids[:-1]  # the appended <|im_end|> of a truncated action was not generated
    first = session.kinds.index(1)
    assert logits[first - 1:first - 1 + len(gen)].argmax(-1).tolist() == gen
    assert session.history[1].round == 2 and len(session.history[1].action_ids) == 6 and msg2["truncated"]
    # sampling: seeded, reproducible, and not the greedy answer
    sampled = []
    for _ in range(2):
        s2 = AgentSession(agent, temperature=1.0, top_p=0.9, seed=7)
        s2.reset("List the files.")
        s2.act(max_new_tokens=6)
        sampled.append(s2.history[0].action_ids)
    assert sampled[0] == sampled[1] and sampled[0] != session.history[0].action_ids


def test_jsonl_service_errors_and_sessions_survive(tok, trajectory):
    svc = Service(AgentModel(make_model(context_policy="full"), tok), max_sessions=2)
    msgs = trajectory["messages"]
    lines = [
        "this is not json",
        "[1, 2]",
        json.dumps({"id": 1, "op": "dance"}),
        json.dumps({"id": 2, "op": "act", "session": "nope"}),
        json.dumps({"id": 3, "op": "reset", "session": "a", "task": msgs[1]["content"]}),
        json.dumps({"id": 4, "op": "reset", "session": "b", "task": "Say hi.", "temperature": 0.7, "seed": 3}),
        json.dumps({"id": 5, "op": "reset", "session": "c", "task": "too many"}),
        json.dumps({"id": 6, "op": "act", "session": "a", "force": msgs[2]}),
        json.dumps({"id": 7, "op": "observe", "session": "a", "outputs": 42}),
        json.dumps({"id": 8, "op": "reset", "session": "b", "task": ""}),
        json.dumps({"id": 9, "op": "observe", "session": "a", "outputs": [msgs[3]["content"]]}),
        json.dumps({"id": 10, "op": "act", "session": "b", "max_new_tokens": 3}),
        json.dumps({"id": 11, "op": "act", "session": "a", "max_new_tokens": "many"}),
        json.dumps({"id": 12, "op": "state", "session": "a"}),
        json.dumps({"id": 13, "op": "close", "session": "b"}),
        json.dumps({"id": 14, "op": "list"}),
    ]
    fout = io.StringIO()
    svc.serve(io.StringIO("\n".join(lines) + "\n\n"), fout)
    res = [json.loads(line) for line in fout.getvalue().splitlines()]
    assert len(res) == len(lines)
    errors = {r["id"]: r["error"]["type"] for r in res if not r["ok"]}
    assert [r["error"]["type"] for r in res[:2]] == ["parse_error", "invalid_request"]
    assert errors == {None: "invalid_request", 1: "invalid_request", 2: "unknown_session", 5: "invalid_request",
                      7: "invalid_request", 8: "session_error", 11: "invalid_request"}
    by_id = {r["id"]: r for r in res if r["ok"]}
    assert by_id[6]["result"]["round"] == 1 and by_id[6]["result"]["action_nll"] > 0
    assert by_id[9]["result"]["updated"] is True and by_id[9]["result"]["obs_loss"] > 0
    assert by_id[10]["result"]["truncated"] is True  # session b survived the failed reset (id 8)
    state = by_id[12]["result"]
    assert state["round"] == 1 and state["phase"] == "act" and [m["role"] for m in state["messages"]] == [
        "system", "user", "assistant", "tool"]
    assert by_id[14]["result"]["sessions"] == ["a"]


def test_service_cli_over_stdin_stdout(export_dir):
    reqs = ["{bad", json.dumps({"id": "r", "op": "reset", "session": "s", "task": "hi"}),
            json.dumps({"id": "a", "op": "act", "session": "s", "max_new_tokens": 2}), json.dumps({"op": "ping"})]
    proc = subprocess.run([sys.executable, "-m", "ds_ttt.serve", "--model", str(export_dir)], input="\n".join(reqs) + "\n",
                          capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                            "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    res = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["ok"] for r in res] == [False, True, True, True]
    assert res[2]["result"]["num_action_tokens"] == 3 and res[3]["result"]["sessions"] == 1


def test_bash_runner_sandbox_timeouts_and_errors():
    with BashToolRunner(timeout=3) as runner:  # generous: a loaded machine starts namespaces slowly
        root = runner.root
        call = lambda cmd: {"function": {"name": "bash", "arguments": json.dumps({"command": cmd})}}  # noqa: E731
        assert runner.execute(call("echo hi > f.txt && cat f.txt && pwd")) == "hi\n/app"  # the sandbox's workdir
        assert runner.execute(call("exit 3")) == "(no output)" or "[exit code: 3]" in runner.execute(call("exit 3"))
        assert "[command timed out]" in runner.execute(call("sleep 60"))
        assert "unknown tool" in runner.execute({"function": {"name": "python", "arguments": "{}"}})
        assert "bad bash arguments" in runner.execute({"function": {"name": "bash", "arguments": "{not json"}})
    assert not root.exists()


def test_bash_runner_isolation_is_required_unless_declined():
    from ds_ttt.sandbox import SandboxError, isolation_problem

    problem = isolation_problem()
    if problem is None:
        with BashToolRunner(timeout=2) as runner:
            assert runner.isolation == "bwrap"
            runner.execute({"function": {"name": "bash", "arguments": json.dumps({"command": "echo x > ../escape"})}})
            assert not (runner.root.parent.parent / "escape").exists()  # the write stayed inside the throwaway root
    else:
        with pytest.raises(SandboxError, match="--no-isolation"):
            BashToolRunner(timeout=2)
    with BashToolRunner(timeout=2, isolation="none") as runner:
        assert runner.isolation == "none"


def test_run_episode_loop_with_a_scripted_session():
    class Scripted:
        round = 0

        def __init__(self):
            self.seen, self.input_ids = [], []

        def reset(self, task):
            self.task = task

        def act(self):
            self.round += 1
            if self.round == 1:
                return {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "echo 41"}'}}],
                    "invalid_tool_calls": [{"text": "{", "error": "bad json"}]}
            return {"role": "assistant", "content": "done"}

        def observe(self, outputs):
            self.seen.append(outputs)
            return 1.5

    s = Scripted()
    with BashToolRunner(timeout=2) as runner:
        episode = run_episode(s, runner, max_rounds=5)
    assert episode.finished and episode.stop == "answer" and len(episode.rounds) == 2 and episode.answer == "done"
    assert s.seen == [["41", "[error: invalid tool call: bad json]"]] and episode.rounds[0].obs_loss == 1.5


def test_decoding_writes_a_preallocated_cache_in_place(tok, monkeypatch):
    """No concatenation of the key/value cache per generated token (the old decode re-concatenated it,
    O(S) per token), and the cache grows by doubling."""
    from ds_ttt.serve.kv_cache import KVCache

    agent = AgentModel(make_model(context_policy="full"), tok)
    real_cat = torch.cat
    seq_cats = {"n": 0}

    def counting_cat(tensors, dim=0, **kw):
        if dim in (2, -2) and tensors and tensors[0].dim() == 4:  # along the sequence of [1, H, S, D]
            seq_cats["n"] += 1
        return real_cat(tensors, dim, **kw)

    counts = {}
    for n in (3, 12):
        s = AgentSession(agent)
        s.reset("List the files.")
        seq_cats["n"] = 0
        monkeypatch.setattr(torch, "cat", counting_cat)
        msg = s.act(max_new_tokens=n)
        monkeypatch.setattr(torch, "cat", real_cat)
        assert msg["truncated"] and len(s.history[-1].action_token_nll) == n
        counts[n] = seq_cats["n"]
    assert counts == {3: 0, 12: 0}

    cache = KVCache.for_model(agent.model, capacity=4, max_capacity=20)
    k = torch.randn(1, 2, 3, 8)
    cache.write(0, 0, k, -k)
    cache.ensure(5)
    assert cache.capacity == 8 and torch.equal(cache.view(0, 0, 3)[0], k)  # doubled, contents kept
    cache.ensure(17)
    assert cache.capacity == 17
    twin = cache.clone(3)
    twin.write(0, 0, torch.zeros_like(k), torch.zeros_like(k))
    assert torch.equal(cache.view(0, 0, 3)[1], -k)  # the clone is independent
    with pytest.raises(ValueError, match="exceed the capacity 20"):
        cache.ensure(21)
