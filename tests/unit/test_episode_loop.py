"""The one episode loop (ds_ttt/serve/episode.py): how it stops, and that every harness runs it.

    .venv/bin/python -m pytest -q tests/unit/test_episode_loop.py

Behaviour: a scripted agent and scripted tools (no model, no sandbox) drive the loop through each stop
("answer", "truncated", "invalid_tool_calls", "max_rounds", "context_full"), plain and async.
Structure: the closed-loop evaluation, the task CLI and the Harbor agent import the loop from
ds_ttt.serve.episode, and no module of ds_ttt/ but episode.py writes a loop over `max_rounds` or the
invalid-tool-call observation; the checker also runs on a made-up module that re-implements the loop,
to show it can fail. Read with `ast`, so the Harbor agent is checked without Harbor installed.
"""

from __future__ import annotations

import ast
import asyncio
import pathlib

import pytest

from ds_ttt.serve.episode import EpisodeEnd, invalid_call_observation, play_episode, run_episode

REPO = pathlib.Path(__file__).resolve().parents[2]
LOOP_MODULE = "ds_ttt/serve/episode.py"
HARNESSES = ("ds_ttt/evaluation/closed_loop.py", "ds_ttt/serve/frontends/task_cli.py",
             "ds_ttt/serve/frontends/harbor_agent.py")


def call(command: str, cid: str = "c0") -> dict:
    return {"id": cid, "type": "function", "function": {"name": "bash", "arguments": f'{{"command": "{command}"}}'}}


class Scripted:
    """Replies from a script; observe() records the outputs and returns a loss."""

    def __init__(self, replies, *, reports_invalid_calls: bool = True, end_at: int | None = None):
        self.replies, self.seen, self.reports_invalid_calls, self.end_at = list(replies), [], reports_invalid_calls, end_at

    def act(self):
        if self.end_at is not None and len(self.seen) == self.end_at:
            raise EpisodeEnd("context_full")
        return self.replies.pop(0)

    def observe(self, outputs):
        self.seen.append(outputs)
        return 0.25 * len(self.seen)


class EchoTools:
    def __init__(self):
        self.commands = []

    def execute(self, c):
        self.commands.append(c["function"]["arguments"])
        return f"ran {len(self.commands)}"


def test_a_final_reply_answers_and_every_call_is_observed():
    agent, tools = Scripted([{"content": "", "tool_calls": [call("ls"), call("pwd", "c1")],
                              "invalid_tool_calls": [{"error": "bad json"}]}, {"content": "It has 3 lines."}]), EchoTools()
    rounds = []
    ep = run_episode(agent, tools, max_rounds=5, on_round=rounds.append)
    assert (ep.stop, ep.answer, ep.finished, len(ep.rounds)) == ("answer", "It has 3 lines.", True, 2)
    assert agent.seen == [["ran 1", "ran 2", invalid_call_observation({"error": "bad json"})]]
    assert ep.rounds[0].obs_loss == 0.25 and ep.rounds[1].outputs is None and rounds == ep.rounds
    assert ep.rounds[0].to_dict()["outputs"] == agent.seen[0] and "outputs" not in ep.rounds[1].to_dict()


@pytest.mark.parametrize("reply", [{"content": "3", "truncated": True}, {"content": "<think>\nit has 3"},
                                   {"content": '<tool_call>\n{"name": "bash", "arguments": {"command": "echo 3'}])
def test_an_unfinished_final_reply_answers_nothing(reply):
    ep = run_episode(Scripted([reply]), EchoTools(), max_rounds=3)
    assert (ep.stop, ep.answer, ep.finished) == ("truncated", "", False)


def test_invalid_calls_end_an_agent_that_cannot_report_them():
    reply = {"content": "", "invalid_tool_calls": [{"error": "bad json"}]}
    ep = run_episode(Scripted([reply], reports_invalid_calls=False), EchoTools(), max_rounds=3)
    assert (ep.stop, ep.answer, len(ep.rounds)) == ("invalid_tool_calls", "", 1)
    both = {"content": "", "tool_calls": [call("ls")], "invalid_tool_calls": [{"error": "bad json"}]}
    agent = Scripted([both, {"content": "done"}], reports_invalid_calls=False)
    assert run_episode(agent, EchoTools(), max_rounds=3).stop == "answer" and agent.seen == [["ran 1"]]


def test_max_rounds_and_an_early_end_keep_the_rounds_so_far():
    acting = [{"content": "", "tool_calls": [call("ls")]}] * 4
    ep = run_episode(Scripted(acting), EchoTools(), max_rounds=3)
    assert (ep.stop, len(ep.rounds), ep.answer) == ("max_rounds", 3, "")
    ep = run_episode(Scripted(acting, end_at=2), EchoTools(), max_rounds=3)
    assert (ep.stop, len(ep.rounds)) == ("context_full", 2)
    with pytest.raises(ValueError, match="EpisodeEnd stop='full'"):
        EpisodeEnd("full")


def test_async_agents_and_tools_run_the_same_loop():
    class AsyncAgent(Scripted):
        async def act(self):
            return Scripted.act(self)

    class AsyncTools(EchoTools):
        async def execute(self, c):
            return EchoTools.execute(self, c)

    seen = []

    async def on_round(r):
        seen.append(r.round)

    ep = asyncio.run(play_episode(AsyncAgent([{"content": "", "tool_calls": [call("ls")]}, {"content": "ok"}]),
                                  AsyncTools(), max_rounds=4, on_round=on_round))
    assert (ep.stop, ep.answer, seen) == ("answer", "ok", [1, 2])


# ---------------------------------------------------------------- every harness runs the one loop
def loop_problems(name: str, source: str, *, harness: bool) -> list[str]:
    """What makes module `name` a second copy of the loop: a `for` over range(... max_rounds ...), the
    invalid-tool-call observation text, or (a harness) no use of ds_ttt.serve.episode's loop."""
    tree = ast.parse(source)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and "max_rounds" in ast.unparse(node.iter):
            problems.append(f"{name}:{node.lineno}: a loop over max_rounds (use ds_ttt.serve.episode)")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "invalid tool call:" in node.value \
                and id(node) not in docstrings:
            problems.append(f"{name}:{node.lineno}: writes the invalid-tool-call observation itself")
    if harness:
        used = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "ds_ttt.serve.episode"
                for a in n.names}
        if not used & {"play_episode", "run_episode"}:
            problems.append(f"{name}: does not import play_episode or run_episode from ds_ttt.serve.episode")
    return problems


def test_every_harness_runs_the_one_loop():
    problems = []
    for path in sorted((REPO / "ds_ttt").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel != LOOP_MODULE:
            problems += loop_problems(rel, path.read_text(), harness=rel in HARNESSES)
    assert problems == []


def test_the_loop_checker_can_fail():
    copy = ('from ds_ttt.serve.tools import BashToolRunner\n'
            'def run(session, tools, max_rounds):\n'
            '    for _ in range(max_rounds):\n'
            '        m = session.act()\n'
            '        session.observe([tools.execute(c) for c in m["tool_calls"]]\n'
            '                        + [f"[error: invalid tool call: {b}]" for b in m["invalid_tool_calls"]])\n')
    problems = loop_problems("copy.py", copy, harness=True)
    assert len(problems) == 3, problems
