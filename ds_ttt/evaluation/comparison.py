"""The fair comparison: TTT against the ordinary agent on held-out sets that can tell them apart.

    from ds_ttt.evaluation.comparison import build_heldout_sets, score_checkpoint, compare_rows
    build_heldout_sets("DATA/manifest.json", "SETS", split="test")       # evals/heldout_sets.py
    row = score_checkpoint("RUN", "SETS", split="test")                  # evals/score_baseline.py
    report = compare_rows([row, ...])                                    # evals/baselines_report.py

Held-out sets (written once, scored identically for every model, so differences are paired):
  memory worlds      `generate_memory_world` on the split's seeds (test: MEMORY_SEED_BASE + i, dev:
                     MEMORY_DEV_SEED_BASE + i), from the held-out pool (names, value formats and
                     readback commands training never uses); worlds_128 over all, worlds_32 over the
                     first 32; a world passes when every readback observation is predicted exactly.
                     Beside them, 32 worlds of the TRAINING pool on the same seeds (fresh values, the
                     formats training uses): `worlds_train_pool_32`, a diagnostic that separates "the
                     memory does not work" from "it does not transfer to unseen formats".
  memory episodes    fresh memory-family episodes (generator seeds of the split's namespace) whose
                     task prompt appears nowhere in the training split (held-out episodes may share
                     a prompt, never a world); kept until >= `num_memory`
                     memory-check rounds (the action must reproduce an earlier observed fact).
  recovery episodes  fresh error_recovery episodes, same rule, until >= `num_recovery` recovery rounds
                     (the action right after a failing command).
Metrics per (model, mode): worlds_128 / worlds_32 / readbacks_exact (Wilson intervals),
copy_check (a diagnostic: the readbacks of the 128 worlds scored with FULL context whatever the model's
trained policy, so the earlier round that printed the value is in view: can the model reproduce it
verbatim by attention? for a full-context model it is readbacks_exact itself),
memory_action_em over memory-check rounds (Wilson), recovery_nll (token-weighted over recovery
rounds) and action_nll (every action token of both episode sets), each NLL with a bootstrap interval
over episodes; `compare_rows` adds paired bootstrap intervals on NLL differences between models
(the same episodes resampled together).

Modes: "ttt" (fast weights learn from every observation), "frozen" (the same TTT model with updates
off: an ablation, labelled so), "sft" (a model without adaptive layers; nothing to update).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from ds_ttt.evaluation.intervals import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, bootstrap_ratio_interval, wilson_interval
from ds_ttt.evaluation.memory import MEMORY_SPLITS
from ds_ttt.evaluation.plots import interval_bars, mode_color, pyplot, save_figure, write_report_files
from ds_ttt.model.context import ContextPolicy, PolicyKind

# generator seeds of the fresh episodes (the training corpus uses small seeds: 0, 1, ...)
EPISODE_SEEDS = {"test": 3_000_000, "dev": 4_000_000}
SETS_FORMAT = "ds_ttt-heldout-sets-v1"
ROW_FORMAT = "ds_ttt-baseline-row-v1"
GENERATE_BATCH = 100
MAX_BATCHES = 40


def _prompt(traj: dict) -> str:
    return next(m["content"] for m in traj["messages"] if m["role"] == "user")


def fresh_episodes(family: str, seed: int, train_prompts: set[str], *, min_units: int, units_of) -> tuple[list[dict], int]:
    """Generate `family` episodes (batches of GENERATE_BATCH, generator seeds seed, seed+1, ...) and keep
    those whose prompt is not a training prompt, until their units (`units_of(traj)`, e.g. recovery
    rounds) reach `min_units`. Returns (episodes, generated count).

    Two held-out episodes may share a prompt (a family has only so many task texts: error recovery
    has under 200 that training never uses) but never their world: an episode whose messages repeat
    a kept one's is dropped."""
    from ds_ttt.data.generator import generate

    kept, seen, units, generated = [], set(), 0, 0
    for b in range(MAX_BATCHES):
        for traj in generate(GENERATE_BATCH, seed=seed + b, family=family):
            generated += 1
            body = json.dumps(traj["messages"], sort_keys=True)
            if _prompt(traj) in train_prompts or body in seen or not units_of(traj):
                continue
            seen.add(body)
            kept.append(traj)
            units += units_of(traj)
            if units >= min_units:
                return kept, generated
    raise RuntimeError(f"{family}: only {units} of {min_units} units in {generated} fresh episodes with new prompts; "
                       "lower the requirement or vary the family more")


