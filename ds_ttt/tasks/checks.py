"""A task's test as data: exact outcome checks on the sandbox's final files or the agent's final answer,
rendered to the Harbor verifier script `tests/test.sh`.

    checks = [answer_file("answer.txt", "7"), answer_equals("42")]
    script = test_script(checks)          # bash: reward 1 when every check holds, else 0

Every check reads an outcome, never the commands the agent ran, so any correct solution passes, and
every check is exact, so an answer that merely contains the right value among others fails:
  answer_equals(value)            the whole final reply is `value`; surrounding whitespace (and \\r) and
                                  one trailing period are tolerated, nothing else ("7." passes, "7 lines",
                                  "1 2 ... 12" and "The answer is 7" fail)
  answer_file(path, value)        the file's whole content is `value` (each line's surrounding whitespace
                                  and blank lines ignored): an answer the instruction asks for in a file
  file_equals(path, text)         the same comparison for a file that is not an answer (e.g. a log)
  file_is(path, text)             the file holds exactly these bytes (sha256): a copy, an untouched file
  file_has_command(path, command) a line of it is `command`, optionally after `exec` (a launcher)
  file_has_word(path, word)       one of its whitespace-separated words is exactly `word`
  stored_under(dir, text, but_not) a file under `dir` other than `but_not` contains `text`
  executable(path)                the file is there with its execute bit set
  dir_holds_exactly(dir, names)   the directory's entries (hidden ones too) are exactly `names`
  absent(path)                    the file is not there
Paths are relative to the task's workdir (/app). The final reply is read from ANSWER_PATH: the
closed-loop runner and the Harbor agent (ds_ttt.serve.frontends.harbor_agent) write the reply that ends the
episode there; a task whose checks read it says so in task.toml (`check = "answer"`).
`answer_equals` and `answer_file` carry their expected value (`Check.expected`; `file_is(..., answer=)`
names the value a moved or copied file's check turns on): the blind policies (blind_policies.py) write
guesses where answers go, and the suite keeps such values out of the setup.
The script always writes the reward file, prints one line per check ("pass: ..." / "FAIL: ...") and
exits 0 (Harbor reads the reward, not the exit code).
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass

ANSWER_PATH = "/logs/agent/answer.txt"
REWARD_PATH = "/logs/verifier/reward.txt"
WORKDIR = "/app"


@dataclass(frozen=True)
class Check:
    """One outcome: a bash condition (true = holds) and what it means, for the verifier's log.
    expected: the answer value (answer_equals, answer_file, file_is(answer=)), else None;
    path: the answer file, if any."""

    what: str
    condition: str
    reads_answer: bool = False
    expected: str | None = None
    path: str | None = None


def _q(s: str) -> str:
    return shlex.quote(s)


def _ere(s: str) -> str:
    """`s` as a literal POSIX extended regular expression."""
    return re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\1", s)


def _trimmed(text: str) -> str:
    """What `_trim` in the verifier makes of a file: each line stripped, blank lines dropped."""
    return "\n".join(line.strip() for line in text.replace("\r", "").splitlines() if line.strip())


def file_equals(path: str, text: str) -> Check:
    return Check(f"{path} holds {text!r}",
                 f'[ -f {_q(path)} ] && [ "$(_trim < {_q(path)})" = {_q(_trimmed(text))} ]')


def answer_file(path: str, value: str) -> Check:
    c = file_equals(path, value)
    return Check(f"the answer file {path} holds exactly {value!r}", c.condition, expected=value, path=path)


def file_is(path: str, text: str, *, answer: str | None = None) -> Check:
    """answer: the value this outcome turns on, when it is not a text the agent writes (which file
    explore_largest moves): a blind replay that guesses the same value is a lucky guess, not a fixed script."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    return Check(f"{path} holds exactly its expected {len(text.encode())} bytes",
                 f'[ -f {_q(path)} ] && [ "$(sha256sum < {_q(path)} | cut -d" " -f1)" = {digest} ]', expected=answer)


def file_has_command(path: str, command: str) -> Check:
    pattern = f"[[:space:]]*(exec[[:space:]]+)?{_ere(command)}[[:space:]]*"
    return Check(f"{path} has a line running {command!r}", f"[ -f {_q(path)} ] && grep -qxE -- {_q(pattern)} {_q(path)}")


def file_has_word(path: str, word: str) -> Check:
    return Check(f"{path} has the word {word!r}",
                 f"[ -f {_q(path)} ] && tr -s '[:space:]' '\\n' < {_q(path)} | grep -qxF -- {_q(word)}")


def stored_under(path: str, text: str, *, but_not: str) -> Check:
    return Check(f"a file under {path}/ besides {but_not} holds {text!r}",
                 f"grep -rlF -- {_q(text)} {_q(path)} 2>/dev/null | grep -qvxF -- {_q(but_not)}")


def executable(path: str) -> Check:
    return Check(f"{path} is executable", f"[ -f {_q(path)} ] && [ -x {_q(path)} ]")


def dir_holds_exactly(path: str, names: list[str]) -> Check:
    listing = "\n".join(sorted(names))  # Python's code-point order is `LC_ALL=C sort`'s
    return Check(f"{path}/ holds exactly {sorted(names)}",
                 f'[ -d {_q(path)} ] && [ "$(ls -A {_q(path)} | LC_ALL=C sort)" = {_q(listing)} ]')


def absent(path: str) -> Check:
    return Check(f"{path} is gone", f"[ ! -e {_q(path)} ]")


def answer_equals(value: str) -> Check:
    return Check(f"the final answer is exactly {value!r}", f'[ "$(_answer)" = {_q(value)} ]',
                 reads_answer=True, expected=value)


def expected_answers(checks: list[Check]) -> list[str]:
    return [c.expected for c in checks if c.expected is not None]


def test_script(checks: list[Check]) -> str:
    """The verifier script: runs in the workdir, writes 1 or 0 to REWARD_PATH."""
    if not checks:
        raise ValueError("a task needs at least one check")
    lines = ["#!/bin/bash",
             "# The task's test (ds_ttt/tasks/checks.py): outcomes only, never the commands the agent ran.",
             f"# Reward 1 when every check holds, else 0, written to {REWARD_PATH}.",
             f"cd {WORKDIR} || exit 1",
             "_trim() { tr -d '\\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed -e '/^$/d'; }",
             # the whole reply, surrounding whitespace stripped, then one trailing period
             f"_answer() {{ local a; a=\"$(tr -d '\\r' < {ANSWER_PATH} 2>/dev/null)\"; "
             'a="${a#"${a%%[![:space:]]*}"}"; a="${a%"${a##*[![:space:]]}"}"; printf \'%s\' "${a%.}"; }',
             "ok=1"]
    for c in checks:
        lines.append(f"if {c.condition}; then echo {_q('pass: ' + c.what)}; else echo {_q('FAIL: ' + c.what)}; ok=0; fi")
    lines += [f"mkdir -p {shlex.quote(REWARD_PATH.rsplit('/', 1)[0])}", f"echo $ok > {REWARD_PATH}", "exit 0"]
    return "\n".join(lines) + "\n"
