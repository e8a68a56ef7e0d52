"""The memory test (after WorldTUI's): can the agent reproduce values it saw only once, rounds ago?

    from ds_ttt.evaluation.memory import run_memory_test
    results = run_memory_test("RUN_OR_EXPORT", "MEM")           # evals/memory_test.py

32 fresh worlds from `ds_ttt.data.generator.generate_memory_world(seed)` (seeds MEMORY_SEED_BASE + i;
the generator's training trajectories use the RNG namespace f"{seed}:{index}", memory worlds
f"memory-world:{seed}", and every key is a hash of a fresh random salt, so names and values are
never seen in training; with the training manifest at hand the values are also searched for in its
train split and the hits reported). In each world the agent generates two keys with real shell
commands (observed once), runs 1-3 distractor commands, then reads each key back with `cat`.
A readback is exact when the model predicts that `cat` output greedily from the command, end
token included (observation exact match of the readback round); a world passes only if both
readbacks are exact. Reported for ttt and frozen, under the model's configured context policy
(`current_round`: only the fast weights can carry a key across rounds; `full`: attention can copy it)
or the one given as `context_policy` (runner.set_context_policy); results record both
(`context_policy`, `context_policy_trained`). `attention_backend` ("reference", "auto", "cpu",
"cuda") picks the attention kernel; the concrete one is recorded.
"""

from __future__ import annotations

import datetime
import json
import pathlib

from ds_ttt.evaluation.runner import MODES, evaluate_trajectory, set_context_policy

MEMORY_SEED_BASE = 1_000_000  # the test seeds: reported, never used to choose a setting
MEMORY_DEV_SEED_BASE = 2_000_000  # the dev seeds: every setting is chosen on these
MEMORY_SPLITS = {"test": MEMORY_SEED_BASE, "dev": MEMORY_DEV_SEED_BASE}
RESULTS_FORMAT = "ds_ttt-memory-v1"


def memory_worlds(num_worlds: int = 32, seed_base: int = MEMORY_SEED_BASE) -> list[dict]:
    from ds_ttt.data.generator import generate_memory_world

    return [generate_memory_world(seed_base + i) for i in range(num_worlds)]


def contamination(worlds: list[dict], training_manifest: str | None) -> dict:
    """How many of the worlds' key values occur anywhere in the training split's text."""
    if not training_manifest:
        return {"checked": False, "detail": "the checkpoint records no training manifest"}
    try:
        from ds_ttt.data.manifest import load_manifest

        man = load_manifest(training_manifest)
        text = (man.dir / man.data["splits"]["train"]["file"]).read_text(encoding="utf-8")
    except Exception as e:  # noqa: BLE001 - report, do not fail the test
        return {"checked": False, "detail": f"{training_manifest}: {e}"}
    values = [v for w in worlds for v in w["meta"]["values"].values()]
    hits = sorted(v for v in values if v in text)
    return {"checked": True, "training_manifest_sha256": man.sha256, "num_values": len(values),
            "values_found_in_training": len(hits), "examples": hits[:5]}


def score_worlds(model, worlds: list[dict], tokenizer, *, modes=MODES, device="cpu", progress=True) -> dict:
    """Per mode: worlds passed, exact readbacks and memory facts, and the memory diagnostics
    (memory_diagnostics.py: first-token accuracy, worlds by number of keys, passed ids); the addressing
    margin once (a W_0 pass)."""
    from ds_ttt.data.render import render_trajectory
    from ds_ttt.evaluation.memory_diagnostics import addressing_margins, readback_sites, world_diagnostics

    per_mode = {m: {"worlds_passed": 0, "readbacks_exact": 0, "facts_exact": 0, "num_facts": 0} for m in modes}
    records = {m: [] for m in modes}
    passed = {m: [] for m in modes}
    all_sites, all_rendered = [], []
    rows = []
    it = worlds
    if progress:
        from tqdm import tqdm

        it = tqdm(worlds, desc="memory worlds", unit="world")
    for world in it:
        rendered = render_trajectory(world, tokenizer)
        all_rendered.append(rendered)
        all_sites.append(readback_sites(world, rendered, tokenizer))
        row = {"id": world["id"], "seed": world["meta"]["seed"], "num_tokens": len(rendered.input_ids),
               "readback_rounds": [rb["round"] for rb in world["meta"]["readbacks"]]}
        for m in modes:
            metrics, info = evaluate_trajectory(model, rendered, m, tokenizer=tokenizer, device=device)
            records[m].append(info["records"])
            passed[m].append(all(bool({r.round: r for r in metrics}[rb["round"]].obs_exact)
                                 for rb in world["meta"]["readbacks"]))
            by_round = {r.round: r for r in metrics}
            exact = [bool(by_round[rb["round"]].obs_exact) for rb in world["meta"]["readbacks"]]
            facts = [f["exact"] for r in metrics for f in r.memory]
            row[m] = {"readbacks_exact": exact, "passed": all(exact),
                      "readback_obs_nll": [by_round[rb["round"]].obs_nll for rb in world["meta"]["readbacks"]],
                      "facts_exact": facts}
            s = per_mode[m]
            s["worlds_passed"] += int(all(exact))
            s["readbacks_exact"] += sum(exact)
            s["facts_exact"] += sum(bool(f) for f in facts)
            s["num_facts"] += len(facts)
        rows.append(row)
    n = len(worlds)
    num_readbacks = sum(len(w["meta"]["readbacks"]) for w in worlds)
    for m, s in per_mode.items():
        s.update(num_worlds=n, num_readbacks=num_readbacks,
                 worlds=f"{s['worlds_passed']}/{n}", readbacks=f"{s['readbacks_exact']}/{num_readbacks}",
                 diagnostics=world_diagnostics(worlds, all_sites, records[m], passed[m]))
    margin = addressing_margins(model, all_rendered, all_sites) if model.num_adaptive else None
    return {"summary": per_mode, "addressing_margin": margin, "worlds": rows}


