"""Task kinds of the closed-loop suite: a world, an instruction, an exact test on the outcome, a reference solution.

    from ds_ttt.tasks.kinds import KINDS
    task = KINDS["explore_csv"].build(random.Random("task:explore_csv:6000001"))   # a TaskSpec

Two sorts of kinds:
  * from the generator's families (`seen=True`): the world and the instruction are what the training
    generator builds (ds_ttt/data/families.py, shell_families.py), made by running the family's own
    scripted expert once in a throwaway sandbox. What the expert wrote before its first command is the
    task's setup; its commands are the reference solution; the test is built from the world (counts,
    values, the file the instruction names), so it checks the outcome any correct solution reaches, not
    the expert's commands. Variants whose goal has no checkable outcome ("show the contents of f",
    "print the numbers sorted") are not tasks: their success is only on the screen.
    Two wrappers change what the family wrote, never the family itself (training data stays as it is):
      - a task answered in the final reply gets one sentence more, ANSWER_ONLY ("Reply with only ..."),
        since its test compares the whole reply (checks.answer_equals);
      - recovery_permission's script computes its last line (a hash of a word) instead of holding it
        literally, so the answer is seen only by running the script (the family's script printed a
        line written in it: `cat` answered the task without the permission fix it is about).
  * unseen kinds (`seen=False`): goals or phrasings that training never shows, written here with their
    own world and solution: memory worlds of the held-out pool (names, value formats and readback
    commands training never uses), a port lookup phrased as a question with its own output file, a
    total over several files, a script to make runnable and capture (its lines computed, not written
    in it), and a background job released by a flag file whose name only the script tells.

shell_background (the family) is not a kind: its instruction and its expert's commands are the same for
every seed ("create the file go"), so one fixed script solved all 12 instances without reading a
single observation. `background_flag` replaces it: the script's name, the log's name and the flag it
waits for vary with the seed, and the flag is named only inside the script, so the job finishes only
for an agent that reads it; the log's lines are computed, so the expected log is not in the setup.

`answer_in_world`: a lookup kind, whose answer is by design a value written in a setup file (a config's
port, a file's value); every other kind's expected answers appear in no setup file (the suite's tests
check it). A kind's `family` is its generator family, or that of the skill it probes for unseen kinds,
so success can be reported per family. Whether a kind needs the observation at all (one instance's
reference solution replayed blind solves another) is measured when the suite is written
(ds_ttt/tasks/blind_policies.py).
"""

from __future__ import annotations

import hashlib
import random
import re
import shlex
from dataclasses import dataclass, field
from typing import Callable

from ds_ttt.data import families as fam
from ds_ttt.data import family_common as common
from ds_ttt.data.generator import Episode
from ds_ttt.data import shell_families as shell
from ds_ttt.sandbox import Sandbox
from ds_ttt.tasks import checks as ck

ANSWER_ONLY = " Reply with only {what}, nothing else."


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
    answer_in_world: bool = False


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


def _from_family(policy, make_test) -> Callable[[random.Random], TaskSpec]:
    """A kind from a family: `make_test(spec, files, meta, rng)` sets the spec's checks (and, for the
    wrappers the module docstring names, its answer, instruction or files) from the recorded world."""
    def build(rng: random.Random) -> TaskSpec:
        with Sandbox(timeout=10.0) as sb:
            ep = _Recording(sb)
            policy(ep, rng)
        if not ep.meta.get("success", True):
            raise NoTask(f"{policy.__name__}: the expert's episode ends in failure")
        spec = TaskSpec(ep.meta["task"], ep.files, [], ep.commands, ep.answer, {"expert_rounds": len(ep.commands)})
        make_test(spec, {p: t for p, t, _ in ep.files}, ep.meta, rng)
        return spec
    return build


def _answer_in_reply(spec: TaskSpec, value: str, what: str) -> None:
    spec.instruction += ANSWER_ONLY.format(what=what)
    spec.checks = [ck.answer_equals(value)]
    spec.answer = value


def _short_hash(text: str) -> str:
    """What `printf '%s' TEXT | sha256sum | cut -c1-8` prints: a value seen only by running the command."""
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _hash_command(text: str) -> str:
    return f"$(printf '%s' {shlex.quote(text)} | sha256sum | cut -c1-8)"


# ---- tests of the family-derived kinds (from the world; `meta` gives the instruction and the facts) ---------
def _memory_config(spec, files, meta, rng):
    fact = meta["memory_checks"][0]["fact"]
    task = meta["task"]
    if "start.sh" in task:
        svc = re.search(r"The (\w+) service configuration", task).group(1)
        spec.checks = [ck.file_has_command("start.sh", f"./{svc} --port {fact}")]
    elif "auth.env" in task:
        spec.checks = [ck.answer_file("deploy/auth.env", f"TOKEN={fact}")]
    else:
        spec.checks = [ck.answer_file("RELEASE", fact)]


