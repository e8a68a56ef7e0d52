"""Blind policies and blind replays: agents that never read an observation, scored by the task's own test.

    from ds_ttt.tasks.blind_policies import check_suite
    found = check_suite(tasks, guesses)     # write_suite(..., check_blind=check_suite) calls it
    # raises BlindPolicyPasses (naming task and policy) when any blind policy passes any task

Each policy is a list of commands run in one shell in a fresh sandbox holding the task's world, then a
final reply; the outcome is scored by ds_ttt.evaluation.closed_loop.score_outcome, the runner's own
verifier. A task any of them passes does not measure an agent: the gate refuses it. The policies that
run no command (nothing, the instruction, and the answers of a task without answer files) leave the
same files and differ only in their reply: they share one sandbox holding the world, whose files the
verifier carries over once, and each reply is tested in a verifier sandbox of its own (score_outcomes:
the same verdicts, one agent sandbox instead of one per policy).
  nothing                   no command, an empty reply (Harbor's nop agent)
  echo_instruction          no command; the instruction as the reply
  constant:<c>              c as the reply and as the whole of every answer file the instruction names,
                            for c in GUESS_CONSTANTS ("0", "1", "yes", "no") and the kind's `guess`
                            (its most common expected answer, ds_ttt/tasks/suite.py)
  numbers_spaces            "0 1 2 ... 100" as the reply and in every answer file
  numbers_lines             the same numbers, one per line
  copy_everything_into:<d>  `cp -r * d/` and every other directory's contents copied into d, for every
                            directory d of the world and of the answer files (`cp backups/* restore/`)
  move_everything_into:<d>  every other directory's files moved into d (`mv data/* archive/`)

Replays measure what the gate cannot forbid: a kind a fixed script solves. Every other instance's
reference solution of the same kind (solution/solve.sh: its commands and its final reply) is run blind
on the task. A replay that solves it although the two instances' expected answers differ (or a task
without answer values) is a fixed script that does the task without reading an observation: the task
has needs_observation = False. A replay that solves it because the two expected answers happen to be
equal (two small counts alike) is a lucky guess, counted apart (`coincidence_rate`) and not held
against the task. A kind needs the observation when every task of it does; `replay_rate` is the share
of its tasks some replay solves that way.
"""

from __future__ import annotations

import concurrent.futures
import shlex
from dataclasses import dataclass
from pathlib import Path

from ds_ttt.evaluation.closed_loop import score_outcome, score_outcomes
from ds_ttt.sandbox import Sandbox
from ds_ttt.tasks.suite import GUESS_CONSTANTS, Task

COMMAND_TIMEOUT = 10.0
REPLAY_TIMEOUT = 4.0  # a replayed job waiting for another instance's flag file never ends; the reference takes < 1 s
NUMBERS = [str(i) for i in range(101)]
SOLVE_PATH = "/tmp/solve.sh"  # not in /tests: the verifier discards that (as verify_task)


@dataclass(frozen=True)
class Policy:
    name: str
    commands: tuple[str, ...]
    reply: str


class BlindPolicyPasses(ValueError):
    """Some blind policy passes some task: the suite is refused."""


def _q(s: str) -> str:
    return shlex.quote(s)


def _fill(files: tuple[str, ...], text: str) -> tuple[str, ...]:
    return tuple(f"mkdir -p \"$(dirname {_q(f)})\" && printf '%s\\n' {_q(text)} > {_q(f)}" for f in files)


def _world_dirs(task: Task) -> list[str]:
    env = task.environment
    dirs = {str(p.relative_to(env)) for p in env.rglob("*") if p.is_dir()}
    dirs |= {str(Path(f).parent) for f in task.answer_files}
    return sorted(dirs - {"."})


def policies(task: Task, guess: str | None) -> list[Policy]:
    """The blind policies for `task` (the module docstring lists them)."""
    out = [Policy("nothing", (), ""), Policy("echo_instruction", (), task.instruction)]
    for c in dict.fromkeys([*GUESS_CONSTANTS, *([guess] if guess is not None else [])]):
        out.append(Policy(f"constant:{c}", _fill(task.answer_files, c), c))
    out.append(Policy("numbers_spaces", _fill(task.answer_files, " ".join(NUMBERS)), " ".join(NUMBERS)))
    out.append(Policy("numbers_lines", _fill(task.answer_files, "\n".join(NUMBERS)), "\n".join(NUMBERS)))
    dirs = _world_dirs(task)
    for d in dirs:
        others = [s for s in dirs if s != d and not d.startswith(s + "/") and not s.startswith(d + "/")]
        out.append(Policy(f"copy_everything_into:{d}", (f"mkdir -p {_q(d)}", f"cp -r ./* {_q(d)}/ 2>/dev/null; true",
                                                        *(f"cp -r {_q(s)}/. {_q(d)}/ 2>/dev/null; true" for s in others)), ""))
        out.append(Policy(f"move_everything_into:{d}", (f"mkdir -p {_q(d)}",
                                                        *(f"mv {_q(s)}/* {_q(d)}/ 2>/dev/null; true" for s in others)), ""))
    return out


