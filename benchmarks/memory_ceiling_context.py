"""The ceiling of the trained model's own memory key, and of a context-scored address: the ideal memory of
benchmarks/memory_ceiling.py with keys taken from a real model's hidden states, read by nearest neighbour.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_ceiling_context.py \
        [--checkpoint runs/main/run] [--heldout 128] [--train-pool 32]

Writes benchmarks/results/memory_ceiling_context.{json,md}. Runs on CPU on one thread in about 2 minutes
(83 s measured at load average 3-7, 132 s at 10-15, on 2 shared cores): one pass per world and model.

memory_ceiling.py's ideal memory sees token identities only; here the key of the label at position p is a
vector the model computes at p-1 (the position that predicts it), from one whole-sequence pass with W_0
under the model's `current_round` policy (ds_ttt/evaluation/memory_diagnostics.prime_inputs' pass). The
memory is the same (simulate_world / score_pool of memory_ceiling_keys.py: a round's observation tokens are
read with the memory of the earlier rounds, then written), but a read takes the written entry of largest
cosine similarity (within the same window key where the design has one); cosines within TIE_EPS of the
largest are one key, resolved by the write rule (overwrite: the latest write; first: the earliest).

Designs:
  - prime input, layer L: the input the prime MLP of adaptive layer L sees at p-1, as the forward feeds it:
    key(prime_layernorm(h)) with h the residual after attention, key = the learned token shift and the
    round address (fast_weights.PrimeMLP.key). The first adaptive layer's key never depends on the fast
    weights, so for it this is exactly the key the inner step writes at; the last layer's would move a
    little with the updates. Read over every entry, and (a variant) within the same window key;
  - prime input, centred (a diagnostic, not a key a model computes causally): less its mean over all
    positions of the world, so the component every key shares does not dominate the cosine;
  - context-scored pool (dot): today's window key + a_{p-1} = sum_j softmax_j(x_{p-1} . x_j / sqrt(C)) x_j
    over the round's positions j = round_start..p-1, x = the first adaptive layer's prime_layernorm(h)
    (plain dot-product scores, the query the hidden state at p-1); read by nearest neighbour within the
    window key. Variant "command": j only over the round's action tokens from `<tool_call>` on;
  - the model's own attention: today's window key + the first adaptive layer's attention output at p-1
    before o_proj (its heads' softmax pools of the round's values: under `current_round` attention sees the
    current round only), all heads concatenated, and each head alone;
  - references (token identities, as memory_ceiling.py scores them, rendered with the model's tokenizer):
    today's window and the name oracle.
Each design runs on the trained model and on a freshly initialised model of the same config (seed 0) as a
control: what training added.

Measured (benchmarks/results/memory_ceiling_context.md): the trained key (L3's prime input) passes 0/128
held-out and 7/32 training-pool worlds (its one-key worlds), the fresh model's 0/128 and 0/32; no
context-scored pool of the trained model passes more than 11/128 (one attention head). The ceiling is low:
the address itself must change. Every held-out second readback's nearest key is the first readback's (the
same command up to the name), not its own write's.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # memory_ceiling*.py, beside it
from memory_ceiling import scored_pools  # noqa: E402
from memory_ceiling_keys import ACTION, OBSERVATION, make_key_fn, round_starts, score_pool, window_key  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
TIE_EPS = 1e-5  # cosines within this of the largest are one key (float noise of equal contexts)


class NearestMemory:
    """The ideal memory read by nearest neighbour: key = (window key, vector); per window key the written
    unit vectors in write order; a read returns the token of the entry of largest cosine, ties (within
    TIE_EPS) to the latest write under "overwrite", the earliest under "first"; nothing written: a miss."""

    def __init__(self, write_rule: str):
        self.latest = write_rule == "overwrite"
        self.slots: dict = {}

    def write(self, key, tok: int) -> None:
        slot = self.slots.setdefault(key[0], {"vecs": [], "toks": [], "matrix": None})
        slot["vecs"].append(key[1])
        slot["toks"].append(tok)
        slot["matrix"] = None

    def read(self, key):
        slot = self.slots.get(key[0])
        if not slot:
            return None
        if slot["matrix"] is None:
            slot["matrix"] = np.stack(slot["vecs"])
        sims = slot["matrix"] @ key[1]
        ties = np.flatnonzero(sims >= sims.max() - TIE_EPS)
        return slot["toks"][ties[-1] if self.latest else ties[0]]


def nearest_sources(pool: list[dict], view: str) -> dict[str, int]:
    """At each readback's first value token: which earlier round holds the nearest observation key of `view`
    (no window): its own write (source round), an earlier readback round, or another round."""
    out = {"own write": 0, "earlier readback": 0, "other round": 0}
    for w in pool:
        obs = [q for q, k in enumerate(w["kinds"]) if k == OBSERVATION and q > 0]
        vecs, rb_rounds = w["tags"][view], {rb["round"] for rb in w["readbacks"]}
        for rb in w["readbacks"]:
            p, cand = w["firsts"].get(rb["round"]), [q for q in obs if w["rounds"][q] < rb["round"]]
            if p is None or not cand:
                continue
            r = w["rounds"][cand[int(np.argmax(vecs[[q - 1 for q in cand]] @ vecs[p - 1]))]]
            out["own write" if r == rb["source_round"] else "earlier readback" if r in rb_rounds else "other round"] += 1
    return out


def unit(a: np.ndarray) -> np.ndarray:  # rows scaled to norm 1, float32
    return (a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


@torch.no_grad()
def hidden_views(model, ids: list[int], rounds: list[int]) -> dict[str, np.ndarray]:
    """One whole-sequence pass with W_0 under the model's context policy: per position, "prime_L{i}" the
    prime MLP's input of each adaptive layer i (a pre-hook on the prime MLP: what the forward feeds it),
    "x" the first adaptive layer's prime_layernorm(h), "attn" its attention output before o_proj."""
    got, first = {}, model.adaptive_layers[0]
    hooks = [layer.prime_mlp.register_forward_pre_hook(
        lambda _m, args, i=layer.layer_idx: got.__setitem__(f"prime_L{i}", args[0][0])) for layer in model.adaptive_layers]
    hooks.append(first.prime_layernorm.register_forward_hook(lambda _m, _a, out: got.__setitem__("x", out[0])))
    hooks.append(first.self_attn.o_proj.register_forward_pre_hook(lambda _m, args: got.__setitem__("attn", args[0][0])))
    try:
        model(torch.tensor([ids]), torch.tensor([rounds]))
    finally:
        for h in hooks:
            h.remove()
    return {k: v.float().numpy() for k, v in got.items()}