def build_heldout_sets(manifest_path: str, out_dir: str, *, split: str = "test", num_worlds: int = 128,
                       num_memory: int = 100, num_recovery: int = 200) -> dict:
    """Write OUT/{memory_episodes,recovery_episodes,memory_worlds}.jsonl and OUT/sets.json (seeds, counts, hashes)."""
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.manifest import load_manifest

    if split not in EPISODE_SEEDS:
        raise ValueError(f"split must be one of {sorted(EPISODE_SEEDS)}, got {split!r}")
    man = load_manifest(manifest_path)
    train_prompts = {_prompt(t) for t in man.trajectories("train")}
    seed = EPISODE_SEEDS[split]
    memory, gen_m = fresh_episodes("memory", seed, train_prompts, min_units=num_memory,
                                   units_of=lambda t: len({c["round"] for c in t["meta"].get("memory_checks") or []}))
    recovery, gen_r = fresh_episodes("error_recovery", seed + 10_000, train_prompts, min_units=num_recovery,
                                     units_of=lambda t: len(t["meta"].get("recovery_rounds") or []))
    worlds = [generate_memory_world(MEMORY_SPLITS[split] + i) for i in range(num_worlds)]
    train_pool = [generate_memory_world(MEMORY_SPLITS[split] + i, pool="train") for i in range(min(32, num_worlds))]
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = {"format": SETS_FORMAT, "split": split, "manifest": str(manifest_path), "manifest_sha256": man.sha256,
            "num_train_prompts": len(train_prompts), "files": {}}
    for name, trajs, seeds in (("memory_episodes", memory, [seed, gen_m]), ("recovery_episodes", recovery, [seed + 10_000, gen_r]),
                               ("memory_worlds", worlds, [MEMORY_SPLITS[split], MEMORY_SPLITS[split] + num_worlds - 1]),
                               ("memory_worlds_train_pool", train_pool,
                                [MEMORY_SPLITS[split], MEMORY_SPLITS[split] + len(train_pool) - 1])):
        text = "".join(json.dumps(t, sort_keys=True) + "\n" for t in trajs)
        (out / f"{name}.jsonl").write_text(text)
        info["files"][name] = {"num": len(trajs), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                               "seeds": seeds}
    info["files"]["memory_episodes"]["memory_check_rounds"] = sum(
        len({c["round"] for c in t["meta"]["memory_checks"]}) for t in memory)
    info["files"]["recovery_episodes"]["recovery_rounds"] = sum(len(t["meta"]["recovery_rounds"]) for t in recovery)
    (out / "sets.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def load_sets(sets_dir: str) -> tuple[dict, dict[str, list[dict]]]:
    d = pathlib.Path(sets_dir)
    info = json.loads((d / "sets.json").read_text())
    if info.get("format") != SETS_FORMAT:
        raise ValueError(f"{d / 'sets.json'}: format {info.get('format')!r}, expected {SETS_FORMAT!r}")
    sets = {}
    for name, meta in info["files"].items():
        text = (d / f"{name}.jsonl").read_text()
        if hashlib.sha256(text.encode()).hexdigest() != meta["sha256"]:
            raise ValueError(f"{d / (name + '.jsonl')}: sha256 differs from sets.json; rebuild the sets "
                             "(evals/heldout_sets.py) instead of editing them")
        sets[name] = [json.loads(line) for line in text.splitlines()]
    return info, sets


WORLD_SETS = ("memory_worlds", "memory_worlds_train_pool")  # the sets whose memory diagnostics every row carries


def modes_for(model) -> tuple[str, ...]:
    return ("ttt", "frozen") if model.num_adaptive > 0 else ("sft",)


def score_model(model, tokenizer, sets: dict[str, list[dict]], *, progress: bool = True) -> dict:
    """Per mode: the metrics above plus the per-episode units the paired comparison resamples, and the
    memory diagnostics of both world pools (memory_diagnostics.py)."""
    from ds_ttt.data.render import render_trajectory
    from ds_ttt.evaluation.memory_diagnostics import addressing_margins, readback_sites

    model.eval()
    rendered = {name: [render_trajectory(t, tokenizer) for t in trajs] for name, trajs in sets.items()}
    sites = {name: [readback_sites(w, r, tokenizer) for w, r in zip(sets[name], rendered[name])] for name in WORLD_SETS}
    margins = ({name: addressing_margins(model, rendered[name], sites[name]) for name in WORLD_SETS}
               if model.num_adaptive else None)
    out = {}
    for mode in modes_for(model):
        run_mode = "ttt" if mode == "ttt" else "frozen"
        records: dict[str, list] = {name: [] for name in WORLD_SETS}
        per_set = {name: _score_trajectories(model, tokenizer, trajs, run_mode, desc=f"{mode} {name}", progress=progress,
                                             records_out=records.get(name))
                   for name, trajs in rendered.items()}
        out[mode] = summarize_mode(per_set, sets)
        out[mode]["memory_diagnostics"] = {
            name: _world_diagnostics(sets[name], sites[name], records[name], per_set[name]) for name in WORLD_SETS}
        out[mode]["addressing_margin"] = margins
        if model.ttt.round_address and not model.policy.sees_everything:
            # the round address pools over the current round, which only current_round defines: no full-context
            # twin of this model exists, so the copy check is not measured (an empty count, reported as n/a)
            _add_rate(out[mode], "copy_check", [])
            out[mode]["copy_check_note"] = "not measured: the round address needs the current_round policy"
            continue
        copy_rows = per_set["memory_worlds"]
        if not model.policy.sees_everything:
            copy_rows = _score_full_context(model, tokenizer, rendered["memory_worlds"], run_mode, progress=progress)
        _add_rate(out[mode], "copy_check", [x for w in _readbacks(sets["memory_worlds"], copy_rows) for x in w])
    return out


def _score_trajectories(model, tokenizer, rendered: list, run_mode: str, *, desc: str, progress: bool,
                        records_out: list | None = None) -> list:
    """Per-round metrics (evaluate_trajectory) of every rendered trajectory, with a progress bar; with
    `records_out` (a list), each trajectory's event records are appended to it."""
    from tqdm import tqdm

    from ds_ttt.evaluation.runner import evaluate_trajectory

    out = []
    for r in tqdm(rendered, desc=desc, unit="traj", disable=not progress):
        metrics, info = evaluate_trajectory(model, r, run_mode, tokenizer=tokenizer)
        out.append(metrics)
        if records_out is not None:
            records_out.append(info["records"])
    return out


def _world_diagnostics(worlds: list[dict], sites: list, records: list, per_traj: list) -> dict:
    from ds_ttt.evaluation.memory_diagnostics import world_diagnostics

    return world_diagnostics(worlds, sites, records, [all(w) for w in _readbacks(worlds, per_traj)])


def _score_full_context(model, tokenizer, rendered: list, run_mode: str, *, progress: bool) -> list:
    """_score_trajectories with the model's context policy switched to full for the call."""
    trained = model.policy
    model.set_context_policy(ContextPolicy(PolicyKind.FULL))
    try:
        return _score_trajectories(model, tokenizer, rendered, run_mode, desc=f"{run_mode} copy check (full context)",
                                   progress=progress)
    finally:
        model.set_context_policy(trained)


def _readbacks(trajs: list[dict], per_traj: list) -> list[list[bool]]:
    out = []
    for traj, metrics in zip(trajs, per_traj):
        by_round = {m.round: m for m in metrics}
        out.append([bool(by_round[rb["round"]].obs_exact) for rb in traj["meta"]["readbacks"]])
    return out


def _add_rate(res: dict, key: str, outcomes: list[bool]) -> None:
    k, n = int(sum(outcomes)), len(outcomes)
    lo, hi = wilson_interval(k, n)
    res.update({key: k / n if n else None, f"{key}_lo": lo, f"{key}_hi": hi, f"{key}_count": [k, n]})


def summarize_mode(per_set: dict[str, list], sets: dict[str, list[dict]]) -> dict:
    worlds = _readbacks(sets["memory_worlds"], per_set["memory_worlds"])
    passed = [all(w) for w in worlds]
    in_pool = [all(w) for w in _readbacks(sets["memory_worlds_train_pool"], per_set["memory_worlds_train_pool"])]
    readbacks = [x for w in worlds for x in w]
    mem_em = [bool(m.action_exact) for ep in per_set["memory_episodes"] for m in ep if m.memory_check and m.action_exact is not None]
    rec_units = [(sum(m.action_nll_sum for m in ep if m.recovery), sum(m.action_tokens for m in ep if m.recovery))
                 for ep in per_set["recovery_episodes"]]
    act_units = [(sum(m.action_nll_sum for m in ep), sum(m.action_tokens for m in ep))
                 for name in ("memory_episodes", "recovery_episodes") for ep in per_set[name]]
    res = {}

    def nll(key, units):
        num, den = [u[0] for u in units], [u[1] for u in units]
        lo, hi = bootstrap_ratio_interval(num, den)
        res.update({key: sum(num) / sum(den) if sum(den) else None, f"{key}_lo": lo, f"{key}_hi": hi,
                    f"{key}_tokens": int(sum(den))})

    _add_rate(res, "worlds_128", passed)
    _add_rate(res, "worlds_32", passed[:32])
    _add_rate(res, "readbacks_exact", readbacks)
    _add_rate(res, "worlds_train_pool_32", in_pool)
    _add_rate(res, "memory_action_em", mem_em)
    nll("recovery_nll", rec_units)
    nll("action_nll", act_units)
    res["recovery_rounds"] = sum(1 for ep in per_set["recovery_episodes"] for m in ep if m.recovery)
    res["units"] = {"recovery": rec_units, "action": act_units}
    return res


def paired_nll_difference(units_a, units_b, *, num_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                          level: float = 0.95) -> dict:
    """NLL(a) - NLL(b), token-weighted, with a percentile interval from resampling the SAME episodes
    for both (units: [(nll_sum, tokens)] per episode, in the same episode order)."""
    a, b = np.asarray(units_a, dtype=np.float64), np.asarray(units_b, dtype=np.float64)
    if a.shape != b.shape or not np.array_equal(a[:, 1], b[:, 1]):
        raise ValueError("paired_nll_difference: the two models were not scored on the same episodes/tokens")
    keep = a[:, 1] > 0
    a, b = a[keep], b[keep]
    diff = a[:, 0].sum() / a[:, 1].sum() - b[:, 0].sum() / b[:, 1].sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(num_resamples, len(a)))
    boots = a[idx, 0].sum(1) / a[idx, 1].sum(1) - b[idx, 0].sum(1) / b[idx, 1].sum(1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boots, [alpha, 1 - alpha])
    return {"diff": float(diff), "lo": float(lo), "hi": float(hi), "excludes_zero": bool(lo > 0 or hi < 0)}


