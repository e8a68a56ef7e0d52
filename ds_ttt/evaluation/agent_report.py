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
  * a second interval that resamples kinds instead of tasks (kind_clustered_difference): the tasks of one
    kind are near copies, so the task-level interval is too narrow;
for the first model's headline row against every other row, and each TTT row against its frozen
ablation. Every pair is labelled with its own rows' metric.
Several training seeds (scored files carrying `train_seed`): rows and pairs per seed, and `pooled`, one
entry per pair and task subset: {a, b, metric, subset ("all", or "needs_observation": the kinds that need
the observation), seeds (those with both rows), diff (the mean over seeds), lo, hi (the kind-resampling
interval, the same kinds drawn for every seed), wins (the seeds where a is ahead), per_seed}.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from ds_ttt.evaluation.intervals import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, wilson_interval
from ds_ttt.evaluation.plots import interval_bars, mode_color, pyplot, save_figure, write_report_files

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


def task_kinds(scored: dict) -> dict[str, str]:
    """task id -> kind, from one scored model's episodes (every mode runs the same tasks)."""
    return {e["task"]: e["kind"] for res in scored["modes"].values() for e in res["episodes"]}


def kind_clustered_difference(pairs: list[tuple[dict[str, bool], dict[str, bool]]], kinds: dict[str, str], *,
                              num_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
    """success(a) - success(b) averaged over seeds, with a bootstrap interval that resamples kinds.

    `pairs`: one (a's outcomes, b's outcomes) per training seed, all on the tasks of `kinds` (task id ->
    kind). The tasks of one kind are near copies (one generator, other seeds), so they are not independent
    draws: a replicate draws the kinds with replacement (each drawn kind brings all its tasks) and
    recomputes every seed's difference on those tasks, the same kinds for every seed, then their mean.
    Percentile 95% interval over `num_resamples` replicates, fixed seed. One seed: that seed's
    kind-clustered interval. Returns {seeds, tasks, kinds, diff, lo, hi, per_seed, wins}, wins = the
    seeds whose difference is > 0."""
    ids = sorted(kinds)
    for a, b in pairs:
        if set(a) != set(ids) or set(b) != set(ids):
            raise ValueError("kind_clustered_difference: every pair must cover exactly the tasks of `kinds`")
    names = sorted(set(kinds.values()))
    kind_index = np.array([names.index(kinds[t]) for t in ids])
    tasks_per_kind = np.bincount(kind_index, minlength=len(names)).astype(np.float64)
    diff_sums_SK = np.stack([np.bincount(kind_index, weights=[float(a[t]) - float(b[t]) for t in ids],
                                         minlength=len(names)) for a, b in pairs])
    rng = np.random.default_rng(seed)
    idx_RK = rng.integers(0, len(names), size=(num_resamples, len(names)))
    replicates_SR = diff_sums_SK[:, idx_RK].sum(-1) / tasks_per_kind[idx_RK].sum(-1)
    lo, hi = np.quantile(replicates_SR.mean(0), [0.025, 0.975])
    per_seed = diff_sums_SK.sum(1) / tasks_per_kind.sum()
    return {"seeds": len(pairs), "tasks": len(ids), "kinds": len(names), "diff": float(per_seed.mean()),
            "lo": float(lo), "hi": float(hi), "per_seed": [float(d) for d in per_seed],
            "wins": int((per_seed > 0).sum())}


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


def success_by_observation(row: dict, kinds: dict) -> dict:
    """A row's success split by whether its kinds need the observation (suite.json's per-kind
    `needs_observation`, ds_ttt/tasks/blind_policies.py: False = a blind replay of another instance's
    solution solves some task of it): {"needs_observation" | "fixed_script" | "unmeasured": {n, solved,
    rate, lo, hi}} (Wilson 95%), from the row's per_kind counts."""
    group = {True: "needs_observation", False: "fixed_script", None: "unmeasured"}
    counts: dict[str, list[int]] = {}
    for kind, r in row["per_kind"].items():
        c = counts.setdefault(group[kinds[kind].get("needs_observation")], [0, 0])
        c[0] += r["n"]
        c[1] += r["solved"]
    out = {}
    for name, (n, solved) in counts.items():
        lo, hi = wilson_interval(solved, n)
        out[name] = {"n": n, "solved": solved, "rate": solved / n if n else None, "lo": lo, "hi": hi}
    return out


def _comparisons(keys: list[tuple[str, str]], pairs) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The (a, b) row keys to compare: the first row against every other, each TTT row against its frozen
    ablation, then `pairs` ("model/mode", "model/mode")."""
    todo = [(keys[0], k) for k in keys[1:]]
    todo += [((label, "ttt"), (label, "frozen")) for label, mode in keys
             if mode == "ttt" and (label, "frozen") in keys and ((label, "ttt"), (label, "frozen")) not in todo]
    for a, b in pairs:
        ka, kb = tuple(a.split("/", 1)), tuple(b.split("/", 1))
        for k in (ka, kb):
            if k not in keys:
                raise ValueError(f"pair {a} {b}: no row {'/'.join(k)}; rows: {['/'.join(x) for x in keys]}")
        if (ka, kb) not in todo:
            todo.append((ka, kb))
    return todo


def _pair_metric(metric_a: str, metric_b: str) -> str:
    """A pair's own metric label (pass@1, or "pass@1 vs pass@4" when its rows differ)."""
    return metric_a if metric_a == metric_b else f"{metric_a} vs {metric_b}"


def build_report(scored: list[dict], *, command: str, seeds: dict, load: dict,
                 pairs: list[tuple[str, str]] = (), sweeps: list[dict] = ()) -> dict:
    """`pairs`: more comparisons, each ("model/mode", "model/mode"), after the default ones (module docstring).

    Several training seeds: the scored files are grouped by their `train_seed` (evals/agent_tasks.py
    --train-seed; None = one group). The first seed has every row; a later seed has the headline row
    and any of the others (a control trained on one seed only, e.g. SFT at equal compute). Rows and
    paired differences are per seed (each row and pair carries `seed`; pairs also `kinds_lo`/`kinds_hi`,
    the interval that resamples kinds); `pooled` holds each pair over the seeds that have both its rows
    (kind_clustered_difference: mean diff, the kind-resampling interval, `wins`), twice when the suite
    marks fixed-script kinds: `subset` "all" (every task) and "needs_observation" (only the tasks of
    kinds whose suite.json entry says needs_observation: the claims rest on these). `sweeps`: the dev sweeps of dynamic evaluation's inner step
    (evals/dynamic_eval_sweep.py), kept as they are and shown in the markdown."""
    suites = {json.dumps(s["suite"], sort_keys=True) for s in scored}
    if len(suites) != 1:
        raise ValueError("build_report: the models were scored on different task suites")
    rows, outcomes, metrics = [], {}, {}
    for s in scored:
        if s.get("format") != SCORED_FORMAT:
            raise ValueError(f"{s.get('label')}: format {s.get('format')!r}, expected {SCORED_FORMAT!r}")
        train_seed = s.get("train_seed")
        for mode, res in s["modes"].items():
            if (train_seed, s["label"], mode) in outcomes:
                raise ValueError(f"{s['label']}/{mode} of training seed {train_seed} is given twice")
            row = dict(res["row"], seed=train_seed)
            row["by_observation"] = success_by_observation(row, s["suite"]["kinds"])
            rows.append(row)
            outcomes[(train_seed, s["label"], mode)] = res["outcomes"]
            metrics[(train_seed, s["label"], mode)] = res["row"]["metric"]
    seed_order = list(dict.fromkeys(k[0] for k in outcomes))
    keys_of = {t: [k[1:] for k in outcomes if k[0] == t] for t in seed_order}
    keys = keys_of[seed_order[0]]
    for t in seed_order[1:]:
        extra = sorted(set(keys_of[t]) - set(keys))
        if extra or keys[0] not in keys_of[t]:
            raise ValueError(f"build_report: training seed {t} has rows {sorted(keys_of[t])}; every seed needs the "
                             f"headline row {'/'.join(keys[0])} and no row that seed {seed_order[0]} lacks "
                             f"({sorted(keys)}): name the seed with every row first")
    todo = _comparisons(keys, pairs)
    kinds = task_kinds(scored[0])
    observed = {t: k for t, k in kinds.items() if scored[0]["suite"]["kinds"][k].get("needs_observation") is True}
    subsets = [("all", kinds)] + ([("needs_observation", observed)] if observed and len(observed) < len(kinds) else [])
    paired, pooled = [], []
    for a, b in todo:
        label = {"a": f"{a[0]}/{a[1]}", "b": f"{b[0]}/{b[1]}",
                 "metric": _pair_metric(metrics[(seed_order[0], *a)], metrics[(seed_order[0], *b)])}
        both = [t for t in seed_order if a in keys_of[t] and b in keys_of[t]]
        for t in both:
            one = kind_clustered_difference([(outcomes[(t, *a)], outcomes[(t, *b)])], kinds)
            paired.append({"seed": t, **label, **paired_success_difference(outcomes[(t, *a)], outcomes[(t, *b)]),
                           "kinds_lo": one["lo"], "kinds_hi": one["hi"]})
        for subset, on in subsets:
            over = kind_clustered_difference([({i: outcomes[(t, *a)][i] for i in on}, {i: outcomes[(t, *b)][i] for i in on})
                                              for t in both], on)
            pooled.append({**label, "subset": subset, "seeds": both,
                           **{k: over[k] for k in ("diff", "lo", "hi", "wins", "per_seed", "kinds", "tasks")}})
    return {"format": REPORT_FORMAT, "suite": scored[0]["suite"], "rows": rows, "paired": paired, "pooled": pooled,
            "dynamic_eval_sweep": list(sweeps), "command": command, "seeds": seeds, "load": load}


def _pct(x, lo=None, hi=None) -> str:
    if x is None:
        return "-"
    s = f"{100 * x:.1f}%"
    return s + (f" [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None else "")


def markdown(report: dict) -> str:
    suite = report["suite"]
    families = sorted({f for r in report["rows"] for f in r["per_family"]})
    many_seeds = len({r.get("seed") for r in report["rows"]}) > 1
    out = [f"# Closed-loop held-out tasks ({suite['split']} split, {suite['num_tasks']} tasks, {len(suite['kinds'])} kinds)",
           "",
           "Each episode: the model acts with its own actions in a bubblewrap shell until it answers or hits the "
           "round limit; the task's own test scores the outcome (files or final answer). Success per task with a "
           "Wilson 95% interval; paired differences on the same tasks (bootstrap 95% interval, exact McNemar p).",
           "", f"Command: `{report['command']}`", f"Seeds: `{json.dumps(report['seeds'])}`; load average "
           f"{report['load'].get('start')} at start, {report['load'].get('end')} at end.", "",
           "Claims rest on the kinds that need the observation: a kind is a fixed-script kind when a blind replay "
           "of another instance's reference solution solves one of its tasks (ds_ttt/tasks/blind_policies.py); "
           "such kinds measure following an instruction, not learning from output.", "",
           "| " + ("seed | " if many_seeds else "") + "model | mode | metric | tasks | success | needs observation | "
           "fixed script | seen kinds | unseen kinds | " + " | ".join(families) + " | mean rounds | stops | seconds |",
           "|" + "---|" * (12 + len(families) + many_seeds)]
    for r in report["rows"]:
        fam = [f"{r['per_family'][f]['solved']}/{r['per_family'][f]['n']}" if f in r["per_family"] else "-"
               for f in families]
        stops = ", ".join(f"{k} {v}" for k, v in r["stops"].items())
        secs = f"{r['seconds']:.0f}" if r.get("seconds") is not None else "-"
        split = [f"{g['solved']}/{g['n']} = {_pct(g['rate'], g['lo'], g['hi'])}" if (g := r.get("by_observation", {})
                 .get(name)) else "-" for name in ("needs_observation", "fixed_script")]
        out.append((f"| {r.get('seed')} " if many_seeds else "") + f"| {r['model']} | {r['mode']} | {r['metric']} | {r['tasks']} | {r['solved']}/{r['tasks']} = "
                   f"{_pct(r['success'], r['success_lo'], r['success_hi'])} | {split[0]} | {split[1]} | "
                   f"{r['seen']['solved']}/{r['seen']['n']} | "
                   f"{r['unseen']['solved']}/{r['unseen']['n']} | " + " | ".join(fam)
                   + f" | {r['mean_rounds']:.1f} | {stops} | {secs} |")
    out += ["", "Paired differences (a − b, success on the same tasks; 95% intervals resampling tasks, and "
            "resampling kinds with all their tasks: the tasks of one kind are near copies, not independent):", "",
            "| " + ("seed | " if many_seeds else "") + "a | b | metric | tasks | diff | [95%, tasks] | [95%, kinds] | "
            "a only | b only | McNemar p |", "|" + "---|" * (10 + many_seeds)]
    for p in report["paired"]:
        kinds_ci = f"[{p['kinds_lo']:+.3f}, {p['kinds_hi']:+.3f}]" if "kinds_lo" in p else "-"
        out.append((f"| {p.get('seed')} " if many_seeds else "") + f"| {p['a']} | {p['b']} | {p['metric']} | "
                   f"{p['tasks']} | {p['diff']:+.3f} | [{p['lo']:+.3f}, {p['hi']:+.3f}] | {kinds_ci} | "
                   f"{p['a_only']} | {p['b_only']} | {p['mcnemar_p']:.3g} |")
    out += pooled_markdown(report)
    return "\n".join(out) + "\n"


def pooled_markdown(report: dict) -> list[str]:
    """The pooled table (each pair's mean difference over training seeds) and the dev sweeps of dynamic
    evaluation's inner step, as markdown lines (none for a report without them)."""
    out = []
    if report.get("pooled"):
        seeds = sorted({s for p in report["pooled"] for s in p["seeds"]}, key=str)
        over = (f"training seeds {', '.join(map(str, seeds))}" if seeds != [None] else "one training run")
        out += ["", f"Pooled over {over}: the mean of the per-seed differences (over the seeds that have both rows); "
                "95% interval resampling the kinds (all tasks of a drawn kind, the same draw for every seed); "
                "wins = the seeds where a is ahead; tasks = all, or only the kinds that need the observation.", "",
                "| a | b | metric | tasks | seeds | kinds | mean diff [95%, kinds] | per seed | wins |",
                "|---|---|---|---|---|---|---|---|---|"]
        for p in report["pooled"]:
            per_seed = ", ".join(f"{d:+.3f}" for d in p["per_seed"])
            out.append(f"| {p['a']} | {p['b']} | {p['metric']} | {p.get('subset', 'all')} | {len(p['seeds'])} | "
                       f"{p['kinds']} | {p['diff']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] | {per_seed} | "
                       f"{p['wins']}/{len(p['seeds'])} |")
    if report.get("dynamic_eval_sweep"):
        out += ["", "Dynamic evaluation's inner step, tuned per SFT model and seed on the dev task suite (success "
                "in mode ttt; the pick: best success, ties to the smaller lr, then the smaller clip norm):", "",
                "| model | seed | dev tasks | " + " | ".join(
                    f"lr {g['inner_lr']:g}, norm {g['inner_max_norm']:g}" for g in report["dynamic_eval_sweep"][0]["grid"])
                + " | chosen |", "|" + "---|" * (4 + len(report["dynamic_eval_sweep"][0]["grid"]))]
        for sw in report["dynamic_eval_sweep"]:
            cells = " | ".join(f"{g['solved']}/{g['tasks']}" for g in sw["grid"])
            out.append(f"| {sw['label']} | {sw['seed']} | {sw['grid'][0]['tasks']} | {cells} | "
                       f"lr {sw['chosen']['inner_lr']:g}, norm {sw['chosen']['inner_max_norm']:g} |")
    return out


def write_plot(report: dict, path) -> None:
    plt = pyplot()
    rows = report["rows"]
    families = sorted({f for r in rows for f in r["per_family"]})
    fig, axes = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [1.2, 2]})
    many_seeds = len({r.get("seed") for r in rows}) > 1
    labels = [f"{r['model']} ({r['mode']})" + (f" seed {r.get('seed')}" if many_seeds else "") for r in rows]
    colors = [mode_color(r["mode"]) for r in rows]
    interval_bars(axes[0], rows, "success", labels, colors, title="task success (95% Wilson)", unit_range=True)
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        xs = [j + i * width for j in range(len(families))]
        axes[1].bar(xs, [r["per_family"].get(f, {}).get("rate") or 0.0 for f in families], width, color=colors[i],
                    edgecolor="black", linewidth=0.3, label=labels[i])
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(families))], families, fontsize=8)
    axes[1].set_ylim(0, 1)
    axes[1].set_title("success per family", fontsize=10)
    axes[1].legend(fontsize=6, ncol=2)
    save_figure(fig, path, title="Closed-loop held-out tasks (grey = TTT with updates off, blue = TTT, orange = SFT)")


