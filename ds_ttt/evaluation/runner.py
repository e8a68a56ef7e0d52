"""Held-out evaluation: every test trajectory through the model in `ttt` and `frozen` mode, side by side.

    from ds_ttt.evaluation.runner import evaluate_model
    results = evaluate_model(model, rendered_trajectories, tokenizer=tok)    # {"summary", "per_round", ...}

`ttt`: the fast weights adapt on each real observation (one inner SGD step per round, exactly the
training event loop with create_graph=False) in an in-memory copy: W starts from the model's W_0 for
every trajectory and nothing is written back to the model's parameters. `frozen`: the same pass with
no updates (W_0 throughout). Both use the model's context policy, so the only difference between
the two columns is what the fast weights learned from the trajectory so far. Metrics: metrics.py.

`set_context_policy(model, "full")` evaluates a model under another context policy than the one it
was trained with (e.g. a `current_round` model with full attention: how much of the ttt gain remains
when attention can see the past).
"""

from __future__ import annotations

import torch

from ds_ttt.evaluation.metrics import RoundMetrics, by_round_index, round_metrics, summarize
from ds_ttt.model.context import PolicyKind

MODES = ("ttt", "frozen")


def set_context_policy(model, context_policy: str, *, window: int | None = None) -> PolicyKind:
    """Replace the model's context policy in place (`TTTQwen3ForCausalLM.set_context_policy`); returns the
    trained one's kind. `window` is needed for "window" unless the model was trained with a window (then
    it is kept); the other policies take none."""
    trained = model.policy
    model.set_context_policy(trained.switched_to(context_policy, window=window))
    return trained.kind


def evaluate_trajectory(model, traj, mode: str, *, tokenizer=None, device="cpu") -> tuple[list[RoundMetrics], dict]:
    """Per-round metrics of one RenderedTrajectory in `mode` ("ttt" or "frozen"), and a dict with the
    update counts and the event records (per-label greedy predictions and NLL, event_loop.EventRecord)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ids = torch.tensor([traj.input_ids], device=device)
    kinds = torch.tensor([traj.kinds], device=device)
    rounds = torch.tensor([traj.rounds], device=device)
    with torch.no_grad():  # the inner step enables grad for W only (see run_event_loop)
        out = model.trajectory_loss(ids, kinds, rounds, create_graph=False, update=(mode == "ttt"), record=True)
    checks = (traj.meta or {}).get("memory_checks") or []
    recovery = (traj.meta or {}).get("recovery_rounds") or []
    metrics = [round_metrics(rec, memory_checks=checks, recovery_rounds=recovery, tokenizer=tokenizer)
               for rec in out.records[0]]
    return metrics, {"num_updates": out.num_updates, "num_skipped": out.num_skipped, "records": out.records[0]}


def evaluate_model(model, trajectories, *, tokenizer=None, modes=MODES, device="cpu", progress: bool = True,
                   desc: str = "evaluate") -> dict:
    """Evaluate a list of RenderedTrajectory; returns summary / per-round / per-trajectory results."""
    was_training = model.training
    model.eval()
    per_mode: dict[str, list[list[RoundMetrics]]] = {m: [] for m in modes}
    traj_rows = []
    it = trajectories
    if progress:
        from tqdm import tqdm

        it = tqdm(trajectories, desc=desc, unit="traj")
    for traj in it:
        row = {"id": traj.id, "family": (traj.meta or {}).get("family"), "variant": (traj.meta or {}).get("variant"),
               "num_tokens": len(traj.input_ids), "num_rounds": max(traj.rounds) if traj.rounds else 0}
        for mode in modes:
            metrics, _ = evaluate_trajectory(model, traj, mode, tokenizer=tokenizer, device=device)
            per_mode[mode].append(metrics)
            row[mode] = {"summary": summarize(metrics), "rounds": [m.to_dict() for m in metrics if m.round > 0]}
        traj_rows.append(row)
    model.train(was_training)
    families = sorted({r["family"] for r in traj_rows if r["family"]})
    by_family = {m: {f: summarize([r for rows, t in zip(per_mode[m], traj_rows) if t["family"] == f for r in rows])
                     for f in families} for m in modes}
    return {
        "modes": list(modes),
        "num_trajectories": len(traj_rows),
        "summary": {m: summarize([r for rows in per_mode[m] for r in rows]) for m in modes},
        "per_round": {m: by_round_index(per_mode[m]) for m in modes},
        "by_family": by_family,
        "trajectories": traj_rows,
    }