def score_checkpoint(checkpoint: str, sets_dir: str, *, label: str, progress: bool = True,
                     dynamic_eval_from: str | None = None) -> dict:
    """One model's rows (one per mode) on the sets, with its provenance. dynamic_eval_from: score the
    SFT model at `checkpoint` with that TTT run's inner step at test time (dynamic_eval.py)."""
    from ds_ttt.evaluation.dynamic_eval import load_model_for_scoring

    info, sets = load_sets(sets_dir)
    model, tokenizer, provenance = load_model_for_scoring(checkpoint, dynamic_eval_from=dynamic_eval_from)
    scored = score_model(model, tokenizer, sets, progress=progress)
    return {"format": ROW_FORMAT, "label": label, "checkpoint": str(checkpoint), "sets": info,
            "train_policy": model.ttt.context_policy, "adaptive_layers": model.num_adaptive,
            "ttt": model.ttt.to_dict(), "provenance": provenance, "modes": scored}


ROW_METRICS = ("worlds_128", "worlds_32", "readbacks_exact", "memory_action_em", "recovery_nll", "action_nll",
               "worlds_train_pool_32", "copy_check")


def compare_rows(models: list[dict], *, command: str, seeds: dict, load: dict) -> dict:
    """The report: a `rows` list (model, train_policy, eval_policy, mode, every metric with _lo/_hi)
    and paired NLL differences between the models' headline modes."""
    rows, headline = [], {}
    sets = {json.dumps(m["sets"]["files"], sort_keys=True) for m in models}
    if len(sets) != 1:
        raise ValueError("compare_rows: the models were scored on different held-out sets")
    for m in models:
        for mode, res in m["modes"].items():
            row = {"model": m["label"], "train_policy": m["train_policy"], "eval_policy": m["train_policy"],
                   "mode": mode, "ablation": mode == "frozen"}
            for k in ROW_METRICS:
                if k not in res:
                    raise ValueError(f"compare_rows: the row of {m['label']} ({mode}) has no {k!r}: it was scored "
                                     "before that metric existed; score it again (evals/score_baseline.py)")
                row.update({k: res[k], f"{k}_lo": res[f"{k}_lo"], f"{k}_hi": res[f"{k}_hi"]})
                if f"{k}_count" in res:
                    row[f"{k}_count"] = res[f"{k}_count"]
            row["recovery_rounds"] = res["recovery_rounds"]
            for k in ("memory_diagnostics", "addressing_margin"):
                if k not in res:
                    raise ValueError(f"compare_rows: the row of {m['label']} ({mode}) has no {k!r}: it was scored "
                                     "before the memory diagnostics existed; score it again (evals/score_baseline.py)")
                row[k] = res[k]
            rows.append(row)
            if mode != "frozen":
                headline[m["label"]] = res
    pairs = []
    names = list(headline)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for metric, unit in (("action_nll", "action"), ("recovery_nll", "recovery")):
                d = paired_nll_difference(headline[a]["units"][unit], headline[b]["units"][unit])
                pairs.append({"a": a, "b": b, "metric": metric, **d})
    first = models[0]["sets"]
    report = {"format": "ds_ttt-adaptation-baselines-v1", "rows": rows, "paired_differences": pairs,
              "sets": {"split": first["split"], "files": first["files"]}, "command": command, "seeds": seeds,
              "load": load}
    report["targets"] = targets(report)
    return report


