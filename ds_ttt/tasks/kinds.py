"""Task kinds of the closed-loop suite: a world, an instruction, a test on the outcome, a reference solution.

    from ds_ttt.tasks.kinds import KINDS
    task = KINDS["explore_csv"].build(random.Random("task:explore_csv:6000001"))   # a TaskSpec

Two sorts of kinds:
  * from the generator's families (`seen=True`): the world and the instruction are exactly what the
    training generator builds (ds_ttt/data/families.py, shell_families.py), made by running the family's
    own scripted expert once in a throwaway sandbox. What the expert wrote before its first command is
    the task's setup; its commands are the reference solution; the test is built from the world
    (counts, values, the file the instruction names), so it checks the outcome any correct solution
    reaches, not the expert's commands. Variants whose goal has no checkable outcome ("show the
    contents of f", "print the numbers sorted") are not tasks: their success is only on the screen.
  * unseen kinds (`seen=False`): goals or phrasings that training never shows, written here with their
    own world and solution: memory worlds of the held-out pool (names, value formats and readback
    commands training never uses), a port lookup phrased as a question with its own output file,
    a total over several files, and a script to make runnable and capture.

A kind's `family` is its generator family, or that of the skill it probes for unseen kinds, so
success can be reported per family.
"""

from __future__ import annotations

import random
import re
import shlex
from dataclasses import dataclass, field
from typing import Callable

from ds_ttt.data import families as fam
from ds_ttt.data import family_common as common
from ds_ttt.data import shell_families as shell
from ds_ttt.data.generator import Episode
from ds_ttt.sandbox import Sandbox
from ds_ttt.tasks import checks as ck


@dataclass
class TaskSpec:
    """One task before it is written out (ds_ttt/tasks/suite.py writes it as a Harbor task)."""

    instruction: str
    files: list[tuple[str, str, int]]  # (path relative to the workdir, text, mode)
    checks: list[ck.Check]
    solution: list[str]  # reference commands, run in one shell from the workdir
    answer: str = ""  # the reference final reply (for tasks whose checks read it)
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Kind:
    name: str
    family: str
    seen: bool
    build: Callable[[random.Random], TaskSpec]


class _Recording(Episode):
    """The generator's Episode, also recording the world it writes, the commands and the final reply."""

    def __init__(self, sandbox: Sandbox):
        super().__init__(sandbox, "task", "", "")
        self.files: list[tuple[str, str, int]] = []
        self.commands: list[str] = []
        self.answer = ""

    def write(self, rel: str, text: str, mode: int | None = None) -> None:
        if self.commands:
            raise RuntimeError(f"the family writes {rel} after its first command: not a setup file")
        self.files.append((rel, text, 0o644 if mode is None else mode))
        super().write(rel, text, mode)

    def act(self, reasoning: str, command: str, expect_fail: bool = False) -> str:
        self.commands.append(command)
        return super().act(reasoning, command, expect_fail)

    def finish(self, reasoning: str, answer: str, success: bool = True) -> None:
        self.answer = answer
        super().finish(reasoning, answer, success)


class NoTask(Exception):
    """This draw of a family gives no checkable task (e.g. the file to report does not exist)."""


def _from_family(policy, make_checks) -> Callable[[random.Random], TaskSpec]:
    def build(rng: random.Random) -> TaskSpec:
        with Sandbox(timeout=10.0) as sb:
            ep = _Recording(sb)
            policy(ep, rng)
        if not ep.meta.get("success", True):
            raise NoTask(f"{policy.__name__}: the expert's episode ends in failure")
        files = {p: t for p, t, _ in ep.files}
        checks = make_checks(files, ep)
        return TaskSpec(ep.meta["task"], ep.files, checks, ep.commands, ep.answer,
                        {"expert_rounds": len(ep.commands)})
    return build


# ---- checks of the family-derived kinds (from the world; `ep` gives the instruction and the facts) ----------
def _memory_config(files, ep):
    fact = ep.meta["memory_checks"][0]["fact"]
    task = ep.meta["task"]
    if "start.sh" in task:
        return [ck.file_contains("start.sh", f"--port {fact}")]
    if "auth.env" in task:
        return [ck.file_has_line("deploy/auth.env", f"TOKEN={fact}")]
    return [ck.file_equals("RELEASE", fact)]


