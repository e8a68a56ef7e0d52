"""The issue-7 adaptation report: ttt vs frozen on the targets, current_round and full context side by side.

    from ds_ttt.evaluation.adaptation import build_report, write_report
    report = build_report("EVAL", "MEM", "EVAL_FULL", "MEM_FULL", minutes=27.5, command="...")
    write_report(report, "benchmarks/results/adaptation.json")     # + .md + .png beside it

Inputs are the results.json files of four runs on ONE checkpoint:
  EVAL / MEM             evals/evaluate.py and evals/memory_test.py under the current_round policy
                         (only the fast weights can carry a fact from one round to a later one);
  EVAL_FULL / MEM_FULL   the same with --context-policy full (attention can see the past).
Numbers taken, per mode (ttt, frozen):
  memory_exact_match     summary.memory_action_exact of the held-out eval: the WHOLE action of a round
                         that must use an earlier fact (meta.memory_checks) is the greedy one;
  worlds_passed          summary.worlds_passed of the memory test (both readbacks exact), out of 32;
  recovery_nll           summary.recovery_action_nll: token-weighted NLL of the action right after a
                         failing command (error_recovery family, meta.recovery_rounds).
Every number carries its 95% interval (`<name>_lo` / `<name>_hi`; the markdown shows [lo, hi]).
Targets (checked on the current_round numbers; never relaxed): memory exact ttt >= 0.5 and >= 3x frozen
(when frozen is 0: ttt > 0); worlds ttt >= 16/32 and frozen <= 2/32 (a memory test of another size than
32 worlds does not meet them); recovery NLL ttt <= 0.8 x frozen.

Refusals (ReportInputError, naming the file and the key): a missing results file or key, a context
policy other than the one the slot needs, runs whose checkpoint provenance differs.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

from ds_ttt.evaluation.intervals import wilson_interval

MODES = ("ttt", "frozen")
# the exact matches are fractions k/n: 3 * (1/5) is 0.6000000000000001 in floats, so ratio targets are
# compared with this slack (far below any count's resolution)
EPS = 1e-12
NUM_WORLDS = 32
POLICY = {"eval": "current_round", "memory": "current_round", "eval_full": "full", "memory_full": "full"}
# provenance fields that identify the weights and the trained configuration (sources keeps them)
PROVENANCE_KEYS = ("kind", "path", "resolved", "step", "sha256", "export_sha256", "config_sha256", "manifest_sha256")


class ReportInputError(ValueError):
    """A results file is missing, incomplete or does not belong with the others."""


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _get(data: dict, path: str, keys: tuple[str, ...]):
    cur = data
    for i, k in enumerate(keys):
        if not isinstance(cur, dict) or k not in cur:
            raise ReportInputError(f"{path}: missing key {'.'.join(keys[:i + 1])!r} (rerun evals/evaluate.py or "
                                   "evals/memory_test.py with the current code)")
        cur = cur[k]
    return cur


def load_results(run_dir: str | pathlib.Path, slot: str) -> dict:
    """The fields of one run's results.json that the report needs (slot: eval / memory / eval_full / memory_full)."""
    d = pathlib.Path(run_dir)
    f = d / "results.json" if d.is_dir() or not d.name.endswith(".json") else d
    if not f.is_file():
        raise ReportInputError(f"{f}: no such results file (--{slot.replace('_', '-')})")
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{f}: not valid JSON ({e})") from None
    path = str(f)
    policy = _get(data, path, ("context_policy",))
    if policy != POLICY[slot]:
        raise ReportInputError(f"{path}: context_policy is {policy!r}, but --{slot.replace('_', '-')} needs a run "
                               f"with {POLICY[slot]!r} (evaluate with --context-policy {POLICY[slot]})")
    out = {"file": path, "sha256": _sha256(f), "context_policy": policy,
           "context_policy_trained": _get(data, path, ("context_policy_trained",)),
           "checkpoint": _get(data, path, ("checkpoint",))}
    for m in MODES:
        if slot.startswith("eval"):
            out[m] = {k: _get(data, path, ("summary", m, k)) for k in
                      ("memory_action_exact", "memory_action_exact_count", "recovery_action_nll",
                       "recovery_action_nll_lo", "recovery_action_nll_hi", "recovery_action_tokens",
                       "recovery_rounds")}
        else:
            out[m] = {k: _get(data, path, ("summary", m, k)) for k in ("worlds_passed", "num_worlds")}
    if not slot.startswith("eval"):
        out["seeds"] = data.get("seeds")
    return out


