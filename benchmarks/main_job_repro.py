"""Is the main job reproducible? Compares two finished `launch/main.sh` work directories file by file.

    .venv/bin/python benchmarks/main_job_repro.py runs/main_before runs/main_after \
        --label-a 1ad715b --label-b HEAD --out benchmarks/results/main_job_repro     # ~1 min

Typical use: the same seeds run at two commits (a refactor that must not change behaviour), or twice
at one commit (determinism). Run the older commit in a git worktree with PYTHONPATH pointing at that
worktree: setup.sh installs ds_ttt editable, so a plain `python` in another tree imports this one's.

Every file must exist in both trees. How each kind is compared:
  .json / .jsonl   parsed, after replacing each run's work directory and its path-derived hashes
                   (the manifest's sha256, which hashes its input paths, and each checkpoint's
                   `checkpoint_sha256`, which hashes its run_config.json with the output path) by
                   placeholders, and dropping wall-clock fields (times, rates, load, dates, memory peaks);
  *_states.pt      model and optimizer states, loaded weights_only (DeepSpeed's few objects allow-listed,
                   as the trainer's resume does); tensors equal bit for bit (torch.equal), other values
                   equal after the same path replacement (DeepSpeed's module file keeps the run's client
                   state, paths included), objects by their attributes; each difference is named by its
                   path in the file (`where`), e.g. a recorded DeepSpeed setting;
  .md / .png       skipped: reports rendered from the JSON beside them, with timings in them;
  .log             skipped: a step's progress output (bars with rates and times), its results are files;
  tasks/...        byte for byte, whatever the suffix: the task suite's files are task data (a recovery
                   task's broken config.json is its point), not records to parse;
  everything else  byte for byte (the raw trajectories, checkpoint shards, optimizer states, safetensors).
The checkpoint weights behind a replaced checkpoint hash are compared as files, so nothing is trusted
without a check. Also reported: each run's median training step time (metrics.jsonl, from step 11)
and the exported safetensors' sha256. Writes OUT.json and OUT.md; exit 1 when anything differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
import statistics
import sys

import torch

from ds_ttt.loading import checkpoint_sha256, sha256_file
from ds_ttt.train.safe_loading import deepspeed_safe_globals

WALL_CLOCK = re.compile(r"^(created|date|minutes|peak_mem_gb|load|load_.*|.*time.*|.*seconds.*|.*per_s|elapsed.*)$")


class Run:
    """One work directory and the strings in it that depend on where it ran rather than what it computed."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        # the directory as written: absolute, or relative to wherever the job ran (runs/main, ...)
        parts = root.resolve().parts
        tails = ["/".join(parts[i:]).lstrip("/") for i in range(len(parts) - 1)]
        self.replacements = [(str(root.resolve()), "<RUN>")] + [(tail, "<RUN>") for tail in tails]
        self.replacements.append((sha256_file(root / "data/manifest.json"), "<MANIFEST_SHA256>"))
        for step in sorted((root / "run").glob("step_*")):
            self.replacements.append((checkpoint_sha256(step), f"<CHECKPOINT_SHA256:{step.name}>"))

    def canonical(self, text: str) -> str:
        for raw, placeholder in self.replacements:
            text = text.replace(raw, placeholder)
            if len(raw) == 64:  # reports print 16-hex-digit prefixes of hashes
                text = text.replace(raw[:16], placeholder)
        return text

    def files(self) -> set[pathlib.Path]:
        return {p.relative_to(self.root) for p in self.root.rglob("*") if p.is_file()}

    def step_time_median(self) -> float:
        rows = [json.loads(line) for line in (self.root / "run/metrics.jsonl").read_text().splitlines() if line.strip()]
        return statistics.median(r["step_time_s"] for r in rows[10:])


TASKS_DIR = "tasks"  # WORK/tasks: the closed-loop task suite (evals/task_suite.py), compared byte for byte


def drop_wall_clock(value):
    if isinstance(value, dict):
        return {k: drop_wall_clock(v) for k, v in value.items() if not WALL_CLOCK.match(k)}
    if isinstance(value, list):
        return [drop_wall_clock(v) for v in value]
    return value


def load_json(run: Run, rel: pathlib.Path):
    text = run.canonical((run.root / rel).read_text())
    if rel.suffix == ".jsonl":
        return [drop_wall_clock(json.loads(line)) for line in text.splitlines() if line.strip()]
    return drop_wall_clock(json.loads(text))


