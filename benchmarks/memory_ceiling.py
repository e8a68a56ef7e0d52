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
(the command), so this is the ceiling of the key as designed, not of what a model could learn.

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
one file), a readback's kept set is nearer the previous readback's than its own write's.

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

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
OBSERVATION, ACTION = 2, 1  # ds_ttt.data.token_kind.TokenKind values (checked in main)
GATE_DEV_SEED_OFFSET = 500_000  # the gate's dev worlds: MEMORY_SEED_BASE + 500_000 + i, a range nothing else uses


def window_key(ids: list[int], rounds: list[int], p: int, n: int) -> tuple[int, ...]:
    """The (up to) n token ids before position p, stopping at the start of p's round."""
    start = max(p - n, 0)
    while start < p and rounds[start] != rounds[p]:
        start += 1
    return tuple(ids[start:p])


def round_actions(ids: list[int], kinds: list[int], rounds: list[int], from_token: int | None = None) -> dict:
    """Round id -> tuple of the round's action token ids (from the first `from_token` on, when given)."""
    out: dict[int, list[int]] = {}
    for t, k, r in zip(ids, kinds, rounds):
        if k == ACTION:
            out.setdefault(r, []).append(t)
    if from_token is not None:
        out = {r: a[a.index(from_token):] if from_token in a else a for r, a in out.items()}
    return {r: tuple(a) for r, a in out.items()}


def make_key_fn(window: int, address: str | None = None, from_token: int | None = None):
    """A key function (ids, kinds, rounds, tags) -> (p -> key): the window, plus a round address:
    "action" / "command" the exact tuple of the round's action tokens (from `from_token` on for
    "command"), "name" the round's tag (the world's names its command mentions)."""
    def build(ids, kinds, rounds, tags=None):
        if address == "name":
            return lambda p: (window_key(ids, rounds, p, window), (tags or {}).get(rounds[p], ()))
        if address:
            acts = round_actions(ids, kinds, rounds, from_token)
            return lambda p: (window_key(ids, rounds, p, window), acts.get(rounds[p], ()))
        return lambda p: window_key(ids, rounds, p, window)
    return build


def round_starts(rounds: list[int]) -> list[int]:
    """Position -> the first position of its round (rounds are contiguous)."""
    out, start = [], 0
    for p, r in enumerate(rounds):
        if p and r != rounds[p - 1]:
            start = p
        out.append(start)
    return out


def document_frequency(pool: list[dict]) -> tuple[dict[int, float], int]:
    """Token id -> the fraction of rounds (every round of every world of `pool`, the prompt's round 0
    included) in which the token appears at least once; and the number of rounds."""
    counts: Counter = Counter()
    num_rounds = 0
    for w in pool:
        per_round: dict[int, set[int]] = {}
        for t, r in zip(w["ids"], w["rounds"]):
            per_round.setdefault(r, set()).add(t)
        num_rounds += len(per_round)
        for toks in per_round.values():
            counts.update(toks)
    return {t: c / max(num_rounds, 1) for t, c in counts.items()}, num_rounds


def make_pool_key_fn(window: int, df: dict[int, float], threshold: float):
    """The ideal learned round address: a key function (ids, kinds, rounds, tags) -> (p -> key) with key =
    (the window's key, frozenset of the ids at positions round_start..p-1 whose document frequency `df`
    is <= `threshold`). A token absent from `df` (never seen in the worlds it was counted on) has
    frequency 0 and is kept."""
    def build(ids, kinds, rounds, tags=None):
        starts = round_starts(rounds)
        keep = [df.get(t, 0.0) <= threshold for t in ids]

        def key(p):
            return (window_key(ids, rounds, p, window),
                    frozenset(ids[i] for i in range(starts[p], p) if keep[i]))
        return key
    return build