def checkpoint_identity(prov: dict) -> set[str]:
    """The weight hashes a provenance records: a checkpoint's sha256; an export's export_sha256 plus the
    sha256 of the checkpoint it was exported from (kept in its provenance)."""
    return {prov[k] for k in ("sha256", "export_sha256") if prov.get(k)}


def check_same_checkpoint(runs: dict[str, dict]) -> None:
    """Every run must record a weight hash shared with the eval run's, and the same trained config hash."""
    ref_slot = "eval"
    ref = runs[ref_slot]
    ref_ids = checkpoint_identity(ref["checkpoint"])
    if not ref_ids:
        raise ReportInputError(f"{ref['file']}: checkpoint provenance records no sha256/export_sha256, so the "
                               "runs cannot be shown to share a checkpoint")
    for slot, run in runs.items():
        if slot == ref_slot:
            continue
        ids = checkpoint_identity(run["checkpoint"])
        if not ids & ref_ids:
            raise ReportInputError(
                f"{run['file']} and {ref['file']} come from different checkpoints: checkpoint "
                f"{run['checkpoint'].get('path')} (sha256 {sorted(ids) or 'none'}) vs {ref['checkpoint'].get('path')} "
                f"(sha256 {sorted(ref_ids)})")
        a, b = run["checkpoint"].get("config_sha256"), ref["checkpoint"].get("config_sha256")
        if a and b and a != b:
            raise ReportInputError(f"{run['file']} and {ref['file']}: same weights but different trained configs "
                                   f"(config_sha256 {a[:16]} vs {b[:16]})")


def numbers(ev: dict, mem: dict) -> dict:
    """The six issue-7 numbers of one context policy, each with its 95% interval (`_lo`, `_hi`):
    Wilson for the exact-match rate and the worlds passed (as a fraction of the worlds), bootstrap over
    rounds for the recovery NLL (ds_ttt/evaluation/intervals.py)."""
    out = {}
    for m in MODES:
        k, n = ev[m]["memory_action_exact_count"]
        out[f"memory_exact_match_{m}"] = ev[m]["memory_action_exact"]
        out[f"memory_exact_match_{m}_lo"], out[f"memory_exact_match_{m}_hi"] = wilson_interval(int(k), int(n))
        worlds, num_worlds = int(mem[m]["worlds_passed"]), int(mem[m]["num_worlds"])
        out[f"worlds_passed_{m}"] = worlds
        lo, hi = wilson_interval(worlds, num_worlds)
        out[f"worlds_passed_{m}_lo"] = None if lo is None else lo * num_worlds
        out[f"worlds_passed_{m}_hi"] = None if hi is None else hi * num_worlds
        out[f"recovery_nll_{m}"] = ev[m]["recovery_action_nll"]
        out[f"recovery_nll_{m}_lo"] = ev[m]["recovery_action_nll_lo"]
        out[f"recovery_nll_{m}_hi"] = ev[m]["recovery_action_nll_hi"]
    return out


def counts(ev: dict, mem: dict) -> dict:
    return {
        "memory_exact_match_ttt": ev["ttt"]["memory_action_exact_count"],
        "memory_exact_match_frozen": ev["frozen"]["memory_action_exact_count"],
        "worlds_passed_ttt": [int(mem["ttt"]["worlds_passed"]), int(mem["ttt"]["num_worlds"])],
        "worlds_passed_frozen": [int(mem["frozen"]["worlds_passed"]), int(mem["frozen"]["num_worlds"])],
        "recovery_nll_ttt": {"rounds": ev["ttt"]["recovery_rounds"], "tokens": ev["ttt"]["recovery_action_tokens"]},
        "recovery_nll_frozen": {"rounds": ev["frozen"]["recovery_rounds"],
                                "tokens": ev["frozen"]["recovery_action_tokens"]},
    }


