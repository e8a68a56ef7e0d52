"""A task's test as data: outcome checks on the sandbox's final files or the agent's final answer,
rendered to the Harbor verifier script `tests/test.sh`.

    checks = [file_equals("answer.txt", "7"), answer_contains("42")]
    script = test_script(checks)          # bash: reward 1 when every check holds, else 0

Every check reads an outcome, never the commands the agent ran, so any correct solution passes:
  file_equals(path, text)        the file holds `text` (leading/trailing whitespace ignored)
  file_has_line(path, line)      one of its lines is exactly `line`
  file_contains(path, text)      `text` occurs in it
  file_lacks_word(path, word)    `word` occurs in it nowhere as a whole word
  file_word_count(path, word, n) `word` occurs exactly n times as a whole word
  exists(path) / absent(path)    the file is there / is not
  answer_contains(text)          the agent's final reply holds `text` as a whole word or phrase
Paths are relative to the task's workdir (/app). The final reply is read from ANSWER_PATH: the
closed-loop runner and the Harbor agent (ds_ttt.serve.harbor_agent) write the reply that ends the
episode there; a task whose checks read it says so in task.toml (`check = "answer"`).
The script always writes the reward file, prints one line per check ("pass: ..." / "FAIL: ...") and
exits 0 (Harbor reads the reward, not the exit code).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

ANSWER_PATH = "/logs/agent/answer.txt"
REWARD_PATH = "/logs/verifier/reward.txt"
WORKDIR = "/app"


@dataclass(frozen=True)
class Check:
    """One outcome: a bash condition (true = holds) and what it means, for the verifier's log."""

    what: str
    condition: str
    reads_answer: bool = False


def _q(s: str) -> str:
    return shlex.quote(s)


def file_equals(path: str, text: str) -> Check:
    return Check(f"{path} holds {text!r}",
                 f'[ -f {_q(path)} ] && [ "$(_trim < {_q(path)})" = {_q(text.strip())} ]')


def file_has_line(path: str, line: str) -> Check:
    return Check(f"{path} has the line {line!r}", f"[ -f {_q(path)} ] && grep -qxF -- {_q(line)} {_q(path)}")


def file_contains(path: str, text: str) -> Check:
    return Check(f"{path} contains {text!r}", f"[ -f {_q(path)} ] && grep -qF -- {_q(text)} {_q(path)}")


def file_lacks_word(path: str, word: str) -> Check:
    return Check(f"{path} no longer mentions {word!r}", f"[ -f {_q(path)} ] && ! grep -qw -- {_q(word)} {_q(path)}")


def file_word_count(path: str, word: str, n: int) -> Check:
    return Check(f"{path} mentions {word!r} {n} time(s)",
                 f'[ -f {_q(path)} ] && [ "$(grep -ow -- {_q(word)} {_q(path)} | wc -l)" -eq {int(n)} ]')


def exists(path: str) -> Check:
    return Check(f"{path} exists", f"[ -e {_q(path)} ]")


def absent(path: str) -> Check:
    return Check(f"{path} is gone", f"[ ! -e {_q(path)} ]")


def answer_contains(text: str) -> Check:
    # -w: "12" must not match inside "123"; -F: the text is literal
    return Check(f"the final answer states {text!r}", f"grep -qwF -- {_q(text)} {ANSWER_PATH} 2>/dev/null",
                 reads_answer=True)


def test_script(checks: list[Check]) -> str:
    """The verifier script: runs in the workdir, writes 1 or 0 to REWARD_PATH."""
    if not checks:
        raise ValueError("a task needs at least one check")
    lines = ["#!/bin/bash",
             "# The task's test (ds_ttt/tasks/checks.py): outcomes only, never the commands the agent ran.",
             f"# Reward 1 when every check holds, else 0, written to {REWARD_PATH}.",
             f"cd {WORKDIR} || exit 1",
             "_trim() { tr -d '\\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed -e '/^$/d'; }",
             "ok=1"]
    for c in checks:
        lines.append(f"if {c.condition}; then echo {_q('pass: ' + c.what)}; else echo {_q('FAIL: ' + c.what)}; ok=0; fi")
    lines += [f"mkdir -p {shlex.quote(REWARD_PATH.rsplit('/', 1)[0])}", f"echo $ok > {REWARD_PATH}", "exit 0"]
    return "\n".join(lines) + "\n"