def simulate_world(ids: list[int], kinds: list[int], rounds: list[int], readbacks: list[dict], key_fn,
                   first_positions: dict[int, int] | None = None, tags: dict | None = None,
                   soft: bool = False, write_rule: str = "overwrite", nearest: bool = False) -> dict:
    """Ideal memory on one rendered world. readbacks: [{"round": r, ...}]; first_positions: round -> the
    position of the value's first token (for first-token accuracy); tags: round -> what the "name"
    address sees. With `soft` the key is (window, set of command tokens) and a read takes, among the
    entries at the same window, the one whose command set overlaps most (Jaccard over the tokens not
    shared by every command of the world, i.e. without the JSON wrapper; ties: the latest write), a
    crude stand-in for a learned pool over the command. With `nearest` the key is (window, set) as
    `key_fn` gives it, read the same way but over the whole set (nothing dropped). Jaccard of two equal
    sets is 1 (two empty ones included). write_rule "overwrite" (a later write at a key
    replaces the earlier one, the delta rule at full rate) or "first" (a key keeps its first write).
    Returns per-readback exactness."""
    key_of = key_fn(ids, kinds, rounds, tags)
    memory: dict = {}
    by_round: dict[int, list[int]] = {}
    for p, (k, r) in enumerate(zip(kinds, rounds)):
        if k == OBSERVATION and p > 0:
            by_round.setdefault(r, []).append(p)
    readback_rounds = {rb["round"] for rb in readbacks}
    exact: dict[int, bool] = {}
    first_ok: dict[int, bool] = {}

    bag = soft or nearest

    def read(key):
        if not bag:
            return memory.get(key)
        win, cmd = key
        best, best_sim = None, -1.0
        for (cmd2, tok) in memory.get(win, {}).items():  # insertion order = write order (overwrite moves to end)
            sim = 1.0 if cmd == cmd2 else len(cmd & cmd2) / max(len(cmd | cmd2), 1)
            if sim >= best_sim:
                best, best_sim = tok, sim
        return best

    def write(key, tok):
        if not bag:
            if write_rule == "overwrite" or key not in memory:
                memory[key] = tok
            return
        win, cmd = key
        slot = memory.setdefault(win, {})
        if write_rule == "overwrite" or cmd not in slot:
            slot.pop(cmd, None)
            slot[cmd] = tok

    common = None
    if soft:  # the tokens every command of the world shares (the tool-call wrapper) say nothing
        sets = [frozenset(key_of(ps[0])[1]) for ps in by_round.values()]
        common = frozenset.intersection(*sets) if sets else frozenset()
    for r in sorted(by_round):
        positions = by_round[r]
        keys = [key_of(p) for p in positions]
        if soft:
            keys = [(k[0], frozenset(k[1]) - common) for k in keys]
        if r in readback_rounds:  # read with the memory of the rounds before (W_{r-1})
            pred = {p: read(key) for p, key in zip(positions, keys)}
            exact[r] = all(pred[p] == ids[p] for p in positions)
            fp = (first_positions or {}).get(r)
            if fp is not None:
                first_ok[r] = pred.get(fp) == ids[fp]
        for p, key in zip(positions, keys):  # then write the round's labels (later writes overwrite)
            write(key, ids[p])
    rows = [{"round": rb["round"], "exact": exact.get(rb["round"], False),
             "first_token": first_ok.get(rb["round"])} for rb in readbacks]
    return {"readbacks": rows, "passed": bool(rows) and all(x["exact"] for x in rows)}


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


def score_pool(pool: list[dict], key_fn, soft: bool = False, write_rule: str = "overwrite",
               nearest: bool = False) -> dict:
    worlds = [simulate_world(w["ids"], w["kinds"], w["rounds"], w["readbacks"], key_fn, w["firsts"], w["tags"], soft,
                             write_rule, nearest)
              for w in pool]
    rbs = [x for s in worlds for x in s["readbacks"]]
    firsts = [x["first_token"] for x in rbs if x["first_token"] is not None]
    by_keys: dict[int, dict] = {}
    by_store: dict[str, dict] = {}
    for w, s in zip(pool, worlds):
        for d in (by_keys.setdefault(w["num_keys"], {"worlds": 0, "passed": 0}),
                  by_store.setdefault(str(w.get("store")), {"worlds": 0, "passed": 0})):
            d["worlds"] += 1
            d["passed"] += int(s["passed"])
    return {"worlds": len(pool), "passed": sum(s["passed"] for s in worlds),
            "readbacks": len(rbs), "exact_readbacks": sum(x["exact"] for x in rbs),
            "first_token": {"correct": sum(firsts), "total": len(firsts)},
            "by_num_keys": {str(k): by_keys[k] for k in sorted(by_keys)},
            "by_store": {k: by_store[k] for k in sorted(by_store)},
            "passed_seeds": [w["seed"] for w, s in zip(pool, worlds) if s["passed"]]}