def targets(report: dict) -> dict:
    """The fair comparison's targets that the rows present can decide (never relaxed; a missing row decides none):
    the current-round TTT model passes >= 50% of the 128 worlds with the interval's lower bound >= 40%,
    >= 50% of the training-pool worlds with two keys or more, and has memory-check EM >= 0.5 over >= 100
    episodes' rounds; TTT full context is no worse than SFT
    full context on action NLL and better on recovery NLL, with a paired interval excluding zero."""
    out = {}
    row = next((r for r in report["rows"]
                if r["mode"] == "ttt" and PolicyKind(r["train_policy"]) is PolicyKind.CURRENT_ROUND), None)
    if row is not None:
        out["worlds_128"] = {"threshold": ">= 50% of 128 worlds, interval lower bound >= 40%",
                             "value": row["worlds_128_count"], "lo": row["worlds_128_lo"],
                             "met": row["worlds_128_count"][1] >= 128 and row["worlds_128"] >= 0.5
                             and row["worlds_128_lo"] >= 0.4}
        k, n = row["memory_action_em_count"]
        out["memory_action_em"] = {"threshold": ">= 0.5 over >= 100 memory-check rounds", "value": [k, n],
                                   "met": n >= 100 and k / n >= 0.5}
        k, n = row["memory_diagnostics"]["memory_worlds_train_pool"]["multi_key_passed"]
        out["train_pool_multi_key_worlds"] = {"threshold": ">= 50% of the training-pool worlds with 2 or more keys",
                                              "value": [k, n], "met": n > 0 and k / n >= 0.5}
    for p in report["paired_differences"]:
        if {p["a"], p["b"]} == {"ttt_full", "sft_full"}:
            sign = 1 if p["a"] == "ttt_full" else -1  # the difference as ttt_full - sft_full
            diff, lo, hi = sign * p["diff"], min(sign * p["lo"], sign * p["hi"]), max(sign * p["lo"], sign * p["hi"])
            if p["metric"] == "action_nll":
                out["ttt_full_vs_sft_full_action_nll"] = {"threshold": "ttt_full - sft_full <= 0", "value": diff,
                                                          "interval": [lo, hi], "met": diff <= 0}
            else:
                out["ttt_full_vs_sft_full_recovery_nll"] = {
                    "threshold": "ttt_full - sft_full < 0, paired interval below 0", "value": diff,
                    "interval": [lo, hi], "met": hi < 0}
    return out