def _memory_filename(files, ep):
    newest = ep.meta["memory_checks"][0]["fact"]
    return [ck.file_equals(f"restore/{newest}", files[f"backups/{newest}"])]


def _memory_world(files, ep):
    return [ck.file_contains("vault/summary.txt", f"{n}={v}") for n, v in ep.meta["values"].items()]


def _recovery_missing_file(files, ep):
    key = re.search(r"value of `(\w+)`", ep.meta["task"]).group(1)
    values = {line.split(": ", 1)[1] for text in files.values() for line in text.splitlines()
              if line.startswith(f"{key}: ")}
    (value,) = values
    return [ck.answer_contains(value)]


def _recovery_permission(files, ep):
    (script,) = [t for p, t in files.items() if p.endswith(".sh")]
    last = re.findall(r'^echo "(.*)"$', script, re.M)[-1]
    return [ck.answer_contains(last)]


def _recovery_grep_case(files, ep):
    word = re.search(r"How many (\w+) lines", ep.meta["task"]).group(1)
    (log,) = [t for p, t in files.items() if p.startswith("logs/")]
    n = sum(word.upper() in line for line in log.splitlines())
    return [ck.answer_contains(str(n))]


def _explore_replace(files, ep):
    flag = re.search(r"Turn (\w+) off", ep.meta["task"]).group(1)
    return [ck.file_has_line(p, f"{flag}=false") for p, t in sorted(files.items())
            if p.endswith(".env") and f"{flag}=" in t]


def _explore_count(files, ep):
    ext = re.search(r"in the \.(\w+) files", ep.meta["task"]).group(1)
    n = sum(t.count("TODO") for p, t in files.items() if p.endswith(f".{ext}"))
    return [ck.file_equals("todo_count.txt", str(n))]


def _explore_rename(files, ep):
    old, new = re.search(r"Rename the function (\w+) to (\w+)", ep.meta["task"]).groups()
    out = []
    for p, t in sorted(files.items()):
        uses = len(re.findall(rf"\b{old}\b", t))
        out += [ck.file_lacks_word(p, old), ck.file_word_count(p, new, uses)]
    return out


def _explore_largest(files, ep):
    data = {p: len(t) for p, t in files.items() if p.startswith("data/")}
    largest = max(data, key=data.get)
    name = largest.split("/", 1)[1]
    return ([ck.exists(f"archive/{name}"), ck.absent(largest)]
            + [ck.exists(p) for p in sorted(data) if p != largest])


def _explore_csv(files, ep):
    region = re.search(r"for the (\w+) region", ep.meta["task"]).group(1)
    n = sum(f",{region}," in line for line in files["sales.csv"].splitlines())
    return [ck.file_equals("answer.txt", str(n))]


def _shell_cd(files, ep):
    proj, sub = re.search(r"inside projects/(\w+)/(\w+):", ep.meta["task"]).groups()
    here = f"projects/{proj}/{sub}/"
    total = sum(t.count("\n") for p, t in files.items() if p.startswith(here) and p.endswith(".py"))
    return [ck.file_equals(f"{here}total.txt", str(total))]


def _shell_background(files, ep):
    steps = re.findall(r'^echo "(step \d+: \w+ ok)"$', files["build.sh"], re.M)
    return [ck.file_has_line("build.log", s) for s in steps] + [ck.file_has_line("build.log", "BUILD DONE")]


# ---- unseen kinds ------------------------------------------------------------------------------------------
def _memory_world_heldout(rng: random.Random) -> TaskSpec:
    return _from_family(lambda ep, r: fam.memory_world(ep, r, pool="heldout"), _memory_world)(rng)