LEARNED_POOL = "round address: learned pool (ideal)"


def designs(key_shift: int, windows: list[int], tool_call_id: int,
            gate: dict | None = None) -> list[tuple[str, str, object, str]]:
    """(name, key description, key function, read) for every key design; read is "exact" (a dict lookup),
    "soft" (the command bag: largest overlap, the world's common tokens dropped) or "nearest" (largest
    overlap of the key's set). gate: {"df": token id -> document frequency, "threshold": {"exact": t,
    "nearest": t}} adds the ideal learned pool, read both ways."""
    today = key_shift + 1
    out = [(f"today (key_shift {key_shift}: window {today})", f"the {today} tokens before the label, within the round",
            make_key_fn(today), "exact"),
           ("round address: action, exact", f"window {today} + the tuple of the round's action tokens (think + call)",
            make_key_fn(today, "action"), "exact"),
           ("round address: command, exact", f"window {today} + the tuple of the round's tokens from <tool_call> on",
            make_key_fn(today, "command", tool_call_id), "exact"),
           ("round address: command, soft", f"window {today} + the set of the round's tokens from <tool_call> on, "
            "read by the largest overlap (Jaccard) among entries at the same window",
            make_key_fn(today, "command", tool_call_id), "soft"),
           ("round address: name (oracle)", f"window {today} + the world's names that the round's command mentions",
            make_key_fn(today, "name"), "exact")]
    if gate:
        for read, how in (("exact", "read exactly"),
                          ("nearest", "read by the largest overlap (Jaccard) of kept sets among entries at the same "
                                      "window, ties to the latest write")):
            t = gate["threshold"][read]
            out.append((f"{LEARNED_POOL}, {read}",
                        f"window {today} + the set of the round's tokens before the label (all kinds, from the round's "
                        f"start) whose document frequency on the dev worlds is <= {t}, {how}",
                        make_pool_key_fn(today, gate["df"], t), read))
    out += [(f"window {n}", f"the {n} tokens before the label, within the round", make_key_fn(n), "exact")
            for n in windows]
    return out


def choose_gate(dev: list[dict], window: int, df: dict[int, float], grid: list[float]) -> dict:
    """Score the ideal learned pool on the dev worlds for each threshold of `grid`, both reads and both
    write rules; per read, choose the threshold with the most dev worlds passed under overwrite (then the
    most exact readbacks, then the smaller threshold)."""
    rows = []
    for t in grid:
        fn = make_pool_key_fn(window, df, t)
        for read in ("exact", "nearest"):
            for rule in ("overwrite", "first"):
                sc = score_pool(dev, fn, False, rule, read == "nearest")
                rows.append({"threshold": t, "read": read, "write_rule": rule, "passed": sc["passed"],
                             "worlds": sc["worlds"], "exact_readbacks": sc["exact_readbacks"],
                             "readbacks": sc["readbacks"],
                             "kept_vocab": sum(1 for f in df.values() if f <= t)})
    chosen = {}
    for read in ("exact", "nearest"):
        cand = [r for r in rows if r["read"] == read and r["write_rule"] == "overwrite"]
        chosen[read] = max(cand, key=lambda r: (r["passed"], r["exact_readbacks"], -r["threshold"]))["threshold"]
    return {"grid": rows, "chosen": chosen,
            "criterion": "per read, the most dev worlds passed with overwrite, then the most exact readbacks, "
                         "then the smaller threshold"}


def gate_examples(world: dict, window: int, df: dict[int, float], threshold: float, tokenizer) -> list[dict]:
    """The kept sets at the value's first token in each readback's source (write) round and in the readback
    round, decoded (a token never seen on the dev worlds is kept)."""
    key_of = make_pool_key_fn(window, df, threshold)(world["ids"], world["kinds"], world["rounds"])
    out = []
    for rb in world["readbacks"]:
        row = {"source_round": rb["source_round"], "round": rb["round"]}
        for name, pos in (("write", world["source_firsts"].get(rb["source_round"])),
                          ("read", world["firsts"].get(rb["round"]))):
            row[name] = None if pos is None else sorted(tokenizer.decode([t]) for t in key_of(pos)[1])
        out.append(row)
    return out