def _fmt(v, lo=None, hi=None, pct=False):
    if v is None:
        return "n/a"
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.3f}")
    return f"{f(v)} [{f(lo)}, {f(hi)}]" if lo is not None else f(v)


def markdown(report: dict) -> str:
    files = report["sets"]["files"]
    lines = ["# TTT against the ordinary agent (held-out, split `%s`)" % report["sets"]["split"], "",
             f"- memory worlds: {files['memory_worlds']['num']} (seeds {files['memory_worlds']['seeds']}); "
             f"memory episodes: {files['memory_episodes']['num']} ({files['memory_episodes']['memory_check_rounds']} "
             f"memory-check rounds); recovery episodes: {files['recovery_episodes']['num']} "
             f"({files['recovery_episodes']['recovery_rounds']} recovery rounds); prompts never seen in training; "
             "`worlds, training pool` is a diagnostic (formats training uses, fresh values); `copy check` too: the 128 "
             "worlds' readbacks with full context whatever the trained policy (can attention copy a value shown rounds ago?)",
             f"- command: `{report['command']}`", f"- seeds: {json.dumps(report['seeds'])}",
             f"- load average at start / end: {report['load'].get('start')} / {report['load'].get('end')}", "",
             "95% intervals: Wilson for rates, bootstrap over episodes for NLLs. `frozen` rows are ablations "
             "(the TTT model with its updates off), not baselines.", "",
             "| model | train policy | mode | worlds (128) | worlds (32) | readbacks exact | memory-check EM | recovery NLL "
             "| action NLL | worlds, training pool (32) | copy check (full context) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append("| " + " | ".join([
            r["model"], r["train_policy"], r["mode"] + (" (ablation)" if r["ablation"] else ""),
            _fmt(r["worlds_128"], r["worlds_128_lo"], r["worlds_128_hi"], True),
            _fmt(r["worlds_32"], r["worlds_32_lo"], r["worlds_32_hi"], True),
            _fmt(r["readbacks_exact"], r["readbacks_exact_lo"], r["readbacks_exact_hi"], True),
            _fmt(r["memory_action_em"], r["memory_action_em_lo"], r["memory_action_em_hi"], True),
            _fmt(r["recovery_nll"], r["recovery_nll_lo"], r["recovery_nll_hi"]),
            _fmt(r["action_nll"], r["action_nll_lo"], r["action_nll_hi"]),
            _fmt(r["worlds_train_pool_32"], r["worlds_train_pool_32_lo"], r["worlds_train_pool_32_hi"], True),
            _fmt(r["copy_check"], r["copy_check_lo"], r["copy_check_hi"], True)]) + " |")
    if report.get("targets"):
        lines += ["", "Targets of the fair comparison (measured on the test split, never relaxed):", "",
                  "| target | threshold | measured | met |", "|---|---|---|---|"]
        for name, t in report["targets"].items():
            val = t["value"]
            val = f"{val[0]}/{val[1]}" if isinstance(val, list) else f"{val:+.4f} {[round(x, 4) for x in t['interval']]}"
            lines.append(f"| {name} | {t['threshold']} | {val} | {'met' if t['met'] else '**not met**'} |")
    lines += memory_diagnostics_markdown(report["rows"])
    lines += ["", "Paired differences (a - b; the same episodes resampled for both; lower NLL is better):", "",
              "| a | b | metric | a - b | 95% interval | excludes 0 |", "|---|---|---|---|---|---|"]
    for p in report["paired_differences"]:
        lines.append(f"| {p['a']} | {p['b']} | {p['metric']} | {p['diff']:+.4f} | [{p['lo']:+.4f}, {p['hi']:+.4f}] | "
                     f"{'yes' if p['excludes_zero'] else 'no'} |")
    return "\n".join(lines) + "\n"


