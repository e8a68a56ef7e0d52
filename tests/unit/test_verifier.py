"""The verifier cannot be graded by the agent, and an unfinished final reply answers nothing.

Each hostile policy below runs its commands in the episode's persistent shell (as an agent's tool calls
do), never solves the task (the shipped count-lines task: /app/answer.txt must hold the line count),
and tries to make the verifier report success anyway:

  * plant_test        its own /tests/test.sh writing reward 1, made read-only (file and directory)
  * plant_reward      /logs/verifier/reward.txt = 1, read-only, in a read-only directory (the test cannot write)
  * reward_loop       a background job rewriting reward.txt = 1 every 10 ms
  * links             /logs/verifier a link to a read-only directory holding reward 1, /tests/test.sh a
                      link to a read-only script of its own
  * shell_functions   `exec` redefined in the persistent shell, through which the host's own
                      commands (write the test, run it, read the reward) used to be sent

Each must score 0 with the reason in the log; a real solution still scores 1 and doing nothing 0.
`score_outcome` keeps its signature so these tests also run against an older closed_loop.py.

Run: python -m pytest tests/unit/test_verifier.py
"""

from __future__ import annotations

import os
import shutil
import stat
import types

import pytest

from ds_ttt.data.render import final_answer, parse_assistant_message, reply_is_unfinished
from ds_ttt.evaluation.closed_loop import run_episode, score_outcome, verify_task
from ds_ttt.evaluation.verifier import place_verified
from ds_ttt.sandbox import Sandbox
from ds_ttt.tasks.checks import ANSWER_PATH, REWARD_PATH
from ds_ttt.tasks.suite import Task
from tests.harbor.scripted_agent import TASK_DIR

COUNT_LINES = Task(id="count-lines", kind="count_lines", family="explore_edit", seen=False, check="state", seed=0,
                   path=TASK_DIR)

PLANTED_TEST = "printf '#!/bin/bash\\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\\n'"
HOSTILE_POLICIES = {
    "plant_test": f"mkdir -p /tests && {PLANTED_TEST} > /tests/test.sh && chmod 555 /tests/test.sh /tests",
    "plant_reward": "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                    "chmod 444 /logs/verifier/reward.txt && chmod 555 /logs/verifier",
    "reward_loop": "mkdir -p /logs/verifier; (while :; do echo 1 > /logs/verifier/reward.txt; sleep 0.01; done) "
                   ">/dev/null 2>&1 &",
    "links": "mkdir -p /tmp/v && echo 1 > /tmp/v/reward.txt && chmod 444 /tmp/v/reward.txt && chmod 555 /tmp/v && "
             "rm -rf /logs/verifier && ln -s /tmp/v /logs/verifier && "
             f"{PLANTED_TEST} > /app/.t && chmod 555 /app/.t && mkdir -p /tests && ln -sf /app/.t /tests/test.sh",
    "shell_functions": "exec() { echo 1; }",
}


def episode_sandbox() -> Sandbox:
    """The closed-loop episode's sandbox for the shipped task (its /logs and /tests writable, as in Harbor)."""
    sb = Sandbox(timeout=10.0, dirs=("/logs", "/tests"))
    sb.add_tree(TASK_DIR / "environment")
    return sb


@pytest.fixture(autouse=True)
def tmp_stays_open():
    """Closing a sandbox twice once made the shared /tmp mode 0700 (files.remove_tree of a missing tree)."""
    yield
    assert stat.S_IMODE(os.stat("/tmp").st_mode) == 0o1777


@pytest.mark.parametrize("policy", sorted(HOSTILE_POLICIES))
def test_a_policy_cannot_grade_itself(policy):
    with episode_sandbox() as sb:
        sb.run(HOSTILE_POLICIES[policy])
        ok, log = score_outcome(sb, COUNT_LINES, "")
    assert not ok, log
    assert "fail" in log or "[verifier:" in log, log  # the real test ran and failed, or the verifier says why


def test_what_the_agent_left_in_the_verifier_directories_is_named_in_the_log():
    with episode_sandbox() as sb:
        sb.run(HOSTILE_POLICIES["plant_test"] + "; " + HOSTILE_POLICIES["plant_reward"])
        ok, log = score_outcome(sb, COUNT_LINES, "")
    assert not ok
    assert "discarded" in log and "/tests/test.sh" in log and "/logs/verifier/reward.txt" in log, log