def context_pool(x: np.ndarray, ids: list[int], kinds: list[int], rounds: list[int],
                 tool_call_id: int | None = None) -> np.ndarray:
    """Per position t: sum_j softmax_j(x_t . x_j / sqrt(C)) x_j over j in round_start(t)..t (with
    `tool_call_id`: only the round's action tokens from `<tool_call>` on, j <= t; none yet: zeros)."""
    out, bounds = np.zeros_like(x), sorted(set(round_starts(rounds))) + [len(ids)]
    action, is_call = np.asarray(kinds) == ACTION, np.asarray(ids) == tool_call_id
    for s, e in zip(bounds, bounds[1:]):
        xr = x[s:e].astype(np.float64)
        allowed = np.tril(np.ones((e - s, e - s), dtype=bool))
        if tool_call_id is not None:  # the round's action tokens from its first <tool_call> on
            allowed &= (action[s:e] & (np.cumsum(action[s:e] & is_call[s:e]) > 0))[None, :]
        scores = np.where(allowed, xr @ xr.T / math.sqrt(x.shape[1]), -np.inf)
        top = scores.max(1, keepdims=True)
        w = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
        out[s:e] = (w @ xr / np.maximum(w.sum(1, keepdims=True), 1e-300)).astype(x.dtype)
    return out


def vector_key_fn(view: str, window: int | None):
    """A key function for score_pool: key(p) = (the window key or (), the unit vector of `view` at p-1). The
    world's vectors come in score_pool's per-world `tags` slot (see `with_views`)."""
    def build(ids, kinds, rounds, views):
        vecs = views[view]
        return lambda p: (window_key(ids, rounds, p, window) if window else (), vecs[p - 1])
    return build


