"""Contamination of a task suite by the training corpus: tasks that are training episodes, and how many
task instructions training shows word for word.

    from ds_ttt.evaluation.contamination import build_training_index, check_suite, contaminated
    index = build_training_index(load_training_trajectories(["DATA/manifest.json"]))   # or trajectories.jsonl
    report = check_suite("TASKS", index)           # report["identical"]: the tasks to redraw (evals/contamination.py)
    contaminated(spec, index)                      # one TaskSpec (or a task directory): is it a training episode?

A task is *identical* to a training trajectory when its instruction and every one of its setup files
(path, bytes, mode; no file more or less) equal that trajectory's: the agent was trained on that very
episode. *Same world*: every setup file equal, the instruction not (e.g. one sentence added, "Reply with
only the number"). *Instruction overlap*, per kind: tasks whose instruction equals a training
instruction (`exact`), or holds one word for word (`verbatim`, which counts `exact` too).

Where a training trajectory's setup files come from. The generator's trajectories
(ds_ttt/data/generator.py) record the instruction, the commands and their outputs, not the files the
scripted expert wrote before its first command. They are regenerated here, deterministically, without a
sandbox: trajectory `gen-S-IIIII` (meta.seed S, index I, meta.family, meta.variant) is replayed from
`Random(f"{S}:{I}")` exactly as `generate_one` draws it (the family drawn from the stream, or given with
`--family` and not drawn: both are tried), by an Episode that records each `write` and stops at the first
command, so the world is the one the training episode ran in. The replay counts only when it reproduces
the trajectory's own instruction (and family and variant); a trajectory that does not replay (another
generator version, or not from the generator) is listed under `not_regenerated` and enters the
instruction overlap only. A task's setup files are its environment/ directory (what /app holds).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ds_ttt.data.families import FAMILIES
from ds_ttt.data.generator import FAMILY_NAMES, Episode

REPORT_FORMAT = "ds_ttt-contamination-v1"
DEFAULT_MODE = 0o644  # Episode.write's mode when none is given (as the suite writes it)

SetupFile = tuple[str, str, int]  # (path relative to the workdir, text, mode)


class _FirstCommand(Exception):
    """The replayed expert reached its first command: the world is complete."""


class _WorldRecorder(Episode):
    """An Episode without a sandbox: records the files and the instruction, stops at the first command."""

    def __init__(self):
        super().__init__(None, "world", "", "")
        self.files: list[SetupFile] = []

    def write(self, rel: str, text: str, mode: int | None = None) -> None:
        self.files.append((rel, text, DEFAULT_MODE if mode is None else mode))

    def act(self, reasoning: str, command: str, expect_fail: bool = False) -> str:
        raise _FirstCommand


def world_fingerprint(files: Iterable[SetupFile]) -> str:
    """sha256 over the setup files (path, sha256 of the bytes, mode), in path order; a later write of a
    path replaces an earlier one, as in the sandbox."""
    final = {p: (hashlib.sha256(t.encode()).hexdigest(), m & 0o7777) for p, t, m in files}
    return hashlib.sha256(json.dumps(sorted(final.items())).encode()).hexdigest()


def episode_fingerprint(instruction: str, files: Iterable[SetupFile]) -> str:
    """sha256 of the instruction and the world: equal iff both are byte for byte equal."""
    return hashlib.sha256(json.dumps([instruction, world_fingerprint(files)]).encode()).hexdigest()


def _instruction(traj: dict) -> str | None:
    return next((m["content"] for m in traj.get("messages", []) if m.get("role") == "user"), None)


def regenerate_world(traj: dict) -> list[SetupFile] | None:
    """The setup files of a generator trajectory, replayed from its seed (module docstring); None when the
    trajectory is not the generator's or the replay does not give back its instruction."""
    meta = traj.get("meta", {})
    parts = str(traj.get("id", "")).split("-")
    if len(parts) != 3 or parts[0] != "gen" or meta.get("family") not in FAMILIES:
        return None
    seed, index = int(parts[1]), int(parts[2])
    for family_drawn in (True, False):
        rng = random.Random(f"{seed}:{index}")
        if family_drawn and FAMILY_NAMES[rng.randrange(len(FAMILY_NAMES))] != meta["family"]:
            continue
        policy = rng.choice(FAMILIES[meta["family"]])
        if policy.__name__ != meta.get("variant"):
            continue
        ep = _WorldRecorder()
        try:
            policy(ep, rng)
        except _FirstCommand:
            pass
        if ep.meta.get("task") == _instruction(traj):
            return ep.files
    return None


@dataclass
class TrainingIndex:
    """What a task is compared with: the training trajectories' instructions and regenerated worlds."""

    num_trajectories: int = 0
    sources: list[dict] = field(default_factory=list)
    instructions: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # text -> ids
    episodes: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # episode fingerprint -> ids
    worlds: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # world fingerprint -> ids
    not_regenerated: list[str] = field(default_factory=list)

    def add(self, traj: dict) -> None:
        self.num_trajectories += 1
        instruction = _instruction(traj)
        if instruction is not None:
            self.instructions[instruction].append(traj["id"])
        files = regenerate_world(traj)
        if files is None:
            self.not_regenerated.append(traj["id"])
            return
        self.worlds[world_fingerprint(files)].append(traj["id"])
        self.episodes[episode_fingerprint(instruction, files)].append(traj["id"])

    def identical(self, instruction: str, files: Iterable[SetupFile]) -> list[str]:
        """Training trajectories whose instruction and setup files equal these."""
        return list(self.episodes.get(episode_fingerprint(instruction, list(files)), []))

    def same_world(self, files: Iterable[SetupFile]) -> list[str]:
        return list(self.worlds.get(world_fingerprint(files), []))

    def verbatim(self, instruction: str) -> list[str]:
        """Training trajectories whose instruction the given one holds word for word (or equals)."""
        return [i for text, ids in self.instructions.items() if text in instruction for i in ids]