def run_blind(task: Task, commands: tuple[str, ...] = (), reply: str | None = "", *, script: str | None = None,
              timeout: float = COMMAND_TIMEOUT) -> tuple[bool, str]:
    """Run `commands` (or `script`, as Harbor's oracle runs solve.sh) in a fresh sandbox holding the task's
    world, never reading their output, then score with the task's test: (passed, the test's log).
    reply None keeps the answer file as the commands left it."""
    with Sandbox(timeout=timeout, dirs=("/logs", "/tests")) as sb:
        sb.add_tree(task.environment)
        if script is not None:
            sb.put(script.encode(), SOLVE_PATH, 0o755)
            commands = (f"bash {SOLVE_PATH}",)
        for c in commands:
            sb.run(c, timeout=timeout)
        return score_outcome(sb, task, reply)


def run_blind_replies(task: Task, replies: list[str | None], *, timeout: float = COMMAND_TIMEOUT) -> list[tuple[bool, str]]:
    """`run_blind` with no command for each reply in `replies`: one sandbox holding the task's world, each
    reply scored by the task's test in a verifier sandbox of its own (closed_loop.score_outcomes)."""
    with Sandbox(timeout=timeout, dirs=("/logs", "/tests")) as sb:
        sb.add_tree(task.environment)
        return score_outcomes(sb, task, replies)


def _solution(task: Task) -> str:
    return (task.path / "solution" / "solve.sh").read_text()


def policy_group(name: str, guess: str | None) -> str:
    """The policy's name without its target directory, the kind's guess named as such (for counting)."""
    if guess is not None and name == f"constant:{guess}" and guess not in GUESS_CONSTANTS:
        return "constant:kind_guess"
    return name.split(":", 1)[0] + ":*" if name.startswith(("copy_", "move_")) else name


def check_suite(tasks: list[Task], guesses: dict[str, str | None], *, workers: int = 8, progress: bool = False) -> dict:
    """Run every blind policy and every same-kind replay on every task. Raises BlindPolicyPasses naming
    each (task, policy) that passes; else returns {"tasks": {id: {...}}, "kinds": {kind: {...}},
    "policies": {policy: {"runs", "solved"}}} for suite.json (the module docstring defines the fields)."""
    jobs = [("policy", t, p) for t in tasks for p in policies(t, guesses.get(t.kind))]
    jobs += [("replay", t, o) for t in tasks for o in tasks if o.kind == t.kind and o.id != t.id]
    # what runs: a task's policies without commands together (run_blind_replies), every other job alone;
    # each unit lists the indices of its jobs, so the verdicts come back in the jobs' order
    units: list[list[int]] = []
    no_command: dict[str, list[int]] = {}
    for i, (what, t, x) in enumerate(jobs):
        if what == "policy" and not x.commands:
            if t.id not in no_command:
                no_command[t.id] = []
                units.append(no_command[t.id])
            no_command[t.id].append(i)
        else:
            units.append([i])

    def one(unit):
        what, t, x = jobs[unit[0]]
        if what == "replay":
            return [run_blind(t, reply=None, script=_solution(x), timeout=REPLAY_TIMEOUT)[0]]
        if x.commands:
            return [run_blind(t, x.commands, x.reply)[0]]
        return [ok for ok, _ in run_blind_replies(t, [jobs[i][2].reply for i in unit])]

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="blind policies and replays", unit="run")

    def counted(unit):
        oks = one(unit)
        bar and bar.update(len(unit))
        return oks

    passed: list[bool] = [False] * len(jobs)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # sandbox start-up is I/O-bound
        for unit, oks in zip(units, pool.map(counted, units)):
            for i, ok in zip(unit, oks, strict=True):
                passed[i] = ok
    bar and bar.close()
    blind = [(t.id, p.name) for (what, t, p), ok in zip(jobs, passed) if what == "policy" and ok]
    if blind:
        raise BlindPolicyPasses(f"{len(blind)} blind (task, policy) pair(s) pass: "
                                + ", ".join(f"{t} by {p}" for t, p in blind))
    per_task = {t.id: {"needs_observation": True, "replays_solving": [], "coincident_replays": [],
                       "blind_policies": 0} for t in tasks}
    for (what, t, x), ok in zip(jobs, passed):
        row = per_task[t.id]
        if what == "policy":
            row["blind_policies"] += 1
        elif ok and t.answers and tuple(x.answers) == tuple(t.answers):
            row["coincident_replays"].append(x.id)
        elif ok:
            row["replays_solving"].append(x.id)
            row["needs_observation"] = False
    per_kind = {}
    for kind in dict.fromkeys(t.kind for t in tasks):
        rows = [per_task[t.id] for t in tasks if t.kind == kind]
        per_kind[kind] = {"needs_observation": all(r["needs_observation"] for r in rows),
                          "replay_rate": sum(not r["needs_observation"] for r in rows) / len(rows),
                          "coincidence_rate": sum(r["needs_observation"] and bool(r["coincident_replays"])
                                                  for r in rows) / len(rows),
                          "blind_runs": sum(r["blind_policies"] for r in rows), "blind_solved": 0}
    per_policy: dict[str, dict] = {}
    for (what, t, p), ok in zip(jobs, passed):
        if what == "policy":
            row = per_policy.setdefault(policy_group(p.name, guesses.get(t.kind)), {"runs": 0, "solved": 0})
            row["runs"] += 1
            row["solved"] += ok
    return {"tasks": per_task, "kinds": per_kind, "policies": per_policy}


__all__ = ["BlindPolicyPasses", "Policy", "check_suite", "policies", "run_blind", "run_blind_replies"]
