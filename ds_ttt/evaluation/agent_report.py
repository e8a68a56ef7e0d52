"""The closed-loop report: success rows with Wilson intervals and paired differences on the same tasks.

    from ds_ttt.evaluation.agent_report import build_report, write_report
    report = build_report([scored_a, scored_b, ...], command=..., seeds=..., load=...)   # evals/agent_tasks_report.py
    write_report(report, "benchmarks/results/agent_tasks")        # .json, .md, .png

Input: what `score_model_on_tasks` (evals/agent_tasks.py) writes for one model: {"label", "suite",
"modes": {mode: {"row": summarize(...), "outcomes": {task id: solved}}}}.
Rows: one per (model, mode): model, mode, episodes, success, success_lo, success_hi (Wilson 95%),
per_family (each with its interval), seen / unseen kinds, stops, tokens, seconds.
Paired differences (the same tasks for both rows; success is per task, pass@k when k > 1):
  * diff = success(a) - success(b), with a percentile bootstrap interval over tasks (both rows'
    outcomes resampled together, BOOTSTRAP_RESAMPLES, fixed seed);
  * the exact McNemar test on the discordant tasks (two-sided binomial p-value);
for the first model's headline row against every other row, and each TTT row against its frozen
ablation.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from ds_ttt.evaluation.intervals import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED

REPORT_FORMAT = "ds_ttt-agent-tasks-v1"
SCORED_FORMAT = "ds_ttt-agent-tasks-model-v1"


def mcnemar_exact_p(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs under Binomial(n, 1/2)."""
    n = a_only + b_only
    if n == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_success_difference(a: dict[str, bool], b: dict[str, bool], *, num_resamples: int = BOOTSTRAP_RESAMPLES,
                              seed: int = BOOTSTRAP_SEED) -> dict:
    if set(a) != set(b):
        raise ValueError(f"paired rows must cover the same tasks ({len(set(a) ^ set(b))} differ)")
    ids = sorted(a)
    xa = np.array([a[i] for i in ids], dtype=np.float64)
    xb = np.array([b[i] for i in ids], dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(ids), size=(num_resamples, len(ids)))
    diffs = xa[idx].mean(1) - xb[idx].mean(1)
    lo, hi = np.quantile(diffs, [0.025, 0.975])
    a_only, b_only = int(((xa == 1) & (xb == 0)).sum()), int(((xa == 0) & (xb == 1)).sum())
    return {"tasks": len(ids), "diff": float(xa.mean() - xb.mean()), "lo": float(lo), "hi": float(hi),
            "a_only": a_only, "b_only": b_only, "mcnemar_p": mcnemar_exact_p(a_only, b_only)}


def build_report(scored: list[dict], *, command: str, seeds: dict, load: dict,
                 pairs: list[tuple[str, str]] = ()) -> dict:
    """`pairs`: more comparisons, each ("model/mode", "model/mode"), after the default ones (module docstring)."""
    suites = {json.dumps(s["suite"], sort_keys=True) for s in scored}
    if len(suites) != 1:
        raise ValueError("build_report: the models were scored on different task suites")
    rows, outcomes = [], {}
    for s in scored:
        if s.get("format") != SCORED_FORMAT:
            raise ValueError(f"{s.get('label')}: format {s.get('format')!r}, expected {SCORED_FORMAT!r}")
        for mode, res in s["modes"].items():
            rows.append(dict(res["row"]))
            outcomes[(s["label"], mode)] = res["outcomes"]
    keys = list(outcomes)
    todo = [(keys[0], k) for k in keys[1:]]
    todo += [((label, "ttt"), (label, "frozen")) for label, mode in keys
             if mode == "ttt" and (label, "frozen") in outcomes and ((label, "ttt"), (label, "frozen")) not in todo]
    for a, b in pairs:
        ka, kb = tuple(a.split("/", 1)), tuple(b.split("/", 1))
        for k in (ka, kb):
            if k not in outcomes:
                raise ValueError(f"pair {a} {b}: no row {'/'.join(k)}; rows: {['/'.join(x) for x in outcomes]}")
        if (ka, kb) not in todo:
            todo.append((ka, kb))
    paired = [{"a": f"{a[0]}/{a[1]}", "b": f"{b[0]}/{b[1]}", "metric": rows[0]["metric"],
               **paired_success_difference(outcomes[a], outcomes[b])} for a, b in todo]
    return {"format": REPORT_FORMAT, "suite": scored[0]["suite"], "rows": rows, "paired": paired,
            "command": command, "seeds": seeds, "load": load}


