"""The ceiling of a fast-weight memory key: an ideal memory on the real memory worlds.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_ceiling.py [--heldout 128] [--train-pool 32] [--dev 64]

Writes benchmarks/results/memory_ceiling.{json,md}. Runs on CPU in about a minute (no model; the
worlds are generated in the sandbox as the evaluation generates them, and rendered with the real
tokenizer).

What it simulates. The prime MLP's input at a token is the memory's key: one inner step stores
"key -> the observation token that follows". An ideal memory stores that map exactly, so how well
it can do depends only on what the key can tell apart:
  - memory: a dict key -> next token, empty at the start of a world;
  - round by round, as the event loop runs (ds_ttt/model/event_loop.py): the round's observation
    tokens are first read with the memory as it stood before the round (the model scores them with
    W_{r-1}), then every observation token of the round is written at its key, in order. Write rule
    `overwrite` (the main one): a later write at a key replaces the earlier one, in this round or an
    earlier one (the delta rule at full rate). `first`, for comparison: a key keeps its first write
    (the rule under which today's key passes exactly the one-key worlds);
  - a readback (world meta `readbacks`) is exact when every observation token of its round is
    predicted exactly (a key never written predicts nothing: a miss);
  - a world passes when all its readbacks are exact. First-token accuracy counts the first token of
    each readback's value (`find_fact_tokens`).

The key of a label token at position p is built from the tokens before p, as the model's is: the
label at p is predicted at position p-1, whose prime input with `key_shift` = S is
x_{p-1} + sum_j a_j x_{p-1-j} (ds_ttt/model/fast_weights.py), i.e. a function of the S+1 tokens
p-1-S .. p-1. Like the model's shift, the window stops at the start of the round (the
`current_round` policy: no round's key sees an earlier round). Here "window n" means the n tokens
before p, so today's key (S = 3 in ds_configs/run_cpu_tiny.json) is window S+1 = 4. An ideal memory
sees token identities only: the real key is a hidden state after attention, which could carry more
(the command), so this is the ceiling of the key as designed, not of what a model could learn
(memory_ceiling_context.py runs this memory with a real model's hidden states as keys).

Key designs:
  - today: the S+1 tokens before p (S from the main job's config);
  - round address, exact: today's key plus the tuple of the round's action tokens (think + call), or
    of its tokens from `<tool_call>` on (the command only, not the thought that also names the file);
  - round address, soft: today's key plus the set of the command's tokens; a read takes the entry at
    the same window whose command set overlaps most (a crude stand-in for a learned pool);
  - round address, name (an oracle): today's key plus the world's names that the command mentions;
  - round address, learned pool (ideal): the ceiling of the round address the model is gaining, a
    learned softmax pool over the prime inputs of the current round's tokens up to the label's key
    position p-1 (action, chat template and the observation so far; restarting at each round). The
    ideal learned score is modelled as a gate on token identity learned from data the evaluation
    never uses: the document frequency of every token id (the fraction of rounds, over the dev worlds
    below, in which it appears) is counted once, and the pool keeps the tokens of positions
    round_start..p-1 whose frequency is at most a threshold (rare tokens such as names and values;
    verbs, flags, the template and the JSON wrapper are gated out; a token never seen on the dev
    worlds has frequency 0 and is kept). Key = (today's window key, frozenset of the kept tokens).
    Read exactly (a dict lookup) or "nearest" (among the entries at the same window, the one whose
    kept set has the largest Jaccard overlap with the read's; ties the latest write), since a softmax
    pool is soft. The threshold is chosen per read from --gate-grid on the dev worlds alone (the most
    dev worlds passed with overwrite), and only then scored on the held-out and training pools;
  - novelty pool: a context-scored pool attention could compute, with no oracle on the round's type:
    key = (today's window key, frozenset of the current round's command tokens, from `<tool_call>` on,
    or of its action tokens, that occur in none of the compared rounds' tokens of the same scope),
    compared with every earlier round of the world ("vs all earlier") or with the previous round only
    ("vs previous"); plain, or intersected with the learned pool's rare tokens ("& rare", its own
    threshold chosen per variant and read on the dev worlds as above). Read exactly or by the nearest
    kept set, like the learned pool. A second readback (`sed -n 1p vault/maple.key`) keeps about its
    name's sub-tokens only against the readback before it; against every earlier round its name is
    never novel (the write used it);
  - window n, for n in --windows: the n tokens before p, within the round.

Measured (benchmarks/results/memory_ceiling.md): with overwrite, today's key passes 0/128 held-out
and 0/32 training-pool worlds (the distractor rounds overwrite the shared address); with first-write
0/128 and 8/32 (the one-key worlds). The name passes 128/128 and 32/32. The exact and soft round
addresses fail: the write's command (`bin/keygen cedar | tee vault/cedar.key`) is not the readback's
(`sed -n 1p vault/cedar.key`), and readback commands resemble each other more than their writes; a
learned address has to pick out the name. A 13-token window passes 128/128 held-out but 19/32
training-pool worlds; 16 and 32 tokens reach the command's verb and fail more. The ideal learned
pool (thresholds chosen on the dev worlds: 0.05 for the exact read, 0.2 for the nearest) read
exactly passes 0/128 and 2/32 (a held-out readback's kept set never equals its write's: its verb is
unseen on the dev worlds and kept); read by the nearest kept set 66/128 and 22/32, short of 95% on
both pools: where a world's readbacks share rare tokens (json's `cut -d'"' -f4`, grep's and ini's
one file), a readback's kept set is nearer the previous readback's than its own write's. The novelty
pool read by the nearest set, novel against the previous round, passes 128/128 held-out and 31/32
(command) or 32/32 (action) training-pool worlds, and 128/128 and 32/32 intersected with the rare
tokens (threshold 0.2, chosen on the dev worlds, 64/64 there); the one command failure is a first
readback whose write, the world's first round, keeps its whole command (nothing before it to compare),
so a later write sharing only `/` overlaps it more. Novel against every earlier round it passes 0/128
and 0/32 (8/32 with first-write and the rare gate): a readback's name is never novel, its write used
it. Read exactly, no novelty design passes a held-out world (training pool: at most 2/32 with
overwrite, 16/32 with first-write).

Why today's key fails: the tokens right before a value, `<tool_response>\n`, are the same
in every round, so every value of a world is written to and read from the same address; a world
with two keys or more can then never pass. Each key design is judged here by its ceiling before it
is trained.

Pools: the held-out worlds on the test seeds (`MEMORY_SEED_BASE + i`, the worlds the memory test
and the comparison score) and the training-pool worlds on the same seeds (`pool="train"`, as
`build_heldout_sets` in ds_ttt/evaluation/comparison.py builds `memory_worlds_train_pool`). The
learned pool's gate and threshold come from --dev (64) training-pool worlds on the gate's own dev
seeds, `MEMORY_SEED_BASE + 500_000 + i` (1_500_000 + i: the memory test and the comparison use
MEMORY_SEED_BASE + i and MEMORY_DEV_SEED_BASE = 2_000_000 + i, the unit tests small seeds, and the
generator's training trajectories another RNG namespace), which are never scored.

Files: this script (the worlds rendered, the run, its JSON), memory_ceiling_keys.py beside it (the ideal
memory and the key designs) and memory_ceiling_report.py (the notes and the markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from collections import Counter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # its helper modules, beside it in benchmarks/
from memory_ceiling_keys import (ACTION, OBSERVATION, choose_gate, choose_novelty, designs,  # noqa: E402
                                 document_frequency, gate_examples, round_actions, score_pool)
# tests/unit/test_memory_ceiling.py reaches these through this script
from memory_ceiling_keys import (make_key_fn, make_novel_key_fn, make_pool_key_fn, novel_sets,  # noqa: E402,F401
                                 round_starts, simulate_world, window_key)
from memory_ceiling_report import notes, write_md  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
GATE_DEV_SEED_OFFSET = 500_000  # the gate's dev worlds: MEMORY_SEED_BASE + 500_000 + i, a range nothing else uses


def render_pool(worlds: list[dict], tokenizer) -> list[dict]:
    """Render the worlds; per world the token ids, kinds, rounds, readbacks, number of keys, the value's
    first-token position per readback round and per source (write) round, and per round the world's
    names its command mentions, and how the world stores and reads a value (`store`)."""
    from ds_ttt.data.render import find_fact_tokens, render_trajectory

    tool_call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    out = []
    for w in worlds:
        r = render_trajectory(w, tokenizer)
        firsts, source_firsts = {}, {}
        for rb in w["meta"]["readbacks"]:
            pos = find_fact_tokens(r, tokenizer, rb["value"], rb["round"], OBSERVATION)
            if pos:
                firsts[rb["round"]] = pos[0]
            pos = find_fact_tokens(r, tokenizer, rb["value"], rb["source_round"], OBSERVATION)
            if pos:
                source_firsts[rb["source_round"]] = pos[0]
        names = sorted(w["meta"]["values"])
        commands = {k: tokenizer.decode(list(v)) for k, v in round_actions(r.input_ids, r.kinds, r.rounds,
                                                                           tool_call_id).items()}
        tags = {k: tuple(n for n in names if n in text) for k, text in commands.items()}
        out.append({"id": r.id, "seed": w["meta"].get("seed"), "num_keys": len(w["meta"]["values"]),
                    "store": w["meta"].get("memory_format", {}).get("store"),
                    "ids": r.input_ids, "kinds": r.kinds, "rounds": r.rounds,
                    "readbacks": w["meta"]["readbacks"], "firsts": firsts, "source_firsts": source_firsts,
                    "tags": tags})
    return out


def scored_pools(tokenizer, heldout: int, train_pool: int) -> dict[str, list[dict]]:
    """The two scored pools, rendered: the held-out worlds and the training-pool worlds on the test seeds."""
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.evaluation.memory import MEMORY_SEED_BASE

    return {"heldout": render_pool([generate_memory_world(MEMORY_SEED_BASE + i) for i in range(heldout)], tokenizer),
            "train_pool": render_pool([generate_memory_world(MEMORY_SEED_BASE + i, pool="train")
                                       for i in range(train_pool)], tokenizer)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--train-pool", type=int, default=32)
    ap.add_argument("--windows", type=int, nargs="+", default=[8, 9, 13, 16, 32])
    ap.add_argument("--dev", type=int, default=64, help="training-pool worlds on the gate's dev seeds")
    ap.add_argument("--gate-grid", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2])
    ap.add_argument("--config", default=str(REPO / "ds_configs" / "run_cpu_tiny.json"))
    ap.add_argument("--out", default=str(OUT / "memory_ceiling"))
    args = ap.parse_args()
    from ds_ttt.data.families import MEMORY_POOLS
    from ds_ttt.data.generator import generate_memory_world
    from ds_ttt.data.token_kind import TokenKind
    from ds_ttt.data.tokenizer import load_tokenizer
    from ds_ttt.evaluation.memory import MEMORY_SEED_BASE

    assert (TokenKind.OBSERVATION, TokenKind.ACTION) == (OBSERVATION, ACTION)
    load_start = os.getloadavg()
    t0 = time.time()
    key_shift = json.loads(pathlib.Path(args.config).read_text())["ttt"]["key_shift"]
    tok = load_tokenizer()
    tool_call_id = tok.convert_tokens_to_ids("<tool_call>")
    dev_base = MEMORY_SEED_BASE + GATE_DEV_SEED_OFFSET
    dev = render_pool([generate_memory_world(dev_base + i, pool="train") for i in range(args.dev)], tok)
    df, dev_rounds = document_frequency(dev)
    gate = choose_gate(dev, key_shift + 1, df, args.gate_grid)
    print("gate grid (dev):", [(r["threshold"], r["read"], r["write_rule"], f"{r['passed']}/{r['worlds']}")
                                for r in gate["grid"]], "chosen:", gate["chosen"], flush=True)
    novelty = choose_novelty(dev, key_shift + 1, df, args.gate_grid, tool_call_id)
    print("novelty & rare, chosen on dev:", {k: v["chosen"] for k, v in novelty.items()}, flush=True)
    pools = scored_pools(tok, args.heldout, args.train_pool)
    rows = []
    for name, desc, key_fn, read in designs(key_shift, args.windows, tool_call_id,
                                            {"df": df, "threshold": gate["chosen"]}, novelty):
        for rule in ("overwrite", "first"):
            rows.append({"name": name, "key": desc, "write_rule": rule, "read": read,
                         **{p: score_pool(pools[p], key_fn, read == "soft", rule, read == "nearest") for p in pools}})
            print(name, rule, {p: f"{rows[-1][p]['passed']}/{rows[-1][p]['worlds']}" for p in pools}, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    res = {"command": " ".join(["benchmarks/memory_ceiling.py"] + sys.argv[1:]), "commit": commit,
           "key_shift": key_shift, "config": pathlib.Path(args.config).name,
           "pools": {"heldout": {"worlds": args.heldout, "seeds": [MEMORY_SEED_BASE, MEMORY_SEED_BASE + args.heldout - 1],
                                 "num_keys": dict(Counter(str(w["num_keys"]) for w in pools["heldout"]))},
                     "train_pool": {"worlds": args.train_pool, "pool": "train",
                                    "seeds": [MEMORY_SEED_BASE, MEMORY_SEED_BASE + args.train_pool - 1],
                                    "num_keys": dict(Counter(str(w["num_keys"]) for w in pools["train_pool"]))},
                     "gate_dev": {"worlds": args.dev, "pool": "train", "seeds": [dev_base, dev_base + args.dev - 1],
                                  "num_keys": dict(Counter(str(w["num_keys"]) for w in dev)), "rounds": dev_rounds}},
           "gate": {**gate, "window": key_shift + 1, "vocab_seen": len(df),
                    "train_name_df": {n: [[tok.decode([t]), round(df.get(t, 0.0), 4)] for t in tok.encode(" " + n)]
                                      for n in MEMORY_POOLS["train"]["names"]},
                    "kept_most_frequent": {read: [[tok.decode([t]), round(f, 4)] for t, f in sorted(
                        ((t, f) for t, f in df.items() if f <= thr), key=lambda x: -x[1])[:20]]
                        for read, thr in gate["chosen"].items()},
                    "gated_least_frequent": {read: [[tok.decode([t]), round(f, 4)] for t, f in sorted(
                        ((t, f) for t, f in df.items() if f > thr), key=lambda x: x[1])[:20]]
                        for read, thr in gate["chosen"].items()},
                    "examples": {p: {"seed": pools[p][0]["seed"], **{read: gate_examples(
                        pools[p][0], key_shift + 1, df, thr, tok) for read, thr in gate["chosen"].items()}}
                        for p in pools}},
           "novelty_gate": novelty,
           "load_start": [round(x, 2) for x in load_start], "designs": rows}
    res["wall_s"] = round(time.time() - t0, 1)
    res["load_end"] = [round(x, 2) for x in os.getloadavg()]
    res["notes"] = notes(res)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    write_md(res, out.with_suffix(".md"))
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