def _memory_filename(spec, files, meta, rng):
    """restore/ ends with its README and the newest backup (same bytes), nothing else; backups/ unchanged."""
    newest = meta["memory_checks"][0]["fact"]
    backups = {p.split("/", 1)[1]: t for p, t in files.items() if p.startswith("backups/")}
    spec.checks = ([ck.dir_holds_exactly("restore", ["README", newest]), ck.file_is(f"restore/{newest}", backups[newest], answer=newest),
                    ck.file_is("restore/README", files["restore/README"]), ck.dir_holds_exactly("backups", list(backups))]
                   + [ck.file_is(f"backups/{n}", t) for n, t in sorted(backups.items())])


def _memory_world(spec, files, meta, rng):
    """Each value is in the summary as a whole `name=value` word and stored in a vault file besides it."""
    spec.checks = [c for n, v in meta["values"].items()
                   for c in (ck.file_has_word("vault/summary.txt", f"{n}={v}"),
                             ck.stored_under("vault", v, but_not="vault/summary.txt"))]


def _recovery_missing_file(spec, files, meta, rng):
    key = re.search(r"value of `(\w+)`", meta["task"]).group(1)
    values = {line.split(": ", 1)[1] for text in files.values() for line in text.splitlines()
              if line.startswith(f"{key}: ")}
    (value,) = values
    _answer_in_reply(spec, value, "the value")


def _recovery_permission(spec, files, meta, rng):
    """The script's last line becomes computed (module docstring); the answer is that line."""
    (name,) = [p for p in files if p.endswith(".sh")]
    word = re.findall(rf'^echo "{re.escape(name)}: (\w+) done"$', files[name], re.M)[-1]
    salted = f"{word}-{common.random_hex(rng, 8)}"
    script = f'#!/bin/sh\necho "{name}: step 1 ok"\necho "{name}: {_hash_command(salted)} done"\n'
    spec.files = [(p, script if p == name else t, m) for p, t, m in spec.files]
    _answer_in_reply(spec, f"{name}: {_short_hash(salted)} done", "that line")


def _recovery_grep_case(spec, files, meta, rng):
    word = re.search(r"How many (\w+) lines", meta["task"]).group(1)
    (log,) = [t for p, t in files.items() if p.startswith("logs/")]
    _answer_in_reply(spec, str(sum(word.upper() in line for line in log.splitlines())), "the number")


def _explore_replace(spec, files, meta, rng):
    """Every file ends exactly as the world with FLAG=true lines set to false: nothing else changed."""
    flag = re.search(r"Turn (\w+) off", meta["task"]).group(1)
    spec.checks = [ck.file_is(p, re.sub(rf"^{flag}=true$", f"{flag}=false", t, flags=re.M)) for p, t in sorted(files.items())]


def _explore_count(spec, files, meta, rng):
    ext = re.search(r"in the \.(\w+) files", meta["task"]).group(1)
    n = sum(t.count("TODO") for p, t in files.items() if p.endswith(f".{ext}"))
    spec.checks = [ck.answer_file("todo_count.txt", str(n))]


def _explore_rename(spec, files, meta, rng):
    """Every file of pkg/ ends exactly as the world with the old name replaced as a whole word."""
    old, new = re.search(r"Rename the function (\w+) to (\w+)", meta["task"]).groups()
    spec.checks = [ck.file_is(p, re.sub(rf"\b{old}\b", new, t)) for p, t in sorted(files.items())]


def _explore_largest(spec, files, meta, rng):
    """archive/ gains the largest file (same bytes), data/ keeps exactly the others, untouched."""
    data = {p.split("/", 1)[1]: t for p, t in files.items() if p.startswith("data/")}
    largest = max(data, key=lambda n: len(data[n]))
    rest = sorted(n for n in data if n != largest)
    spec.checks = ([ck.file_is(f"archive/{largest}", data[largest], answer=largest), ck.absent(f"data/{largest}"),
                    ck.dir_holds_exactly("archive", [".keep", largest]), ck.dir_holds_exactly("data", rest)]
                   + [ck.file_is(f"data/{n}", data[n]) for n in rest])


def _explore_csv(spec, files, meta, rng):
    region = re.search(r"for the (\w+) region", meta["task"]).group(1)
    n = sum(f",{region}," in line for line in files["sales.csv"].splitlines())
    spec.checks = [ck.answer_file("answer.txt", str(n))]