def targets(n: dict, num_worlds: int) -> dict:
    """Each issue-7 target: threshold, measured value, met. A missing value (None) never meets a target."""
    ttt, frozen = n["memory_exact_match_ttt"], n["memory_exact_match_frozen"]
    if ttt is None or frozen is None:
        ratio_met = False
    else:
        ratio_met = ttt > 0 if frozen == 0 else ttt >= 3 * frozen - EPS
    full_size = num_worlds == NUM_WORLDS
    note = None if full_size else f"memory test ran {num_worlds} worlds; the target is defined on {NUM_WORLDS}"
    r_ttt, r_frozen = n["recovery_nll_ttt"], n["recovery_nll_frozen"]
    return {
        "memory_exact_match_ttt_abs": {"threshold": ">= 0.5", "value": ttt, "met": ttt is not None and ttt >= 0.5},
        "memory_exact_match_ttt_vs_frozen": {
            "threshold": ">= 3x frozen (frozen 0: ttt > 0)", "value": {"ttt": ttt, "frozen": frozen},
            "ratio": (ttt / frozen if ttt is not None and frozen else None), "met": ratio_met},
        "worlds_passed_ttt": {"threshold": f">= 16/{NUM_WORLDS}", "value": n["worlds_passed_ttt"],
                              "met": full_size and n["worlds_passed_ttt"] >= 16, "note": note},
        "worlds_passed_frozen": {"threshold": f"<= 2/{NUM_WORLDS}", "value": n["worlds_passed_frozen"],
                                 "met": full_size and n["worlds_passed_frozen"] <= 2, "note": note},
        "recovery_nll_ttt_vs_frozen": {
            "threshold": "ttt <= 0.8 x frozen (>= 20% lower)", "value": {"ttt": r_ttt, "frozen": r_frozen},
            "reduction": (1 - r_ttt / r_frozen if r_ttt is not None and r_frozen else None),
            "met": r_ttt is not None and r_frozen is not None and r_ttt <= 0.8 * r_frozen + EPS},
    }


def _provenance(prov: dict) -> dict:
    return {k: prov.get(k) for k in PROVENANCE_KEYS if k in prov}


def build_report(eval_dir, memory_dir, eval_full_dir, memory_full_dir, *, minutes: float, command: str,
                 seeds=None, run_config: str | None = None) -> dict:
    runs = {"eval": load_results(eval_dir, "eval"), "memory": load_results(memory_dir, "memory"),
            "eval_full": load_results(eval_full_dir, "eval_full"),
            "memory_full": load_results(memory_full_dir, "memory_full")}
    check_same_checkpoint(runs)
    cur = numbers(runs["eval"], runs["memory"])
    full = numbers(runs["eval_full"], runs["memory_full"])
    num_worlds = int(runs["memory"]["ttt"]["num_worlds"])
    tg = targets(cur, num_worlds)
    report = {
        **cur,
        "full_context": full,
        "minutes": float(minutes),
        "command": command,
        "counts": {"current_round": counts(runs["eval"], runs["memory"]),
                   "full": counts(runs["eval_full"], runs["memory_full"])},
        "context_policy": {slot: {"used": r["context_policy"], "trained": r["context_policy_trained"]}
                           for slot, r in runs.items()},
        "targets": tg,
        "all_targets_met": all(t["met"] for t in tg.values()),
        "seeds": {"given": seeds, "memory_worlds": runs["memory"].get("seeds"),
                  "memory_worlds_full": runs["memory_full"].get("seeds")},
        "sources": {slot: {"file": r["file"], "sha256": r["sha256"], "checkpoint": _provenance(r["checkpoint"])}
                    for slot, r in runs.items()},
    }
    if run_config is not None:
        p = pathlib.Path(run_config)
        if not p.is_file():
            raise ReportInputError(f"{p}: no such run config (--run-config)")
        report["run_config"] = {"file": str(p), "sha256": _sha256(p), "config": json.loads(p.read_text())}
    return report


