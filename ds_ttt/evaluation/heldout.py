"""The held-out evaluation job behind `evals/evaluate.py`: load, check exposure, evaluate, write.

    from ds_ttt.evaluation.heldout import run_heldout
    results = run_heldout("RUN_OR_EXPORT", "DATA/manifest.json", "EVAL", context_policy=None)

attention_backend: the inner loop's attention kernel ("reference", "auto" = the device's FlashBoB
kernel, "cpu", "cuda"); results record the concrete one (`attention_backend`) and the request.

context_policy: None evaluates under the model's trained policy; "full" / "window" / "current_round"
replaces it after loading (runner.set_context_policy). Results record both (`context_policy`,
`context_policy_trained`); the checkpoint provenance (and `config.sha256`) stay the trained ones.

Only the manifest's `test` split is read. The exposure label says whether the model could have seen
these trajectories in training:
  held_out        none of them was trained on. Checked against the trainer's data_ids.json (the train
                  ids of every data stage of the run; exports carry a copy) when present, else: the
                  checkpoint was trained on this very manifest (its test split is group-disjoint from
                  train, checked at prepare), or on another manifest whose train split shares no id or
                  group with this test split;
  exposed         some of them were in a training split (counted in the detail);
  unknown         the checkpoint records neither data_ids.json nor a readable training manifest.
"""

from __future__ import annotations

import datetime
import pathlib

from ds_ttt.evaluation.report import write_results
from ds_ttt.evaluation.runner import MODES, evaluate_model, set_context_policy

RESULTS_FORMAT = "ds_ttt-eval-v1"


def exposure(provenance: dict, manifest, split: str = "test", ids: set[str] | None = None) -> dict:
    """Exposure label of `manifest`'s `split` (or of the trajectories `ids` in it) for a model with
    `provenance` (see module docstring)."""
    eval_trajs = [t for t in manifest.trajectories(split) if ids is None or t["id"] in ids]
    train_sha = provenance.get("manifest_sha256")
    train_path = provenance.get("manifest_path")
    ids_path = provenance.get("data_ids_path")
    if ids_path and pathlib.Path(ids_path).is_file():
        import json

        stages = json.loads(pathlib.Path(ids_path).read_text())["stages"]
        trained = {i for stage in stages for i in stage["train"]}
        ids = {t["id"] for t in eval_trajs}
        overlap = len(ids & trained)
        same = [stage["data_stage"] for stage in stages if stage.get("sha256") == manifest.sha256]
        where = f"test split of training stage {same[0]}'s manifest; " if same else "not a training manifest; "
        return {"label": "held_out" if overlap == 0 else "exposed",
                "detail": f"{where}{overlap} of {len(ids)} trajectories among the {len(trained)} trained ids "
                          f"of {len(stages)} data stage(s)",
                "training_manifest_sha256": train_sha, "overlap_ids": overlap,
                "data_stages": [{"data_stage": stage["data_stage"], "sha256": stage.get("sha256")} for stage in stages]}
    if train_sha and train_sha == manifest.sha256:
        return {"label": "held_out", "detail": f"{split} split of the training manifest (group-disjoint from train)",
                "training_manifest_sha256": train_sha}
    if train_path:
        try:
            from ds_ttt.data.manifest import load_manifest

            tm = load_manifest(train_path)
        except Exception as e:  # noqa: BLE001 - report, do not fail the evaluation
            return {"label": "unknown", "detail": f"training manifest {train_path} unreadable: {e}",
                    "training_manifest_sha256": train_sha}
        ids = {t["id"] for t in eval_trajs}
        groups = {t["meta"].get("group", t["id"]) for t in eval_trajs}
        train_trajs = tm.trajectories("train")
        id_overlap = len(ids & {t["id"] for t in train_trajs})
        group_overlap = len(groups & {t["meta"].get("group", t["id"]) for t in train_trajs})
        label = "held_out" if id_overlap == 0 and group_overlap == 0 else "exposed"
        return {"label": label, "detail": f"other manifest than training; {id_overlap} of {len(ids)} trajectories and "
                f"{group_overlap} of {len(groups)} groups are in the training split",
                "training_manifest_sha256": tm.sha256, "overlap_ids": id_overlap, "overlap_groups": group_overlap}
    return {"label": "unknown", "detail": "the checkpoint records no training manifest",
            "training_manifest_sha256": train_sha}


def check_same_tokenizer(manifest, provenance: dict) -> None:
    """The manifest's trajectories are rendered with the manifest's tokenizer: with a compact vocabulary
    on either side it must be the model's own (another trim gives other ids)."""
    mine = provenance.get("tokenizer") or {}
    theirs = manifest.data["tokenizer"]
    if (mine.get("trimmed") or theirs.get("trimmed")) and mine.get("sha256") != theirs["hash"]:
        raise ValueError(f"{manifest.path}: its tokenizer (sha256 {theirs['hash']}) is not the model's "
                         f"({mine.get('sha256')}, {mine.get('source')}), and a compact vocabulary gives other ids; "
                         "evaluate on a manifest prepared with the model's tokenizer (its training manifest)")


def run_heldout(checkpoint: str, manifest_path: str, out_dir: str, *, device: str = "cpu", limit: int | None = None,
                progress: bool = True, modes=MODES, plots: bool = True, context_policy: str | None = None,
                window: int | None = None, attention_backend: str = "reference") -> dict:
    from ds_ttt.data.manifest import load_manifest
    from ds_ttt.loading import load_for_inference

    manifest = load_manifest(manifest_path)
    trajectories = manifest.rendered("test")
    if limit is not None:
        trajectories = trajectories[:limit]
    loaded = load_for_inference(checkpoint, device=device, attention_backend=attention_backend)
    check_same_tokenizer(manifest, loaded.provenance)
    trained_policy = loaded.model.ttt.context_policy
    if context_policy is not None:
        set_context_policy(loaded.model, context_policy, window=window)
    tokenizer = manifest.tokenizer()
    results = {
        "format": RESULTS_FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "context_policy": loaded.model.ttt.context_policy,
        "context_policy_trained": trained_policy,
        "attention_backend": loaded.provenance["attention_backend"],
        "attention_backend_requested": attention_backend,
        "exposure": exposure(loaded.provenance, manifest, ids={t.id for t in trajectories}),
        "checkpoint": loaded.provenance,
        "manifest": {"path": str(pathlib.Path(manifest_path)), "sha256": manifest.sha256, "split": "test",
                     "capacity": manifest.capacity, "limit": limit},
        "config": {"sha256": loaded.provenance.get("config_sha256"), "ttt": loaded.model.ttt.to_dict(),
                   "context_policy": loaded.model.ttt.context_policy, "context_policy_trained": trained_policy,
                   "num_hidden_layers": loaded.model.config.num_hidden_layers,
                   "num_adaptive": loaded.model.num_adaptive},
    }
    results.update(evaluate_model(loaded.model, trajectories, tokenizer=tokenizer, modes=modes, device=device,
                                  progress=progress))
    write_results(results, out_dir, plots=plots)
    return results