def memory_diagnostics_markdown(rows: list[dict]) -> list[str]:
    """The memory diagnostics of every row (memory_diagnostics.py): first-token accuracy of readbacks,
    worlds passed by number of keys in both pools, the addressing margin per adaptive layer, and the
    ids of the worlds that passed."""
    def keys(d):
        return " / ".join(f"{d['by_num_keys'][k][0]}/{d['by_num_keys'][k][1]}" if k in d["by_num_keys"] else "-"
                          for k in ("1", "2", "3", "4"))

    def margin(m):
        if not m:
            return "n/a (no adaptive layers)"
        return "; ".join(f"L{layer}: {v['margin']:+.3f} ({v['above_zero'][0]}/{v['above_zero'][1]} > 0)"
                         if v["margin"] is not None else f"L{layer}: n/a" for layer, v in m.items())

    lines = ["", "Memory diagnostics: the first value token of each readback predicted exactly; worlds passed by "
             "number of keys (1 / 2 / 3 / 4); the addressing margin (cosine of the memory key at a readback with its "
             "own write minus the largest with another key's write, per adaptive layer, W_0 pass; "
             "ds_ttt/evaluation/memory_diagnostics.py):", "",
             "| model | mode | first token (128) | first token (training pool) | by #keys (128) | by #keys (training pool) "
             "| margin (128) | margin (training pool) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, m = r["memory_diagnostics"], r["addressing_margin"] or {}
        h, t = d["memory_worlds"], d["memory_worlds_train_pool"]
        lines.append("| " + " | ".join([
            r["model"], r["mode"], _fmt(h["first_token"], h["first_token_lo"], h["first_token_hi"], True),
            _fmt(t["first_token"], t["first_token_lo"], t["first_token_hi"], True), keys(h), keys(t),
            margin(m.get("memory_worlds")), margin(m.get("memory_worlds_train_pool"))]) + " |")
    lines += ["", "Worlds passed (ids):", ""]
    for r in rows:
        d = r["memory_diagnostics"]
        lines.append(f"- {r['model']} {r['mode']}: 128 held-out: {', '.join(d['memory_worlds']['passed_ids']) or 'none'}; "
                     f"training pool: {', '.join(d['memory_worlds_train_pool']['passed_ids']) or 'none'}")
    return lines


def write_plot(report: dict, path) -> None:
    rows = report["rows"]
    plt = pyplot()
    labels = [f"{r['model']}\n{r['mode']}" for r in rows]
    colors = [mode_color(r["mode"], frozen=r["ablation"]) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title, pct in ((axes[0], "worlds_128", "memory worlds passed (128)", True),
                                (axes[1], "memory_action_em", "memory-check action EM", True),
                                (axes[2], "recovery_nll", "recovery action NLL (lower is better)", False)):
        interval_bars(ax, rows, key, labels, colors, title=title, unit_range=pct)
    save_figure(fig, path, title="TTT vs SFT baselines (95% intervals; grey = ablation with updates off)")


def write_report(report: dict, out_prefix) -> dict[str, str]:
    """PREFIX.json, .md and .png."""
    return write_report_files(report, out_prefix, markdown=markdown, write_plot=write_plot)
