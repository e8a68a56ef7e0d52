"""Adaptation probe: a fast single-process meta-training sweep point of the adaptation experiments
(not the main job).

    .venv/bin/python benchmarks/adaptation_probe.py --manifest DATA/manifest.json --minutes 14 \
        --hidden 128 --layers 4 --adaptive 2 --prime 256 --inner-lr 1.0 --inner-clip 5.0 \
        --policy current_round --out benchmarks/results/adaptation_probe/run.json

Trains the single-device TTT model (same model code as the pipeline trainer, trainable scope `all`,
AdamW + warmup/cosine) on the manifest's train split for a wall-clock budget, then scores the held-out
memory family: for every `meta.memory_checks` entry, the action of that round must reproduce an earlier
fact; we report exact match of that whole action (greedy given the real history), its token
accuracy and NLL, with fast-weight updates (ttt) and without (frozen). Use a manifest prepared with
`--trim-vocab` (a compact vocabulary makes CPU steps ~5x cheaper). One JSON line of results per run.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import time

import torch

from ds_ttt.config import TTTConfig
from ds_ttt.data.manifest import load_manifest
from ds_ttt.data.token_kind import TokenKind
from ds_ttt.model.presets import tiny_qwen3_config
from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM


def to_batch(rendered):
    t = max(len(r.input_ids) for r in rendered)
    ids = torch.zeros(len(rendered), t, dtype=torch.long)
    kinds = torch.full((len(rendered), t), TokenKind.PAD)
    rounds = torch.zeros(len(rendered), t, dtype=torch.long)
    for i, r in enumerate(rendered):
        n = len(r.input_ids)
        ids[i, :n], kinds[i, :n], rounds[i, :n] = torch.tensor(r.input_ids), torch.tensor(r.kinds), torch.tensor(r.rounds)
        rounds[i, n:] = r.rounds[-1]
    return ids, kinds, rounds


def scored_rounds(model, test, family: str, rounds_of, update: bool):
    """The EventRecord of every listed round (`rounds_of(meta)`, one entry per check, repeats kept) of
    the test trajectories of `family`; rounds cut by the capacity filter are skipped."""
    for r in test:
        wanted = rounds_of(r.meta) if r.meta.get("family") == family else []
        if not wanted:
            continue
        records = model.trajectory_loss(*to_batch([r]), update=update, record=True, create_graph=False).records[0]
        by_round = {e.round: e for e in records}
        yield from (by_round[k] for k in wanted if k in by_round)


@torch.no_grad()
def score_memory(model, test, update: bool) -> dict:
    exact = total = ok_tokens = tokens = 0
    nll = 0.0
    for ev in scored_rounds(model, test, "memory", lambda m: [c["round"] for c in m.get("memory_checks") or []], update):
        act = ev.label_kinds == TokenKind.ACTION
        hit = ev.argmax[act] == ev.labels[act]
        exact += bool(hit.all())
        total += 1
        ok_tokens += int(hit.sum())
        tokens += int(act.sum())
        nll += float(ev.token_nll[act].sum())
    return {"exact": exact, "checks": total, "exact_rate": exact / max(total, 1),
            "token_accuracy": ok_tokens / max(tokens, 1), "nll": nll / max(tokens, 1)}


@torch.no_grad()
def score_recovery(model, test, update: bool) -> dict:
    """Action NLL of the round after each failing command (error_recovery family, meta.recovery_rounds)."""
    nll, tokens = 0.0, 0
    for ev in scored_rounds(model, test, "error_recovery", lambda m: m.get("recovery_rounds") or [], update):
        act = ev.label_kinds == TokenKind.ACTION
        nll += float(ev.token_nll[act].sum())
        tokens += int(act.sum())
    return {"nll": nll / max(tokens, 1), "tokens": tokens}


def score_worlds_summary(model, tokenizer, num_worlds: int, seed_base: int | None) -> dict:
    from ds_ttt.evaluation.memory import MEMORY_DEV_SEED_BASE, memory_worlds, score_worlds

    res = score_worlds(model, memory_worlds(num_worlds, MEMORY_DEV_SEED_BASE if seed_base is None else seed_base),
                       tokenizer, progress=False)
    return {m: {k: s[k] for k in ("worlds", "readbacks", "facts_exact", "num_facts")} for m, s in res["summary"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--out", required=True, help="JSON file to append this run's results to")
    ap.add_argument("--minutes", type=float, default=14.0)
    ap.add_argument("--max-steps", type=int, default=600, help="planned steps (the cosine schedule ends here)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--adaptive", type=int, default=2)
    ap.add_argument("--prime", type=int, default=256)
    ap.add_argument("--inner-lr", type=float, default=1.0)
    ap.add_argument("--inner-clip", type=float, default=5.0)
    ap.add_argument("--policy", default="current_round", choices=("full", "window", "current_round"))
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--obs-weight", type=float, default=0.0)
    ap.add_argument("--prime-init-std", type=float, default=None)
    ap.add_argument("--obs-loss-with-end", action="store_true", help="ttt.obs_loss_with_end (the main job's recipe)")
    ap.add_argument("--key-shift", type=int, default=0, help="ttt.key_shift: the memory key's token-shift width")
    ap.add_argument("--inner-loss", default="mean", choices=("mean", "sum"))
    ap.add_argument("--inner-clip-kind", default="global", choices=("global", "per_matrix"))
    ap.add_argument("--fast-matrices", default="all", choices=("all", "down"))
    ap.add_argument("--inner-steps", type=int, default=1)
    ap.add_argument("--round-address", action="store_true", help="ttt.round_address (the main recipe's)")
    ap.add_argument("--write-rate", action="store_true", help="ttt.write_rate: a learned per-token weight on the inner loss")
    ap.add_argument("--world-seed-base", type=int, default=None,
                    help="memory-world seeds (default: the dev seeds, ds_ttt.evaluation.memory.MEMORY_DEV_SEED_BASE)")
    ap.add_argument("--save", default=None, help="also save the trained model's state_dict and configs here (torch.save)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-worlds", type=int, default=32, help="memory-test worlds to score at the end (0: skip)")
    ap.add_argument("--eval-every", type=int, default=0, help="also score the memory checks every N steps (0: only at the end)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    manifest = load_manifest(args.manifest)
    train, test = manifest.rendered("train"), manifest.rendered("test")
    vocab = -(-len(manifest.tokenizer()) // 64) * 64
    cfg = tiny_qwen3_config(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, vocab_size=vocab)
    ttt = TTTConfig(adaptive_layers=args.adaptive, prime_intermediate_size=args.prime, inner_lr=args.inner_lr,
                    inner_max_norm=args.inner_clip, context_policy=args.policy, trainable_scope="all",
                    checkpoint_events=False, obs_loss_weight=args.obs_weight,
                    prime_init_std=args.prime_init_std, obs_loss_with_end=args.obs_loss_with_end,
                    key_shift=args.key_shift, inner_loss=args.inner_loss, inner_clip=args.inner_clip_kind,
                    fast_matrices=args.fast_matrices, inner_steps=args.inner_steps,
                    round_address=args.round_address, write_rate=args.write_rate)
    torch.manual_seed(args.seed)
    model = TTTQwen3ForCausalLM(cfg, ttt)
    model.set_trainable_scope()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng, start, losses = random.Random(args.seed), time.time(), []
    planned = args.max_steps
    step = 0
    for step in range(planned):
        warm = max(1, int(0.1 * planned))
        frac = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (planned - warm)))
        for g in opt.param_groups:
            g["lr"] = args.lr * frac
        out = model.trajectory_loss(*to_batch(rng.sample(train, args.batch)))
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss))
        if step % 50 == 0:
            print(f"step {step} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} ({time.time() - start:.0f} s)", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            model.eval()
            print(f"step {step} memory ttt {score_memory(model, test, True)} frozen {score_memory(model, test, False)}", flush=True)
            model.train()
        if args.eval_every and step and step % args.eval_every == 0 and args.memory_worlds:
            model.eval()
            print(f"step {step} worlds {score_worlds_summary(model, manifest.tokenizer(), args.memory_worlds, args.world_seed_base)}", flush=True)
            model.train()
        if time.time() - start > args.minutes * 60:
            break
    model.eval()
    result = {"args": vars(args), "steps": step + 1, "train_seconds": round(time.time() - start, 1),
              "final_loss_avg20": sum(losses[-20:]) / len(losses[-20:]),
              "memory_ttt": score_memory(model, test, True), "memory_frozen": score_memory(model, test, False),
              "recovery_ttt": score_recovery(model, test, True), "recovery_frozen": score_recovery(model, test, False)}
    if args.memory_worlds:
        result["memory_worlds"] = score_worlds_summary(model, manifest.tokenizer(), args.memory_worlds, args.world_seed_base)
    print(json.dumps(result, indent=1))
    if args.save:
        torch.save({"state_dict": model.state_dict(), "config": cfg.to_dict(), "ttt": ttt.to_dict()}, args.save)
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
