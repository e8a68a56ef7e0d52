"""The report of benchmarks/memory_ceiling.py: what the table says in words, and the markdown file.

    from memory_ceiling_report import notes, write_md
    res["notes"] = notes(res)                      # res: the run's JSON (memory_ceiling.main)
    write_md(res, pathlib.Path("benchmarks/results/memory_ceiling.md"))

Run benchmarks/memory_ceiling.py, not this file; it imports these.
"""

from __future__ import annotations

import pathlib

from memory_ceiling_keys import LEARNED_POOL


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