def notes(res: dict) -> list[str]:
    """What the table says, in words, with the measured numbers."""
    def cell(prefix, rule, pool):
        d = next(d for d in res["designs"] if d["name"].startswith(prefix) and d["write_rule"] == rule)[pool]
        return f"{d['passed']}/{d['worlds']}"

    ones = res["designs"][0]["train_pool"]["by_num_keys"].get("1", {"worlds": 0})["worlds"]
    return [
        f"Today's key (window {res['key_shift'] + 1}) passes {cell('today', 'overwrite', 'heldout')} held-out and "
        f"{cell('today', 'overwrite', 'train_pool')} training-pool worlds when later writes overwrite: the tokens before "
        "every observation's first token (`user\\n<tool_response>\\n`) are one address, and the distractor rounds "
        "(`ls`, `wc`, `cat`) write their own output there after the value. When a key keeps its first write it passes "
        f"{cell('today', 'first', 'heldout')} and {cell('today', 'first', 'train_pool')}: exactly the {ones} "
        "one-key worlds of the training pool; a second key's value lands on the same address.",
        f"The name in the key (an oracle: the world's names that the round's command mentions) passes "
        f"{cell('round address: name', 'overwrite', 'heldout')} and {cell('round address: name', 'overwrite', 'train_pool')} "
        "under either write rule. This is the target a round address must learn to extract.",
        "A round address taken verbatim (the exact tuple of the round's action or command tokens) passes "
        f"{cell('round address: command, exact', 'overwrite', 'heldout')} and "
        f"{cell('round address: command, exact', 'overwrite', 'train_pool')}: the value is written in a round whose "
        "command (`bin/keygen cedar | tee vault/cedar.key`) differs from the readback's (`sed -n 1p vault/cedar.key`), "
        "so the read address never equals the write address. A bag of the command's tokens read by the largest overlap "
        f"passes {cell('round address: command, soft', 'overwrite', 'heldout')} and "
        f"{cell('round address: command, soft', 'overwrite', 'train_pool')}: two readback commands resemble each other "
        "(same verb, same flags) more than a readback resembles its write. The address must weigh the name, not the "
        "whole command: a learned pool has to learn that.",
        f"Plain windows: 13 tokens pass {cell('window 13', 'overwrite', 'heldout')} held-out (the `sed` and JSON readback "
        "commands end in the file's path, which then sits inside the window, as does the write's `tee vault/<name>.key`) "
        f"but {cell('window 13', 'overwrite', 'train_pool')} of the training pool (`grep`, ini). Longer windows reach "
        f"further into the command, whose start differs between the write and the readback: 16 tokens {cell('window 16', 'overwrite', 'heldout')} and "
        f"{cell('window 16', 'overwrite', 'train_pool')}, 32 tokens {cell('window 32', 'overwrite', 'heldout')} and "
        f"{cell('window 32', 'overwrite', 'train_pool')}. Shorter ones (8, 9 = the largest allowed shift + 1) see only "
        "the response header and behave like today's key.",
        *gate_notes(res),
        "An ideal memory sees token identities only. The model's key is a hidden state after attention, which sees the "
        "command under the `current_round` policy; so this is the ceiling of what the key is built from, not of what "
        "a trained model could route into it.",
    ]


