"""The held-out task suite: task instances of every kind on a split's seeds, written as a Harbor dataset.

    from ds_ttt.tasks.suite import write_suite, load_suite
    write_suite("TASKS", split="test", num_per_kind=12)     # evals/task_suite.py
    suite = load_suite("TASKS")                             # [Task(id, kind, family, seen, instruction, ...)]

Layout (Harbor's own task layout, one directory per task; `harbor run -p TASKS` runs them all):

    TASKS/suite.json                     what was built: split, seeds, per-task kind/family/seen/check, the
                                         blind-policy gate and replay results (blind_policies.py): per task
                                         and per kind `needs_observation`, per kind `replay_rate`, `guess`
    TASKS/<id>/task.toml                 [metadata] ds_ttt_kind, ds_ttt_family, ds_ttt_seen, ds_ttt_check, ...
    TASKS/<id>/instruction.md            the instruction, exactly as the agent gets it
    TASKS/<id>/environment/...           the setup files (copied into the workdir /app, modes kept)
    TASKS/<id>/tests/test.sh             the outcome test (ds_ttt/tasks/checks.py)
    TASKS/<id>/solution/solve.sh         the reference solution (Harbor's oracle agent)

Seeds: instance i of kind K is drawn from Random(f"task:K:{base + i}") with base TASK_SEEDS[split]
(test 6,000,000+, dev 5,000,000+): apart from each other, from the training corpus (seeds 0, 1, ...)
and from the teacher-forced held-out sets (1-4 million). A draw that gives no checkable task (an
expert episode that ends in failure) is redrawn with an attempt suffix, deterministically; so is a draw
whose expected answer a blind guess gives: one of GUESS_CONSTANTS or the kind's `guess`, its most common
expected answer over GUESS_DRAWS draws on seeds GUESS_SEED_BASE+ (7,000,000+, apart from both splits).
So the small counts 0 and 1 and each kind's most common value are never an answer (a count of 1 TODO,
say, is redrawn): the constant-answer blind policies fail every task by construction. Choose settings
on dev, report on test.
write_suite(..., check_blind=blind_policies.check_suite) runs the blind policies and the replays on the
written tasks (evals/task_suite.py and the tests pass it): it refuses the suite, naming task and policy,
when any blind policy passes any task, and records which tasks and kinds need the observation.
The environments are plain files: run them with the project's sandbox environment
(`--env ds_ttt.serve.frontends.harbor_env:SandboxEnvironment`), which copies environment/ into /app.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ds_ttt.tasks.checks import expected_answers, test_script
from ds_ttt.tasks.kinds import KINDS, NoTask, TaskSpec, solution_script

SUITE_FORMAT = "ds_ttt-task-suite-v2"
TASK_SEEDS = {"test": 6_000_000, "dev": 5_000_000}
MAX_ATTEMPTS = 20
GUESS_CONSTANTS = ("0", "1", "yes", "no")
GUESS_SEED_BASE = 7_000_000
GUESS_DRAWS = 24
SUITE_FILE = "suite.json"


@dataclass(frozen=True)
class Task:
    """One task as the runner reads it back from the dataset."""

    id: str
    kind: str
    family: str
    seen: bool
    check: str  # "state" (the files) or "answer" (the final reply; ds_ttt/tasks/checks.py)
    seed: int
    path: Path
    answers: tuple[str, ...] = ()  # the expected answer values (checks.Check.expected)
    answer_files: tuple[str, ...] = ()  # where the instruction asks for them, if in files
    needs_observation: bool | None = None  # None: a suite written without the replay check

    @property
    def instruction(self) -> str:
        return (self.path / "instruction.md").read_text()

    @property
    def environment(self) -> Path:
        return self.path / "environment"

    @property
    def test(self) -> str:
        return (self.path / "tests" / "test.sh").read_text()


def build_task(kind: str, seed: int, guesses: frozenset[str] = frozenset()) -> TaskSpec:
    """The task of `kind` for `seed`, redrawn deterministically while a draw gives no checkable task or
    an expected answer that is one of `guesses`."""
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"task:{kind}:{seed}" + (f":{attempt}" if attempt else ""))
        try:
            spec = KINDS[kind].build(rng)
        except NoTask:
            continue
        if not guesses.intersection(expected_answers(spec.checks)):
            return spec
    raise RuntimeError(f"{kind} seed {seed}: no checkable, unguessable task in {MAX_ATTEMPTS} draws")


def common_answer(kind: str, num_draws: int = GUESS_DRAWS) -> str | None:
    """The kind's most common expected answer, GUESS_CONSTANTS aside, over `num_draws` draws on the guess
    seeds (ties: the smallest string): the guess of a blind policy that knows the kind; None: no answers."""
    constants = frozenset(GUESS_CONSTANTS)
    counts = Counter(a for i in range(num_draws)
                     for a in expected_answers(build_task(kind, GUESS_SEED_BASE + i, constants).checks))
    return min(counts, key=lambda a: (-counts[a], a)) if counts else None


def task_guesses(guess: str | None) -> frozenset[str]:
    return frozenset(GUESS_CONSTANTS) | ({guess} if guess is not None else set())


def _task_toml(task_id: str, kind: str, seed: int, split: str, check: str) -> str:
    k = KINDS[kind]
    return (f"# ds_ttt held-out task {task_id} (ds_ttt/tasks/suite.py). Plain files: run it with\n"
            "# --env ds_ttt.serve.frontends.harbor_env:SandboxEnvironment (docs/evaluation.md, \"Closed-loop tasks\").\n"
            'schema_version = "1.4"\n\n[metadata]\n'
            f'ds_ttt_kind = "{kind}"\nds_ttt_family = "{k.family}"\nds_ttt_seen = {str(k.seen).lower()}\n'
            f'ds_ttt_check = "{check}"\nds_ttt_split = "{split}"\nds_ttt_seed = {seed}\n\n'
            "[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 600.0\n\n"
            '[environment]\nworkdir = "/app"\n')


def write_task(root: Path, task_id: str, kind: str, seed: int, split: str, guesses: frozenset[str]) -> dict:
    spec = build_task(kind, seed, guesses)
    check = "answer" if any(c.reads_answer for c in spec.checks) else "state"
    d = root / task_id
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "task.toml").write_text(_task_toml(task_id, kind, seed, split, check))
    (d / "instruction.md").write_text(spec.instruction)
    for rel, text, mode in spec.files:
        p = d / "environment" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        p.chmod(mode)
    for p, text in ((d / "tests" / "test.sh", test_script(spec.checks)), (d / "solution" / "solve.sh", solution_script(spec))):
        p.write_text(text)
        p.chmod(0o755)
    k = KINDS[kind]
    return {"id": task_id, "kind": kind, "family": k.family, "seen": k.seen, "check": check, "seed": seed,
            "expert_rounds": len(spec.solution), "answers": expected_answers(spec.checks),
            "answer_files": [c.path for c in spec.checks if c.path is not None]}


def _task(root: Path, t: dict) -> Task:
    return Task(t["id"], t["kind"], t["family"], t["seen"], t["check"], t["seed"], root / t["id"],
                tuple(t.get("answers", ())), tuple(t.get("answer_files", ())), t.get("needs_observation"))


def write_suite(out_dir: str | Path, *, split: str = "test", num_per_kind: int = 12, kinds: list[str] | None = None,
                progress: bool = True, guess_draws: int = GUESS_DRAWS,
                check_blind: Callable[[list[Task], dict], dict] | None = None) -> dict:
    """Write the suite (refuses an existing non-empty directory); returns its suite.json.
    check_blind(tasks, guesses) -> {"tasks": {id: fields}, "kinds": {kind: fields}} (blind_policies.check_suite)
    raises when a blind policy passes a task: the directory is removed and nothing is written. Without
    it the suite records needs_observation as None (unmeasured)."""
    if split not in TASK_SEEDS:
        raise ValueError(f"split must be one of {sorted(TASK_SEEDS)}, got {split!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose a new --out (a suite is written once)")
    kinds = list(kinds or KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown task kinds {unknown}; known: {sorted(KINDS)}")
    guess = {k: common_answer(k, guess_draws) for k in kinds}
    out.mkdir(parents=True, exist_ok=True)
    base = TASK_SEEDS[split]
    jobs = [(kind, base + i) for i in range(num_per_kind) for kind in kinds]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc=f"tasks ({split})", unit="task")
    tasks = []
    for kind, seed in jobs:
        tasks.append(write_task(out, f"{split}-{kind}-{seed - base:03d}", kind, seed, split, task_guesses(guess[kind])))
        bar and bar.update(1)
    bar and bar.close()
    kind_info = {k: {"family": KINDS[k].family, "seen": KINDS[k].seen, "guess": guess[k], "needs_observation": None}
                 for k in kinds}
    for t in tasks:
        t["needs_observation"] = None
    found = {}
    if check_blind is not None:
        try:
            found = check_blind([_task(out, t) for t in tasks], guess)
        except BaseException:
            shutil.rmtree(out)
            raise
        for t in tasks:
            t.update(found["tasks"][t["id"]])
        for k in kinds:
            kind_info[k].update(found["kinds"][k])
    digest = hashlib.sha256()
    for p in sorted(out.rglob("*")):
        if p.is_file():
            digest.update(str(p.relative_to(out)).encode() + b"\0" + p.read_bytes() + b"\0")
    suite = {"format": SUITE_FORMAT, "split": split, "seed_base": base, "num_per_kind": num_per_kind,
             "guess_draws": guess_draws, "blind_checked": check_blind is not None,
             "blind_policies": found.get("policies"), "kinds": kind_info,
             "num_tasks": len(tasks), "sha256": digest.hexdigest(), "tasks": tasks}
    (out / SUITE_FILE).write_text(json.dumps(suite, indent=1) + "\n")
    return suite


def load_suite(path: str | Path) -> tuple[dict, list[Task]]:
    """(suite.json, its tasks) of a suite directory; refuses anything else by name."""
    root = Path(path)
    meta_path = root / SUITE_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: write a suite with evals/task_suite.py --out {root}")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != SUITE_FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {SUITE_FORMAT!r}")
    tasks = []
    for t in meta["tasks"]:
        d = root / t["id"]
        cfg = tomllib.loads((d / "task.toml").read_text())["metadata"]
        if cfg.get("ds_ttt_kind") != t["kind"]:
            raise ValueError(f"{d / 'task.toml'}: ds_ttt_kind {cfg.get('ds_ttt_kind')!r} but {meta_path} says {t['kind']!r}")
        tasks.append(_task(root, t))
    return meta, tasks


def copy_tasks(suite_dir: str | Path, out_dir: str | Path, ids: list[str]) -> Path:
    """A smaller dataset with only `ids` (e.g. a few tasks for a Harbor smoke run)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i in ids:
        shutil.copytree(Path(suite_dir) / i, out / i, symlinks=False)
    return out


__all__ = ["GUESS_CONSTANTS", "SUITE_FORMAT", "TASK_SEEDS", "Task", "build_task", "common_answer", "write_suite",
           "load_suite", "copy_tasks"]