def _shell_cd(spec, files, meta, rng):
    proj, sub = re.search(r"inside projects/(\w+)/(\w+):", meta["task"]).groups()
    here = f"projects/{proj}/{sub}/"
    total = sum(t.count("\n") for p, t in files.items() if p.startswith(here) and p.endswith(".py"))
    spec.checks = [ck.answer_file(f"{here}total.txt", str(total))]


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
                    "Put just the number in port.txt.", files, [ck.answer_file("port.txt", port)],
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
                    "to total.txt.", files, [ck.answer_file("total.txt", str(total))],
                    ["cat notes/*.txt | wc -l > total.txt"])


def _capture_script(rng: random.Random) -> TaskSpec:
    """The script computes what it prints (shell arithmetic), so the report is not written in it."""
    name = rng.choice(["report.sh", "summary.sh", "check.sh"])
    terms = [(common.random_name(rng), rng.randint(2, 40), rng.randint(2, 40)) for _ in range(rng.randint(2, 4))]
    script = "#!/bin/sh\n" + "".join(f'echo "{w}: $(({a} * {b}))"\n' for w, a, b in terms)
    expected = "\n".join(f"{w}: {a * b}" for w, a, b in terms)
    out = name.replace(".sh", ".txt")
    return TaskSpec(f"./{name} should print a short report. Make it runnable and save what it prints in {out}.",
                    [(name, script, 0o644)], [ck.executable(name), ck.answer_file(out, expected)],
                    [f"chmod +x {name}", f"./{name} > {out}"])


def _background_flag(rng: random.Random) -> TaskSpec:
    """A job that waits for a flag file named only inside its script (module docstring)."""
    script = rng.choice(["build.sh", "compile.sh", "package.sh"])
    log = rng.choice(["build.log", "job.log", "output.log"])
    flag = f".{rng.choice(['ready', 'go', 'start', 'release'])}-{common.random_name(rng)}"
    salt = common.random_hex(rng, 8)
    steps = [f"{common.random_name(rng)}-{salt}-{i}" for i in range(1, rng.randint(2, 4) + 1)]
    body = ("#!/bin/sh\n# waits until its flag file exists, then builds\n"
            f"while [ ! -e {flag} ]; do sleep 0.02; done\nsleep 0.5\n"
            + "".join(f'echo "step {i}: {_hash_command(s)} ok"\n' for i, s in enumerate(steps, 1)) + "echo DONE\n")
    expected = "".join(f"step {i}: {_short_hash(s)} ok\n" for i, s in enumerate(steps, 1)) + "DONE\n"
    return TaskSpec(f"Start ./{script} in the background with its output in {log}, check that it is running, then "
                    "create the flag file it waits for, wait for it to finish and show the log.",
                    [(script, body, 0o755)], [ck.answer_file(log, expected)],
                    [f"./{script} > {log} 2>&1 &", "jobs", f"touch {flag} && wait %1; echo \"exit $?\"", f"cat {log}"])


_FAMILY_KINDS = (  # (family, policy, test, answer_in_world)
    ("memory", fam.memory_config, _memory_config, True),
    ("memory", fam.memory_filename, _memory_filename, True),
    ("memory", fam.memory_world, _memory_world, False),
    ("error_recovery", fam.recovery_missing_file, _recovery_missing_file, True),
    ("error_recovery", fam.recovery_permission, _recovery_permission, False),
    ("error_recovery", fam.recovery_grep_case, _recovery_grep_case, False),
    ("explore_edit", fam.explore_replace, _explore_replace, False),
    ("explore_edit", fam.explore_count, _explore_count, False),
    ("explore_edit", fam.explore_rename, _explore_rename, False),
    ("explore_edit", fam.explore_largest, _explore_largest, False),
    ("explore_edit", fam.explore_csv, _explore_csv, False),
    ("shell_state", shell.shell_cd, _shell_cd, False),
)
KINDS: dict[str, Kind] = {p.__name__: Kind(p.__name__, family, True, _from_family(p, make), in_world)
                          for family, p, make, in_world in _FAMILY_KINDS}
KINDS.update({
    "memory_world_heldout": Kind("memory_world_heldout", "memory", False, _memory_world_heldout),
    "port_question": Kind("port_question", "memory", False, _port_question, answer_in_world=True),
    "line_total": Kind("line_total", "explore_edit", False, _line_total),
    "capture_script": Kind("capture_script", "error_recovery", False, _capture_script),
    "background_flag": Kind("background_flag", "shell_state", False, _background_flag),
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