def state_differences(a, b, run_a: Run, run_b: Run, path: str = "") -> list[str]:
    """Where two loaded checkpoint states differ (empty: the same), each as `path: what`."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{path}: keys differ"]
        return [d for k in a for d in state_differences(a[k], b[k], run_a, run_b, f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in state_differences(x, y, run_a, run_b, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{path}: tensor differs"]
    if isinstance(a, str) and isinstance(b, str):
        return [] if run_a.canonical(a) == run_b.canonical(b) else [f"{path}: {a[:60]!r} != {b[:60]!r}"]
    if type(a) is type(b) and type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return state_differences(vars(a), vars(b), run_a, run_b, path)  # e.g. DeepSpeed's loss scaler
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def same_file(rel: pathlib.Path, run_a: Run, run_b: Run, where: dict | None = None) -> bool | None:
    """True/False, or None for a report skipped by design; `where` collects a checkpoint state's differences."""
    if rel.suffix in (".md", ".png", ".log"):
        return None
    if rel.parts[0] == TASKS_DIR:  # the task suite's files are task data (a task may ship a broken config.json)
        return sha256_file(run_a.root / rel) == sha256_file(run_b.root / rel)
    if rel.suffix in (".json", ".jsonl"):
        return load_json(run_a, rel) == load_json(run_b, rel)
    if rel.name.endswith("_states.pt"):
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            state_a = torch.load(run_a.root / rel, map_location="cpu", weights_only=True)
            state_b = torch.load(run_b.root / rel, map_location="cpu", weights_only=True)
        found = state_differences(state_a, state_b, run_a, run_b)
        if found and where is not None:
            where[str(rel)] = found
        return not found
    return sha256_file(run_a.root / rel) == sha256_file(run_b.root / rel)


def compare(dir_a: pathlib.Path, dir_b: pathlib.Path, label_a: str = "a", label_b: str = "b") -> dict:
    """The comparison as a JSON-ready dict; `identical` is its verdict."""
    run_a, run_b = Run(dir_a), Run(dir_b)
    files_a, files_b = run_a.files(), run_b.files()
    only = sorted(str(p) for p in files_a ^ files_b)
    where: dict[str, list[str]] = {}
    verdicts = {str(rel): same_file(rel, run_a, run_b, where) for rel in sorted(files_a & files_b)}
    different = [f for f, v in verdicts.items() if v is False]
    exports = {p.name: {label_a: sha256_file(p), label_b: sha256_file(dir_b / "export" / p.name)}
               for p in sorted(dir_a.glob("export/*.safetensors")) if (dir_b / "export" / p.name).is_file()}
    return {
        "a": {"label": label_a, "dir": str(dir_a), "median_step_seconds": run_a.step_time_median()},
        "b": {"label": label_b, "dir": str(dir_b), "median_step_seconds": run_b.step_time_median()},
        "files_identical": sum(v is True for v in verdicts.values()),
        "files_skipped_reports": sum(v is None for v in verdicts.values()),
        "files_different": different,
        "where": where,
        "files_in_one_run_only": only,
        "export_sha256": exports,
        "identical": not different and not only,
    }


def render(result: dict) -> str:
    a, b = result["a"], result["b"]
    label_a, label_b = a["label"], b["label"]
    lines = [f"# Main job: {label_a} vs {label_b}", "",
             f"- runs: `{a['dir']}` ({label_a}), `{b['dir']}` ({label_b})",
             f"- files identical: {result['files_identical']} (JSON with paths, path-derived hashes and wall-clock "
             f"fields canonicalised; tensors bit for bit; the rest byte for byte); reports skipped: "
             f"{result['files_skipped_reports']}",
             f"- different: {result['files_different'] or 'none'}; in one run only: "
             f"{result['files_in_one_run_only'] or 'none'}",
             *sorted({f"- in the checkpoint states: `{d}`" for found in result.get("where", {}).values() for d in found}),
             f"- median training step (from step 11): {label_a} {a['median_step_seconds']:.3f} s, "
             f"{label_b} {b['median_step_seconds']:.3f} s", "",
             f"| export file | {label_a} sha256 | {label_b} sha256 |", "|---|---|---|"]
    lines += [f"| {name} | `{h[label_a]}` | `{h[label_b]}` |" for name, h in result["export_sha256"].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=pathlib.Path)
    ap.add_argument("run_b", type=pathlib.Path)
    ap.add_argument("--label-a", default="a")
    ap.add_argument("--label-b", default="b")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    result = compare(args.run_a, args.run_b, args.label_a, args.label_b)
    report = render(result)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(report)
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