def write_report(report: dict, out_prefix) -> dict[str, str]:
    """PREFIX.json, .md and .png."""
    return write_report_files(report, out_prefix, markdown=markdown, write_plot=write_plot)


EPISODE_LOG_FIELDS = ("task", "kind", "attempt", "success", "stop", "rounds", "updates", "actions", "test_log")


def episode_log(scored: dict) -> dict[str, list[dict]]:
    """What one scored model did, per mode: one record per episode with the commands it ran (`actions`, the
    tool calls in order), how it stopped and what its task's test said, sorted by task and attempt; the
    lines evals/agent_episodes.py commits beside the report so anyone can read the agent's work."""
    if scored.get("format") != SCORED_FORMAT:
        raise ValueError(f"{scored.get('label')}: format {scored.get('format')!r}, expected {SCORED_FORMAT!r}")
    out = {}
    for mode, res in scored["modes"].items():
        missing = sorted({f for e in res["episodes"] for f in EPISODE_LOG_FIELDS if f not in e})
        if missing:
            raise ValueError(f"{scored['label']}/{mode}: episodes without {missing} (scored by an older "
                             "evals/agent_tasks.py: score it again)")
        out[mode] = sorted(({f: e[f] for f in EPISODE_LOG_FIELDS} for e in res["episodes"]),
                           key=lambda e: (e["task"], e["attempt"]))
    return out
