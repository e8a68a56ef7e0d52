"""Exact checks and the blind-policy gate: answers are compared whole, a launcher line exactly, and a
suite whose test a blind policy passes is refused, naming task and policy, and not written.

Run: .venv/bin/python -m pytest -q tests/unit/test_blind_policies.py
"""

from __future__ import annotations

import re

import pytest

from ds_ttt.evaluation.closed_loop import score_outcome, score_outcomes
from ds_ttt.sandbox import Sandbox
from ds_ttt.tasks import checks as ck
from ds_ttt.tasks.blind_policies import BlindPolicyPasses, check_suite, policies
from ds_ttt.tasks.suite import load_suite, write_suite


class _FakeTask:
    def __init__(self, checks: list[ck.Check]):
        self.test = ck.test_script(checks)


def _reward(checks: list[ck.Check], commands: list[str], answer: str) -> bool:
    with Sandbox(timeout=10.0, dirs=("/logs", "/tests")) as sb:
        for c in commands:
            sb.run(c)
        return score_outcome(sb, _FakeTask(checks), answer)[0]


def test_answer_equals_takes_the_whole_reply_not_a_word_of_it():
    """The old answer_contains (grep -w anywhere in the reply) passed every reply refused here."""
    exact = [ck.answer_equals("12")]
    assert _reward(exact, [], "12")
    assert _reward(exact, [], "  12.\n\n")  # surrounding whitespace and one trailing period are tolerated
    for reply in (" ".join(str(i) for i in range(101)), "The total is 12.", "12 lines", "12..", "`12`", "112", ""):
        assert not _reward(exact, [], reply), reply
    line = [ck.answer_equals("build.sh: 3fa9c2d1 done")]
    assert _reward(line, [], "build.sh: 3fa9c2d1 done\n")
    assert not _reward(line, [], "The last line is: build.sh: 3fa9c2d1 done")


def test_answer_files_launchers_and_modes_are_exact():
    numbers = "\n".join(str(i) for i in range(101))
    count = [ck.answer_file("answer.txt", "12")]
    assert _reward(count, ["printf '  12\\n\\n' > answer.txt"], "")
    assert not _reward(count, [f"printf '{numbers}\\n' > answer.txt"], "")
    assert not _reward(count, ["echo 123 > answer.txt"], "")
    launcher = [ck.file_has_command("start.sh", "./api --port 38075")]
    assert _reward(launcher, ["printf '#!/bin/sh\\nexec ./api --port 38075\\n' > start.sh"], "")
    assert _reward(launcher, ["printf './api --port 38075\\n' > start.sh"], "")
    assert not _reward(launcher, ["printf 'exec ./api --port 380751\\n' > start.sh"], "")  # a substring check passed it
    run = [ck.executable("r.sh")]
    assert not _reward(run, ["echo 'echo hi' > r.sh"], "") and _reward(run, ["echo 'echo hi' > r.sh && chmod +x r.sh"], "")
    exactly = [ck.dir_holds_exactly("restore", ["README", "a.tar.gz"])]
    assert _reward(exactly, ["mkdir restore && touch restore/README restore/a.tar.gz"], "")
    assert not _reward(exactly, ["mkdir restore && touch restore/README restore/a.tar.gz restore/b.tar.gz"], "")


def _old_memory_filename_test(task) -> str:
    """The test memory_filename had: only restore/<newest> was checked."""
    newest = re.search(r"cp backups/(\S+) restore/", (task.path / "solution" / "solve.sh").read_text()).group(1)
    content = (task.environment / "backups" / newest).read_text()
    return ck.test_script([ck.file_equals(f"restore/{newest}", content)])


def test_the_gate_refuses_a_suite_a_blind_policy_passes_and_writes_nothing(tmp_path):
    def with_the_old_test(tasks, guesses):
        (tasks[0].path / "tests" / "test.sh").write_text(_old_memory_filename_test(tasks[0]))
        return check_suite(tasks, guesses)

    out = tmp_path / "refused"
    with pytest.raises(BlindPolicyPasses, match=r"dev-memory_filename-000 by copy_everything_into:restore"):
        write_suite(out, split="dev", num_per_kind=2, kinds=["memory_filename"], progress=False, guess_draws=1,
                    check_blind=with_the_old_test)
    assert not out.exists()

    ok = write_suite(tmp_path / "ok", split="dev", num_per_kind=2, kinds=["memory_filename"], progress=False,
                     guess_draws=1, check_blind=check_suite)
    assert ok["blind_checked"] and all(v["solved"] == 0 for v in ok["blind_policies"].values())
    _, tasks = load_suite(tmp_path / "ok")
    names = {p.name for p in policies(tasks[0], "7")}
    assert {"nothing", "echo_instruction", "constant:0", "constant:1", "constant:yes", "constant:7", "numbers_spaces",
            "numbers_lines", "copy_everything_into:restore", "move_everything_into:restore"} <= names


def test_replies_share_one_agent_sandbox_and_each_is_tested_alone():
    """score_outcomes: what one agent left, carried over once; each reply its own verifier run."""
    with Sandbox(timeout=10.0, dirs=("/logs", "/tests")) as sb:
        sb.run("echo 12 > count.txt")
        got = score_outcomes(sb, _FakeTask([ck.answer_equals("12"), ck.file_equals("count.txt", "12\n")]),
                             ["12", "13", "", "12"])
    assert [ok for ok, _ in got] == [True, False, False, True]
    assert all(log for _, log in got)


def test_the_gate_names_the_no_command_policy_that_passes(tmp_path):
    """The policies without commands run together (run_blind_replies); their verdicts must come back to
    the right policy: a test that the echoed instruction passes is refused naming echo_instruction only."""
    def with_an_echo_test(tasks, guesses):
        (tasks[0].path / "tests" / "test.sh").write_text(ck.test_script([ck.answer_equals(tasks[0].instruction.strip().removesuffix("."))]))
        return check_suite(tasks, guesses)

    with pytest.raises(BlindPolicyPasses, match=r"^1 blind \(task, policy\) pair\(s\) pass: "
                                                r"dev-memory_filename-000 by echo_instruction$"):
        write_suite(tmp_path / "refused", split="dev", num_per_kind=2, kinds=["memory_filename"], progress=False,
                    guess_draws=1, check_blind=with_an_echo_test)