def test_a_solution_still_passes_and_doing_nothing_fails():
    with episode_sandbox() as sb:
        sb.run("wc -l < notes.txt > answer.txt; sleep 30 &")  # a job left running is killed, the files kept
        ok, log = score_outcome(sb, COUNT_LINES, "")
    assert ok and "pass" in log, log
    with episode_sandbox() as sb:
        ok, log = score_outcome(sb, COUNT_LINES, "")
    assert not ok and "fail" in log, log
    result = verify_task(COUNT_LINES)
    assert result["oracle"] and not result["nop"] and result["valid"], result
    oracle_only = verify_task(COUNT_LINES, nop=False)  # the task suite's check after its blind-policy gate
    assert oracle_only["oracle"] and oracle_only["valid"] and "nop" not in oracle_only, oracle_only


def test_the_files_are_placed_in_one_request_unless_a_step_fails(monkeypatch):
    """Restoring, placing and checking run as one request; a step that fails there is done again one request
    each in a new sandbox, so that the log gives that step's own reason."""
    import ds_ttt.evaluation.verifier as verifier

    placed = []
    monkeypatch.setattr(verifier, "place_verified", lambda *a: placed.append(a[2]) or place_verified(*a))
    with episode_sandbox() as sb:
        sb.run("wc -l < notes.txt > answer.txt")
        ok, log = score_outcome(sb, COUNT_LINES, "")
    assert ok and placed == [], (log, placed)
    with episode_sandbox() as sb:  # the answer file a directory: writing the reply there fails
        sb.run("wc -l < notes.txt > answer.txt; mkdir -p /logs/agent/answer.txt")
        ok, log = score_outcome(sb, COUNT_LINES, "3")
    assert not ok and placed == [ANSWER_PATH], (log, placed)
    assert log.startswith(f"[verifier: writing {ANSWER_PATH} failed (exit 1): ") and "Is a directory" in log, log


@pytest.mark.parametrize("text, truncated, unfinished", [
    ("The file has 3 lines.", False, False),
    ("<think>\nit has 3 lines", True, True),  # cut at max_new_tokens
    ("<think>\nit has 3 lines", False, True),  # an unclosed think that ended anyway
    ('<think>ok</think>\n<tool_call>\n{"name": "bash", "arguments": {"command": "echo 3', False, True),
    ('<think>ok</think>\n3', False, False),
    ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n3', False, False),
])
def test_an_unfinished_reply_answers_nothing(text, truncated, unfinished):
    content = parse_assistant_message(text)["content"]
    assert reply_is_unfinished(content, truncated=truncated) == unfinished
    assert final_answer(content, truncated=truncated) == ("" if unfinished else content)


class _ScriptedSession:
    """Stands in for AgentSession: one final reply, `message`, no tool call."""

    message: dict = {}

    def __init__(self, *args, **kwargs):
        self.num_updates = 0
        self.input_ids = [0]
        self.agent = types.SimpleNamespace(prompt_ids=[1])
        self.history = [types.SimpleNamespace(action_token_nll=[0.5, 0.5, 0.5])]

    def reset(self, instruction):
        pass

    def begin_decode(self):
        return types.SimpleNamespace(action=[0, 1, 2])

    def end_decode(self, decode):
        return dict(self.message)


class _InlineEngine:
    def run(self, fn):
        return fn()

    def generate(self, decodes):
        pass


def test_a_truncated_final_reply_writes_an_empty_answer(tmp_path, monkeypatch):
    """The reply was cut inside a tool call whose partial command holds the number the test looks for."""
    task_dir = tmp_path / "answer-three"
    (task_dir / "environment").mkdir(parents=True)
    (task_dir / "environment" / "notes.txt").write_text("a\nb\nc\n")
    (task_dir / "tests").mkdir()
    (task_dir / "tests" / "test.sh").write_text(  # reward 1 when the final answer states 3
        f"mkdir -p /logs/verifier\nif grep -qw 3 {ANSWER_PATH}; then echo 1; else echo 0; fi > {REWARD_PATH}\n")
    (task_dir / "instruction.md").write_text("How many lines has notes.txt?")
    task = Task(id="answer-three", kind="count_lines", family="explore_edit", seen=False, check="answer", seed=0,
                path=task_dir)
    import ds_ttt.serve.session as session_module

    monkeypatch.setattr(session_module, "AgentSession", _ScriptedSession)
    cut = parse_assistant_message('<think>count</think>\n<tool_call>\n'
                                  '{"name": "bash", "arguments": {"command": "echo 3')
    for message, solved, stop in ((dict(cut, truncated=True), False, "truncated"), (cut, False, "truncated"),
                                  ({"role": "assistant", "content": "It has 3 lines."}, True, "answer")):
        _ScriptedSession.message = message
        ep = run_episode(None, _InlineEngine(), task, mode="ttt")
        assert (ep.success, ep.stop) == (solved, stop), (message, ep)
    shutil.rmtree(task_dir)