def build_training_index(trajectories: Iterable[dict], sources: list[dict] | None = None) -> TrainingIndex:
    index = TrainingIndex(sources=list(sources or []))
    for t in trajectories:
        index.add(t)
    return index


def load_training_trajectories(paths: Iterable[str | Path]) -> tuple[list[dict], list[dict]]:
    """(trajectories, sources) of training sources: a prepared manifest (DIR or DIR/manifest.json: its
    train split, every file hash verified) or a generator's trajectories.jsonl (DIR or the file)."""
    trajs, sources = [], []
    for raw in paths:
        path = Path(raw)
        manifest = path / "manifest.json" if path.is_dir() else path
        if manifest.name == "manifest.json" and manifest.is_file():
            from ds_ttt.data.manifest import load_manifest

            m = load_manifest(manifest)
            got = m.trajectories("train")
            sources.append({"path": str(manifest), "kind": "manifest", "split": "train", "sha256": m.sha256,
                            "trajectories": len(got)})
        else:
            jsonl = path / "trajectories.jsonl" if path.is_dir() else path
            if not jsonl.is_file():
                raise FileNotFoundError(f"{raw}: neither a manifest (DIR/manifest.json) nor a trajectories.jsonl")
            with open(jsonl, encoding="utf-8") as f:
                got = [json.loads(line) for line in f if line.strip()]
            sources.append({"path": str(jsonl), "kind": "trajectories", "sha256": hashlib.sha256(jsonl.read_bytes()).hexdigest(),
                            "trajectories": len(got)})
        trajs += got
    return trajs, sources


def task_dir_files(task_dir: str | Path) -> tuple[str, list[SetupFile]]:
    """(instruction, setup files) of a written task: instruction.md and environment/ (path, text, mode)."""
    d = Path(task_dir)
    env = d / "environment"
    files = [(p.relative_to(env).as_posix(), p.read_text(), p.stat().st_mode & 0o7777)
             for p in sorted(env.rglob("*")) if p.is_file()] if env.is_dir() else []
    return (d / "instruction.md").read_text(), files


def contaminated(task, index: TrainingIndex) -> bool:
    """Is this task a training episode (instruction and every setup file equal)? `task`: a TaskSpec
    (ds_ttt/tasks/kinds.py: .instruction, .files), an (instruction, files) pair, or a task directory.
    The suite writer can redraw while this holds."""
    if isinstance(task, (str, Path)):
        instruction, files = task_dir_files(task)
    elif isinstance(task, tuple):
        instruction, files = task
    else:
        instruction, files = task.instruction, task.files
    return bool(index.identical(instruction, files))


def _rate(n: int, k: int) -> dict:
    return {"tasks": n, "count": k, "rate": k / n if n else None}


def check_suite(suite_dir: str | Path, index: TrainingIndex) -> dict:
    """The report of one suite against the index (module docstring); `clean` is False when any task is
    identical to a training trajectory."""
    from ds_ttt.tasks.suite import load_suite

    suite, tasks = load_suite(suite_dir)
    identical, same_world, per_kind = [], [], {}
    for t in tasks:
        instruction, files = task_dir_files(t.path)
        row = per_kind.setdefault(t.kind, {"seen": t.seen, "family": t.family, "tasks": 0, "exact": 0, "verbatim": 0,
                                           "identical": 0, "same_world": 0})
        row["tasks"] += 1
        row["exact"] += bool(index.instructions.get(instruction))
        row["verbatim"] += bool(index.verbatim(instruction))
        if ids := index.identical(instruction, files):
            identical.append({"task": t.id, "kind": t.kind, "seen": t.seen, "training": ids})
            row["identical"] += 1
        elif ids := index.same_world(files):
            same_world.append({"task": t.id, "kind": t.kind, "seen": t.seen, "training": ids,
                               "training_instruction": next(txt for txt, v in index.instructions.items() if ids[0] in v)})
            row["same_world"] += 1
    totals = {}
    for seen in (True, False):
        rows = [r for r in per_kind.values() if r["seen"] == seen]
        n = sum(r["tasks"] for r in rows)
        totals["seen" if seen else "unseen"] = {key: _rate(n, sum(r[key] for r in rows))
                                                for key in ("exact", "verbatim", "identical", "same_world")}
    return {"format": REPORT_FORMAT, "clean": not identical,
            "suite": {"path": str(suite_dir), "split": suite.get("split"), "num_tasks": len(tasks),
                      "sha256": suite.get("sha256")},
            "training": {"sources": index.sources, "trajectories": index.num_trajectories,
                         "instructions": len(index.instructions),
                         "worlds_regenerated": index.num_trajectories - len(index.not_regenerated),
                         "not_regenerated": index.not_regenerated},
            "identical": identical, "same_world": same_world,
            "instruction_overlap": {"per_kind": dict(sorted(per_kind.items())), **totals}}