def gate_notes(res: dict) -> list[str]:
    """The notes on the ideal learned pool (none when the run has no gate)."""
    if "gate" not in res:
        return []
    g, dev = res["gate"], res["pools"]["gate_dev"]

    def row(read, rule):
        return next(d for d in res["designs"] if d["name"] == f"{LEARNED_POOL}, {read}" and d["write_rule"] == rule)

    def cell(read, rule, pool):
        s = row(read, rule)[pool]
        return f"{s['passed']}/{s['worlds']}"

    def ok(read):
        return all(row(read, rule)[pool]["passed"] >= 0.95 * row(read, rule)[pool]["worlds"]
                   for rule in ("overwrite", "first") for pool in ("heldout", "train_pool"))

    def dev_cells(read):
        return ", ".join(f"{r['threshold']}: {r['passed']}/{r['worlds']}" for r in g["grid"]
                         if r["read"] == read and r["write_rule"] == "overwrite")

    def stores(read, pool):
        bs = row(read, "overwrite")[pool]["by_store"]
        return ", ".join(f"{k} {v['passed']}/{v['worlds']}" for k, v in bs.items())

    reached = [read for read in ("exact", "nearest") if ok(read)]
    names = [x for pieces in g["train_name_df"].values() for x in pieces]
    lo, hi = min(f for _, f in names), max(f for _, f in names)
    name_set = set(g["train_name_df"])
    alike = [t for t, f in g["kept_most_frequent"]["nearest"]
             if lo <= f <= hi and t.strip().isalpha() and len(t.strip()) > 1
             and not any(n in t or t.strip() in n for n in name_set)][:6]
    ex = row("exact", "overwrite")["heldout"]
    out = [
        f"The ideal learned pool (the ceiling of the round address as a learned softmax pool; see the docstring): "
        f"today's window plus the round's tokens before the label whose document frequency over the {dev['rounds']} "
        f"rounds of {dev['worlds']} dev worlds (training pool, seeds {dev['seeds'][0]}..{dev['seeds'][1]}, used by "
        "nothing else) is at most a threshold; a token never seen there is kept. The threshold is chosen on the dev "
        f"worlds alone, per read (dev worlds passed with overwrite: exact {dev_cells('exact')}; nearest "
        f"{dev_cells('nearest')}): {g['chosen']['exact']} for the exact read, {g['chosen']['nearest']} for the nearest. "
        f"Read exactly it passes {cell('exact', 'overwrite', 'heldout')} held-out and "
        f"{cell('exact', 'overwrite', 'train_pool')} training-pool worlds with overwrite "
        f"({cell('exact', 'first', 'heldout')} and {cell('exact', 'first', 'train_pool')} with first-write); read by "
        f"the nearest kept set {cell('nearest', 'overwrite', 'heldout')} and {cell('nearest', 'overwrite', 'train_pool')} "
        f"({cell('nearest', 'first', 'heldout')} and {cell('nearest', 'first', 'train_pool')}). The target, >= 95% of "
        "the worlds on both pools, is "
        + (f"reached ({' and '.join(reached)} read)." if reached else "not reached by either read.")]
    if len(reached) == 2:
        return out
    return out + [
        f"Where the learned pool fails (nearest, overwrite, by store: held-out {stores('nearest', 'heldout')}; "
        f"training pool {stores('nearest', 'train_pool')}): when a world's readbacks share rare tokens the gate "
        "keeps (json's `cut -d'\"' -f4 vault/<name>.json`, grep's and ini's one `vault/keys.*` file and their "
        "`cut`/`grep`/`awk`), a readback's kept set overlaps the previous readback's more than its own write's, "
        "which also carries the generating command (`printf`, `echo`, `>>`); the read returns the earlier key's "
        "value. Read exactly, a readback's kept set must equal its write's, and on the held-out pool it "
        + ("never does" if ex["exact_readbacks"] == 0 else "seldom does")
        + f" ({ex['exact_readbacks']}/{ex['readbacks']} exact readbacks): its verb (`sed -n 1p`, `cut`) never "
        "occurs on the dev worlds and is kept. The training "
        f"pool's names have a document frequency of {lo:.2f}-{hi:.2f} on the dev worlds (` alpha` .. ` theta`), "
        + ("above the exact read's threshold, which drops them; " if lo > g["chosen"]["exact"] else "")
        + "frequency alone does not set them apart from the commands' and thoughts' tokens in the same range"
        + (" (" + ", ".join(f"`{t.strip()}`" for t in alike) + ")." if alike else "."),
    ]