def markdown(results: dict) -> str:
    lines = ["# Memory test", "",
             f"- {results['num_worlds']} fresh worlds (seeds {results['seeds'][0]}..{results['seeds'][1]}), "
             f"context policy `{results['context_policy']}` (trained: "
             f"`{results.get('context_policy_trained', results['context_policy'])}`)",
             f"- checkpoint `{results['checkpoint'].get('path')}`, config sha256 {str(results['config_sha256'])[:16]}",
             f"- contamination: {results['contamination'].get('values_found_in_training', 'not checked')}", "",
             "| mode | worlds passed | readbacks exact | memory facts exact | first value token | passed by #keys (1/2/3/4) |",
             "|---|---|---|---|---|---|"]
    for m, s in results["summary"].items():
        d = s["diagnostics"]
        k = " / ".join(f"{d['by_num_keys'][x][0]}/{d['by_num_keys'][x][1]}" if x in d["by_num_keys"] else "-"
                       for x in ("1", "2", "3", "4"))
        lines.append(f"| {m} | {s['worlds']} | {s['readbacks']} | {s['facts_exact']}/{s['num_facts']} "
                     f"| {d['first_token_count'][0]}/{d['first_token_count'][1]} | {k} |")
    lines += ["", "Addressing margin (memory key at a readback: cosine with its own write minus the closest other "
              "write, W_0 pass; ds_ttt/evaluation/memory_diagnostics.py):", ""]
    for layer, v in (results.get("addressing_margin") or {}).items():
        lines.append(f"- layer {layer}: " + (f"{v['margin']:+.3f} ({v['above_zero'][0]}/{v['above_zero'][1]} > 0; "
                                              f"own {v['cos_own']:.3f}, other {v['cos_other']:.3f})"
                                              if v["margin"] is not None else "no world with two keys"))
    lines += ["", "Worlds passed: " + "; ".join(f"{m}: {', '.join(s['diagnostics']['passed_ids']) or 'none'}"
                                               for m, s in results["summary"].items())]
    return "\n".join(lines) + "\n"


def run_memory_test(checkpoint: str, out_dir: str, *, num_worlds: int = 32, seed_base: int = MEMORY_SEED_BASE,
                    device: str = "cpu", progress: bool = True, modes=MODES, context_policy: str | None = None,
                    window: int | None = None, attention_backend: str = "reference") -> dict:
    from ds_ttt.loading import load_for_inference

    loaded = load_for_inference(checkpoint, device=device, attention_backend=attention_backend)
    trained_policy = loaded.model.ttt.context_policy
    if context_policy is not None:
        set_context_policy(loaded.model, context_policy, window=window)
    tokenizer = loaded.tokenizer  # the model's own (a compact vocabulary's, hash-checked at load)
    worlds = memory_worlds(num_worlds, seed_base)
    results = {
        "format": RESULTS_FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "num_worlds": num_worlds,
        "seeds": [seed_base, seed_base + num_worlds - 1],
        "context_policy": loaded.model.ttt.context_policy,
        "context_policy_trained": trained_policy,
        "attention_backend": loaded.provenance["attention_backend"],
        "attention_backend_requested": attention_backend,
        "checkpoint": loaded.provenance,
        "config_sha256": loaded.provenance.get("config_sha256"),
        "contamination": contamination(worlds, loaded.provenance.get("manifest_path")),
    }
    results.update(score_worlds(loaded.model, worlds, tokenizer, modes=modes, device=device, progress=progress))
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(markdown(results))
    return results