def _port_question(rng: random.Random) -> TaskSpec:
    svc = rng.choice(common.SERVICES)
    port = str(rng.randint(20000, 65000))
    cfg_dir = rng.choice(["config", "etc", "conf"])
    files = [(f"{cfg_dir}/{svc}.ini", f"[{svc}]\nhost = 127.0.0.1\nport = {port}\nworkers = {rng.randint(2, 16)}\n", 0o644),
             (f"{cfg_dir}/defaults.ini", "[defaults]\nport = 8080\n", 0o644),
             ("logs/boot.log", common.random_lines(rng, 3, "boot: "), 0o644)]
    return TaskSpec(f"On which port does the {svc} service listen? Its settings are in this directory. "
                    "Put just the number in port.txt.", files, [ck.file_equals("port.txt", port)],
                    [f"ls {cfg_dir}", f"grep '^port' {cfg_dir}/{svc}.ini | cut -d' ' -f3 > port.txt"])


def _line_total(rng: random.Random) -> TaskSpec:
    names = sorted(set(rng.sample(common.WORDS, rng.randint(2, 4))))
    files, total = [], 0
    for n in names:
        k = rng.randint(1, 9)
        total += k
        files.append((f"notes/{n}.txt", common.random_lines(rng, k), 0o644))
    files.append(("notes/README.md", "# notes\nnot a note\n", 0o644))
    return TaskSpec("How many lines do the .txt files in notes/ have together? Write the number (digits only) "
                    "to total.txt.", files, [ck.file_equals("total.txt", str(total))],
                    ["cat notes/*.txt | wc -l > total.txt"])


def _capture_script(rng: random.Random) -> TaskSpec:
    name = rng.choice(["report.sh", "summary.sh", "check.sh"])
    printed = [f"{common.random_name(rng)}: {rng.randint(1, 99)}" for _ in range(rng.randint(2, 4))]
    script = "#!/bin/sh\n" + "".join(f'echo "{line}"\n' for line in printed)
    expected = "\n".join(printed)
    out = name.replace(".sh", ".txt")
    return TaskSpec(f"./{name} should print a short report. Make it runnable and save what it prints in {out}.",
                    [(name, script, 0o644)], [ck.file_equals(out, expected)],
                    [f"chmod +x {name}", f"./{name} > {out}"])


_FAMILY_KINDS = (
    ("memory", fam.memory_config, _memory_config),
    ("memory", fam.memory_filename, _memory_filename),
    ("memory", fam.memory_world, _memory_world),
    ("error_recovery", fam.recovery_missing_file, _recovery_missing_file),
    ("error_recovery", fam.recovery_permission, _recovery_permission),
    ("error_recovery", fam.recovery_grep_case, _recovery_grep_case),
    ("explore_edit", fam.explore_replace, _explore_replace),
    ("explore_edit", fam.explore_count, _explore_count),
    ("explore_edit", fam.explore_rename, _explore_rename),
    ("explore_edit", fam.explore_largest, _explore_largest),
    ("explore_edit", fam.explore_csv, _explore_csv),
    ("shell_state", shell.shell_cd, _shell_cd),
    ("shell_state", shell.shell_background, _shell_background),
)
KINDS: dict[str, Kind] = {p.__name__: Kind(p.__name__, family, True, _from_family(p, make))
                          for family, p, make in _FAMILY_KINDS}
KINDS.update({
    "memory_world_heldout": Kind("memory_world_heldout", "memory", False, _memory_world_heldout),
    "port_question": Kind("port_question", "memory", False, _port_question),
    "line_total": Kind("line_total", "explore_edit", False, _line_total),
    "capture_script": Kind("capture_script", "error_recovery", False, _capture_script),
})


def solution_script(task: TaskSpec) -> str:
    """solution/solve.sh: the reference commands in one shell, then the reference final reply where the
    checks read it (Harbor's oracle agent runs this)."""
    lines = ["#!/bin/bash", "# The reference solution (ds_ttt/tasks/kinds.py): Harbor's oracle agent runs it.",
             "cd /app"]
    lines += task.solution  # no `set -e`: a failing step (an expert's deliberate typo) does not stop it
    if any(c.reads_answer for c in task.checks):
        lines += [f"mkdir -p {shlex.quote(ck.ANSWER_PATH.rsplit('/', 1)[0])}",
                  f"printf '%s\\n' {shlex.quote(task.answer)} > {ck.ANSWER_PATH}"]
    return "\n".join(lines) + "\n"