def write_md(res: dict, path: pathlib.Path) -> None:
    lines = ["# Memory ceiling: an ideal memory for each key design", "",
             f"`{res['command']}` at commit {res['commit']}; load {res['load_start'][0]:.2f} at the start and "
             f"{res['load_end'][0]:.2f} at the end (1-minute averages); {res['wall_s']:.0f} s.", "",
             f"Pools: held-out = `generate_memory_world(MEMORY_SEED_BASE + i)`, i < {res['pools']['heldout']['worlds']} "
             f"(seeds {res['pools']['heldout']['seeds'][0]}..{res['pools']['heldout']['seeds'][1]}); training pool = "
             f"`generate_memory_world(MEMORY_SEED_BASE + i, pool=\"train\")`, i < {res['pools']['train_pool']['worlds']}. "
             f"Today's key_shift = {res['key_shift']} (ds_configs/run_cpu_tiny.json), i.e. a window of "
             f"{res['key_shift'] + 1} tokens."
             + (f" The learned pool's gate is learned and its threshold chosen on {res['pools']['gate_dev']['worlds']} "
                f"dev worlds: `generate_memory_world(MEMORY_SEED_BASE + 500_000 + i, pool=\"train\")` (seeds "
                f"{res['pools']['gate_dev']['seeds'][0]}..{res['pools']['gate_dev']['seeds'][1]}), never scored below."
                if "gate_dev" in res["pools"] else ""), "",
             "| design | write rule | pool | worlds passed | exact readbacks | first-token acc | passed by #keys (1 / 2 / 3 / 4) |",
             "|---|---|---|---|---|---|---|"]
    for d in res["designs"]:
        for pool in ("heldout", "train_pool"):
            s = d[pool]
            bk = " / ".join(f"{s['by_num_keys'][k]['passed']}/{s['by_num_keys'][k]['worlds']}"
                            if k in s["by_num_keys"] else "-" for k in ("1", "2", "3", "4"))
            ft = s["first_token"]
            lines.append(f"| {d['name']} | {d['write_rule']} | {pool} | {s['passed']}/{s['worlds']} | {s['exact_readbacks']}/{s['readbacks']} "
                         f"| {ft['correct']}/{ft['total']} | {bk} |")
    if "gate" in res:
        g = res["gate"]
        lines += ["", "## The learned pool's threshold, chosen on the dev worlds", "",
                  f"Document frequency = the fraction of the {res['pools']['gate_dev']['rounds']} rounds of the dev "
                  f"worlds in which a token appears ({g['vocab_seen']} token ids occur there); the pool keeps the "
                  "tokens at or under the threshold, and every token never seen there. Chosen: "
                  f"{g['chosen']['exact']} (exact read), {g['chosen']['nearest']} (nearest read); {g['criterion']}.", "",
                  "| threshold | seen token ids kept | read | dev passed, overwrite | dev passed, first | "
                  "exact readbacks, overwrite |", "|---|---|---|---|---|---|"]
        for t in sorted({r["threshold"] for r in g["grid"]}):
            for read in ("exact", "nearest"):
                ow, fi = (next(r for r in g["grid"] if r["threshold"] == t and r["read"] == read and r["write_rule"] == w)
                          for w in ("overwrite", "first"))
                lines.append(f"| {t} | {ow['kept_vocab']} | {read} | {ow['passed']}/{ow['worlds']} | "
                             f"{fi['passed']}/{fi['worlds']} | {ow['exact_readbacks']}/{ow['readbacks']} |")
    lines += ["", "## What it means", ""] + [f"- {x}" for x in res["notes"]] + [
        "", "## Key designs", ""] + [f"- {d['name']}: {d['key']}" for d in res["designs"] if d["write_rule"] == "overwrite"] + [
        "", "## How it is simulated", "",
        "An ideal memory (a dict key -> next token) reads a round's observation tokens with the memory of the "
        "earlier rounds, then writes every observation label of the round at its key (by the write rule below). "
        "The key of the label at position p is built from the tokens before p (the model predicts p at p-1, whose "
        "shifted prime input covers positions p-1-S..p-1), and stops at the start of the round like the model's "
        "shift under the `current_round` policy. A readback is exact when every observation token of its round is "
        "predicted; a world passes when all its readbacks are exact. Write rule `overwrite`: a later write at a key "
        "replaces the earlier one (the delta rule at full rate); `first`: a key keeps its first write. See the docstring of "
        "`benchmarks/memory_ceiling.py`.", ""]
    path.write_text("\n".join(lines))


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
    pools = {"heldout": render_pool([generate_memory_world(MEMORY_SEED_BASE + i) for i in range(args.heldout)], tok),
             "train_pool": render_pool([generate_memory_world(MEMORY_SEED_BASE + i, pool="train")
                                        for i in range(args.train_pool)], tok)}
    rows = []
    for name, desc, key_fn, read in designs(key_shift, args.windows, tool_call_id,
                                            {"df": df, "threshold": gate["chosen"]}):
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