def _fmt(x) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.3f}"
    if isinstance(x, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in x.items())
    return str(x)


def markdown(report: dict) -> str:
    c = report["counts"]
    ck = report["sources"]["eval"]["checkpoint"]
    lines = ["# Adaptation: ttt vs frozen (issue 7)", "",
             f"- command ({report['minutes']:.1f} min): `{report['command']}`",
             f"- checkpoint `{ck.get('path')}` (sha256 {str(ck.get('sha256') or ck.get('export_sha256'))[:16]}), "
             f"trained with context policy `{report['context_policy']['eval']['trained']}`",
             f"- seeds: {json.dumps(report['seeds'])}",
             "", "## Targets (current_round context)", "",
             "| target | threshold | measured | met |", "|---|---|---|---|"]
    for name, t in report["targets"].items():
        lines.append(f"| {name} | {t['threshold']} | {_fmt(t['value'])} | {'met' if t['met'] else '**not met**'} |")
    lines += ["", "## current_round vs full context", "",
              "| metric | current_round ttt | current_round frozen | full ttt | full frozen |", "|---|---|---|---|---|"]
    rows = (("memory-check action exact match", "memory_exact_match"), ("memory test worlds passed", "worlds_passed"),
            ("recovery action NLL", "recovery_nll"))
    for label, key in rows:
        cells = []
        for src, cnt in ((report, c["current_round"]), (report["full_context"], c["full"])):
            for m in MODES:
                v, k = src[f"{key}_{m}"], cnt[f"{key}_{m}"]
                cell = _fmt(v)
                if isinstance(k, list):
                    cell += f" ({k[0]}/{k[1]})"
                elif isinstance(k, dict):
                    cell += f" ({k['rounds']} rounds, {k['tokens']} tokens)"
                lo, hi = src.get(f"{key}_{m}_lo"), src.get(f"{key}_{m}_hi")
                if lo is not None and hi is not None:
                    cell += f" [{_fmt(float(lo))}, {_fmt(float(hi))}]"
                cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if report.get("plot"):
        lines += ["", f"![ttt vs frozen, current_round and full context]({report['plot']})"]
    lines += ["", "Sources:", ""]
    for slot, s in report["sources"].items():
        lines.append(f"- {slot}: `{s['file']}` (sha256 {s['sha256'][:16]}, context policy "
                     f"`{report['context_policy'][slot]['used']}`)")
    return "\n".join(lines) + "\n"


def write_plot(report: dict, path: str | pathlib.Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("memory-check action exact match", "memory_exact_match"),
              (f"memory test worlds passed (of {NUM_WORLDS})", "worlds_passed"),
              ("recovery action NLL (lower is better)", "recovery_nll"))
    colors = {"ttt": "tab:blue", "frozen": "tab:gray"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (title, key) in zip(axes, panels):
        for j, m in enumerate(MODES):
            vals = [report[f"{key}_{m}"], report["full_context"][f"{key}_{m}"]]
            xs = [i + (j - 0.5) * 0.38 for i in range(2)]
            ax.bar(xs, [v if v is not None else 0 for v in vals], width=0.36, color=colors[m], label=m)
            for x, v in zip(xs, vals):
                ax.annotate(_fmt(v), (x, v or 0), ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0, 1], ["current_round", "full"])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def write_report(report: dict, out: str | pathlib.Path, *, plot: bool = True) -> dict[str, str]:
    """OUT (JSON), OUT with .md, and OUT with .png beside it."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out), "markdown": str(out.with_suffix(".md"))}
    if plot:
        files["plot"] = write_plot(report, out.with_suffix(".png"))
        report["plot"] = out.with_suffix(".png").name
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    return files