def with_views(pool: list[dict], model, tool_call_id: int) -> list[dict]:
    """The pool with each world's unit vectors (every design's view) in place of its name tags."""
    out = []
    for w in pool:
        v = hidden_views(model, w["ids"], w["rounds"])
        v["pool_round"] = context_pool(v["x"], w["ids"], w["kinds"], w["rounds"])
        v["pool_command"] = context_pool(v["x"], w["ids"], w["kinds"], w["rounds"], tool_call_id)
        hd = model.config.head_dim
        for h in range(v["attn"].shape[1] // hd):
            v[f"attn_h{h}"] = v["attn"][:, h * hd:(h + 1) * hd]
        for k in [k for k in v if k.startswith("prime_L")]:  # a diagnostic: less the world's mean key (all positions)
            v[k + "_centred"] = v[k] - v[k].mean(0, keepdims=True)
        out.append({**w, "tags": {k: unit(a) for k, a in v.items()}})
    return out


def designs(model, window: int) -> list[tuple[str, str, object]]:
    """(name, key description, key function) of every vector design for `model`'s adaptive layers."""
    layers = [layer.layer_idx for layer in model.adaptive_layers]
    out = [(f"prime input L{i}", f"layer {i}'s prime-MLP input at p-1, nearest over all entries",
            vector_key_fn(f"prime_L{i}", None)) for i in layers]
    out += [(f"prime input L{i}, centred", f"layer {i}'s prime-MLP input less its mean over the world's positions "
             "(a diagnostic: the mean sees the whole world), nearest over all entries",
             vector_key_fn(f"prime_L{i}_centred", None)) for i in layers]
    out += [(f"prime input L{layers[0]} + window {window}", f"window {window} + layer {layers[0]}'s prime-MLP input, "
             "nearest within the window key", vector_key_fn(f"prime_L{layers[0]}", window)),
            (f"context pool (dot), round + window {window}", f"window {window} + dot-product softmax pool of L"
             f"{layers[0]}'s prime_layernorm(h) over the round up to p-1, query at p-1", vector_key_fn("pool_round", window)),
            (f"context pool (dot), command + window {window}", f"the same pool over the round's tokens from <tool_call> "
             "on", vector_key_fn("pool_command", window)),
            (f"own attention (all heads) + window {window}", f"window {window} + L{layers[0]}'s attention output at "
             "p-1 before o_proj", vector_key_fn("attn", window))]
    out += [(f"own attention head {h} + window {window}", f"window {window} + head {h}'s output at p-1 (L{layers[0]})",
             vector_key_fn(f"attn_h{h}", window)) for h in range(model.config.num_attention_heads)]
    return out


def what_it_says(res: dict) -> str:
    """The md's paragraph, its numbers from `res` (overwrite rows; held-out, then training pool)."""
    rows = {(r["model"], r["name"]): r for r in res["designs"] if r["write_rule"] == "overwrite"}
    (l0, l1), w = res["adaptive_layers"][:1] + res["adaptive_layers"][-1:], res["window"]
    n = lambda m, d: "{} and {}".format(*(f"{rows[(m, d)][p]['passed']}/{rows[(m, d)][p]['worlds']}" for p in res["pools"]))  # noqa: E731
    best = max((r for r in rows.values() if r["model"] != "tokens"), key=lambda r: r["heldout"]["passed"])
    own = rows[("trained", f"prime input L{l0}")]["heldout"]
    return (f"Does the real key tell two facts apart? The trained model's own key (the prime input of L{l0}, which "
            f"no fast-weight update moves), with an exact memory read by nearest neighbour, passes "
            f"{n('trained', f'prime input L{l0}')} worlds (held-out and training pool); L{l1}'s "
            f"{n('trained', f'prime input L{l1}')}; the untrained model's L{l0} {n('fresh', f'prime input L{l0}')}. "
            + ("High: the key tells the facts apart, and the failure is in what one inner step stores. "
               if 2 * own["passed"] >= own["worlds"] else
               "Low: even an exact memory cannot separate a world's values with this key, so the address itself must "
               "change, not only the write. ") + "The context-scored pools: dot-product over the round "
            f"{n('trained', f'context pool (dot), round + window {w}')}, over the command "
            f"{n('trained', f'context pool (dot), command + window {w}')}, the model's own attention at p-1 "
            f"{n('trained', f'own attention (all heads) + window {w}')} (untrained: "
            f"{n('fresh', f'own attention (all heads) + window {w}')}). Best vector design: {best['model']} "
            f"\"{best['name']}\", {best['heldout']['passed']}/{best['heldout']['worlds']} held-out; the name oracle "
            f"{n('tokens', 'name (oracle)')}. Nearest key at a held-out readback's first value token (trained, L{l0}, "
            f"no window, among the earlier rounds' observation keys): "
            f"{res['nearest_source_heldout']['trained'][f'prime_L{l0}']}.")


def write_md(res: dict, path: pathlib.Path) -> None:
    pools = list(res["pools"])
    head = ["model", "design"] + [f"{p}: {c}" for p in pools for c in ("worlds", "readbacks", "first token", "by #keys")]
    same = all(r[p] == o[p] for r in res["designs"] for o in res["designs"] for p in pools
               if r["model"] != "tokens" and r["name"] == o["name"] and r["model"] == o["model"])
    lines = ["# The ceiling of the trained model's own memory key (nearest neighbour over hidden states)", "",
             f"`{res['command']}` at commit `{res['commit']}`; checkpoint `{res['checkpoint']}` (step {res['step']}); "
             f"runtime {res['wall_s']} s; load average at start {res['load_start']}, at end {res['load_end']}.", "",
             "Ideal memory of `benchmarks/memory_ceiling.py` (read a round's observation tokens with the earlier rounds'"
             " memory, then write them), keys from the model's hidden states at p-1, read by the largest cosine "
             f"(ties within {TIE_EPS}: the write rule). Designs: the script's docstring. Write rule overwrite; "
             + ("the first-write rule gives the same counts for every vector design (no two keys tie)"
                if same else "the first-write rule's counts are in the json") + ". \"tokens\": memory_ceiling.py's "
             "token-identity keys on the same worlds (rendered with the model's tokenizer).", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in (r for r in res["designs"] if r["write_rule"] == "overwrite"):
        cells = [r["model"], r["name"]]
        for p in pools:
            s = r[p]
            cells += [f"{s['passed']}/{s['worlds']}", f"{s['exact_readbacks']}/{s['readbacks']}",
                      f"{s['first_token']['correct']}/{s['first_token']['total']}",
                      ", ".join(f"{k}: {v['passed']}/{v['worlds']}" for k, v in s["by_num_keys"].items())]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## What it says", "", what_it_says(res), ""]
    path.write_text("\n".join(lines))


def trained_and_fresh(checkpoint: str):
    """The trained checkpoint, loaded read-only (`load_for_inference`; its policy must be current_round), and
    the control: a freshly initialised model of its config (seed 0). One thread."""
    from ds_ttt.loading import load_for_inference
    from ds_ttt.model.qwen3 import TTTQwen3ForCausalLM

    torch.set_num_threads(1)
    loaded = load_for_inference(checkpoint, hash_files=False)
    assert loaded.model.ttt.context_policy == "current_round", loaded.model.ttt.context_policy
    torch.manual_seed(0)
    fresh = TTTQwen3ForCausalLM(loaded.model.config, loaded.model.ttt).eval().requires_grad_(False)
    return loaded, fresh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(REPO / "runs" / "main" / "run"))
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--train-pool", type=int, default=32)
    ap.add_argument("--out", default=str(OUT / "memory_ceiling_context"))
    args = ap.parse_args()
    load_start = pathlib.Path("/proc/loadavg").read_text().split()[:3]
    t0 = time.time()
    loaded, fresh = trained_and_fresh(args.checkpoint)
    trained, tok = loaded.model, loaded.tokenizer
    window = trained.ttt.key_shift + 1
    tool_call_id = tok.convert_tokens_to_ids("<tool_call>")
    pools = scored_pools(tok, args.heldout, args.train_pool)
    rows, sources = [], {}
    res = {"command": " ".join(["benchmarks/memory_ceiling_context.py"] + sys.argv[1:]), "checkpoint": args.checkpoint,
           "step": loaded.provenance.get("step"), "window": window, "tie_eps": TIE_EPS,
           "adaptive_layers": [layer.layer_idx for layer in trained.adaptive_layers],
           "pools": {p: {"worlds": len(pools[p])} for p in pools}, "load_start": load_start,
           "nearest_source_heldout": sources, "designs": rows}
    for name, desc, fn in [(f"today (window {window})", "the window's token ids", make_key_fn(window)),
                           ("name (oracle)", "window + the names the command mentions", make_key_fn(window, "name"))]:
        for rule in ("overwrite", "first"):
            rows.append({"model": "tokens", "name": name, "key": desc, "write_rule": rule,
                         **{p: score_pool(pools[p], fn, write_rule=rule) for p in pools}})
    for label, model in (("trained", trained), ("fresh", fresh)):
        viewed = {p: with_views(pools[p], model, tool_call_id) for p in pools}
        print(label, "views", round(time.time() - t0, 1), "s", flush=True)
        sources[label] = {f"prime_L{i}": nearest_sources(viewed["heldout"], f"prime_L{i}") for i in res["adaptive_layers"]}
        for name, desc, fn in designs(model, window):
            for rule in ("overwrite", "first"):
                rows.append({"model": label, "name": name, "key": desc, "write_rule": rule,
                             **{p: score_pool(viewed[p], fn, write_rule=rule, make_memory=NearestMemory) for p in pools}})
                print(label, name, rule, {p: rows[-1][p]["passed"] for p in pools}, flush=True)
    res.update(commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip(), wall_s=round(time.time() - t0, 1),
               load_end=pathlib.Path("/proc/loadavg").read_text().split()[:3])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    write_md(res, out.with_suffix(".md"))
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