def _pct(x, lo=None, hi=None) -> str:
    if x is None:
        return "-"
    s = f"{100 * x:.1f}%"
    return s + (f" [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None else "")


def markdown(report: dict) -> str:
    suite = report["suite"]
    families = sorted({f for r in report["rows"] for f in r["per_family"]})
    out = [f"# Closed-loop held-out tasks ({suite['split']} split, {suite['num_tasks']} tasks, {len(suite['kinds'])} kinds)",
           "",
           "Each episode: the model acts with its own actions in a bubblewrap shell until it answers or hits the "
           "round limit; the task's own test scores the outcome (files or final answer). Success per task with a "
           "Wilson 95% interval; paired differences on the same tasks (bootstrap 95% interval, exact McNemar p).",
           "", f"Command: `{report['command']}`", f"Seeds: `{json.dumps(report['seeds'])}`; load average "
           f"{report['load'].get('start')} at start, {report['load'].get('end')} at end.", "",
           "| model | mode | metric | tasks | success | seen kinds | unseen kinds | "
           + " | ".join(families) + " | mean rounds | stops | seconds |",
           "|" + "---|" * (10 + len(families))]
    for r in report["rows"]:
        fam = [f"{r['per_family'][f]['solved']}/{r['per_family'][f]['n']}" if f in r["per_family"] else "-"
               for f in families]
        stops = ", ".join(f"{k} {v}" for k, v in r["stops"].items())
        secs = f"{r['seconds']:.0f}" if r.get("seconds") is not None else "-"
        out.append(f"| {r['model']} | {r['mode']} | {r['metric']} | {r['tasks']} | {r['solved']}/{r['tasks']} = "
                   f"{_pct(r['success'], r['success_lo'], r['success_hi'])} | {r['seen']['solved']}/{r['seen']['n']} | "
                   f"{r['unseen']['solved']}/{r['unseen']['n']} | " + " | ".join(fam)
                   + f" | {r['mean_rounds']:.1f} | {stops} | {secs} |")
    out += ["", "Paired differences (a − b, success on the same tasks):", "",
            "| a | b | tasks | diff [95%] | a only | b only | McNemar p |", "|---|---|---|---|---|---|---|"]
    for p in report["paired"]:
        out.append(f"| {p['a']} | {p['b']} | {p['tasks']} | {p['diff']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] | "
                   f"{p['a_only']} | {p['b_only']} | {p['mcnemar_p']:.3g} |")
    return "\n".join(out) + "\n"


def write_plot(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    families = sorted({f for r in rows for f in r["per_family"]})
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    colors = ["#bbbbbb" if r["mode"] == "frozen" else ("#1f77b4" if r["mode"] == "ttt" else "#ff7f0e") for r in rows]
    vals = [r["success"] or 0.0 for r in rows]
    err = [[max(0.0, v - (r["success_lo"] or 0)) for v, r in zip(vals, rows)],
           [max(0.0, (r["success_hi"] or 0) - v) for v, r in zip(vals, rows)]]
    axes[0].bar(range(len(rows)), vals, yerr=err, color=colors, capsize=3)
    axes[0].set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("task success (95% Wilson)", fontsize=10)
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        xs = [j + i * width for j in range(len(families))]
        axes[1].bar(xs, [r["per_family"].get(f, {}).get("rate") or 0.0 for f in families], width, color=colors[i],
                    edgecolor="black", linewidth=0.3, label=labels[i].replace("\n", " "))
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(families))], families, fontsize=8)
    axes[1].set_ylim(0, 1)
    axes[1].set_title("success per family", fontsize=10)
    axes[1].legend(fontsize=6, ncol=2)
    fig.suptitle("Closed-loop held-out tasks (grey = TTT with updates off, blue = TTT, orange = SFT)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out_prefix) -> dict[str, str]:
    out = pathlib.Path(out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = {k: str(out.with_suffix(f".{k}")) for k in ("json", "md", "png")}
    pathlib.Path(paths["json"]).write_text(json.dumps(report, indent=1) + "\n")
    pathlib.Path(paths["md"]).write_text(markdown(report))
    write_plot(report, paths["png"])
    return paths
