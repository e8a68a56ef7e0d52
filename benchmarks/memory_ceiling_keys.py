"""The ideal memory of benchmarks/memory_ceiling.py and the key designs it is run with.

    from memory_ceiling_keys import make_key_fn, score_pool, simulate_world
    simulate_world(ids, kinds, rounds, readbacks, make_key_fn(4))   # {"readbacks": [...], "passed": bool}
    score_pool(pool, make_key_fn(4, "name"))                        # the counts of a rendered pool

What is simulated, and why each key design: the docstring of benchmarks/memory_ceiling.py, which imports
these (run it, not this file). A key function (ids, kinds, rounds, tags) -> (p -> key) builds the key of
the label at position p from the tokens before p; the ideal memory reads a round's observation tokens
with the memory of the earlier rounds, then writes them at their keys.
"""

from __future__ import annotations

from collections import Counter

OBSERVATION, ACTION = 2, 1  # ds_ttt.data.token_kind.TokenKind values (checked in memory_ceiling.main)


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


def novel_sets(ids: list[int], kinds: list[int], rounds: list[int], from_token: int | None = None,
               lookback: int | None = None) -> dict[int, frozenset]:
    """Round id -> the set of the round's action tokens (from the first `from_token` on, when given, as
    round_actions cuts them) that occur in none of the `lookback` rounds before it (None: every earlier
    round), compared with those rounds' tokens of the same scope. Rounds without action tokens (the
    prompt) are not compared against, and an earlier round counts whether it had action tokens or not."""
    acts = round_actions(ids, kinds, rounds, from_token)
    order = sorted(set(rounds))
    out = {}
    for i, r in enumerate(order):
        earlier = order[:i] if lookback is None else order[max(i - lookback, 0):i]
        seen = set().union(*(acts.get(e, ()) for e in earlier))
        out[r] = frozenset(t for t in acts.get(r, ()) if t not in seen)
    return out


def make_novel_key_fn(window: int, from_token: int | None = None, lookback: int | None = None,
                      df: dict[int, float] | None = None, threshold: float | None = None):
    """The novelty-scored pool: a key function (ids, kinds, rounds, tags) -> (p -> key) with key = (the
    window's key, frozenset of the tokens of p's round that novel_sets keeps), intersected, when `df` and
    `threshold` are given, with the tokens whose document frequency is <= threshold (make_pool_key_fn's
    gate: a token absent from `df` is kept)."""
    def build(ids, kinds, rounds, tags=None):
        novel = novel_sets(ids, kinds, rounds, from_token, lookback)
        if df is not None:
            novel = {r: frozenset(t for t in s if df.get(t, 0.0) <= threshold) for r, s in novel.items()}
        return lambda p: (window_key(ids, rounds, p, window), novel.get(rounds[p], frozenset()))
    return build


def simulate_world(ids: list[int], kinds: list[int], rounds: list[int], readbacks: list[dict], key_fn,
                   first_positions: dict[int, int] | None = None, tags: dict | None = None,
                   soft: bool = False, write_rule: str = "overwrite", nearest: bool = False,
                   make_memory=None) -> dict:
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

    if make_memory is not None:
        store = make_memory(write_rule)
        read, write = store.read, store.write
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


def score_pool(pool: list[dict], key_fn, soft: bool = False, write_rule: str = "overwrite",
               nearest: bool = False, make_memory=None) -> dict:
    worlds = [simulate_world(w["ids"], w["kinds"], w["rounds"], w["readbacks"], key_fn, w["firsts"], w["tags"], soft,
                             write_rule, nearest, make_memory)
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
NOVELTY_POOL = "novelty pool"
# (label, scope, lookback, what the round is compared with): the novelty-scored pool's variants
NOVELTY_VARIANTS = [("command vs all earlier", "command", None, "any earlier round"),
                    ("command vs previous", "command", 1, "the previous round"),
                    ("action vs all earlier", "action", None, "any earlier round"),
                    ("action vs previous", "action", 1, "the previous round")]


def designs(key_shift: int, windows: list[int], tool_call_id: int,
            gate: dict | None = None, novelty: dict | None = None) -> list[tuple[str, str, object, str]]:
    """(name, key description, key function, read) for every key design; read is "exact" (a dict lookup),
    "soft" (the command bag: largest overlap, the world's common tokens dropped) or "nearest" (largest
    overlap of the key's set). gate: {"df": token id -> document frequency, "threshold": {"exact": t,
    "nearest": t}} adds the ideal learned pool, read both ways. novelty: choose_novelty's answer (with
    gate's df) adds the novelty-scored pools of NOVELTY_VARIANTS, plain and intersected with the rare
    tokens, read both ways."""
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
    for label, scope, lookback, ref in NOVELTY_VARIANTS if novelty else ():
        from_token = tool_call_id if scope == "command" else None
        what = "tokens from <tool_call> on" if scope == "command" else "action tokens (think + call)"
        for read in ("exact", "nearest"):
            how = ("read exactly" if read == "exact"
                   else "read by the nearest kept set (Jaccard), ties to the latest write")
            out.append((f"{NOVELTY_POOL}: {label}, {read}", f"window {today} + the set of the round's {what} that "
                        f"do not occur in {ref}'s tokens of the same scope, {how}",
                        make_novel_key_fn(today, from_token, lookback), read))
            t = novelty[label]["chosen"][read]
            out.append((f"{NOVELTY_POOL}: {label} & rare, {read}", f"as `{label}`, keeping only the novel tokens whose "
                        f"document frequency on the dev worlds is <= {t} (chosen on the dev worlds), {how}",
                        make_novel_key_fn(today, from_token, lookback, gate["df"], t), read))
    out += [(f"window {n}", f"the {n} tokens before the label, within the round", make_key_fn(n), "exact")
            for n in windows]
    return out


def choose_gate(dev: list[dict], window: int, df: dict[int, float], grid: list[float], make=None) -> dict:
    """Score the ideal learned pool (or `make(t)`, a key function per threshold) on the dev worlds for each
    threshold of `grid`, both reads and both write rules; per read, choose the threshold with the most dev
    worlds passed under overwrite (then the most exact readbacks, then the smaller threshold)."""
    rows = []
    for t in grid:
        fn = make(t) if make else make_pool_key_fn(window, df, t)
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


def choose_novelty(dev: list[dict], window: int, df: dict[int, float], grid: list[float], tool_call_id: int) -> dict:
    """Per variant of NOVELTY_VARIANTS, choose_gate's answer for its novel tokens intersected with the rare
    ones, on the dev worlds alone."""
    return {label: choose_gate(dev, window, df, grid, lambda t, f=(tool_call_id if scope == "command" else None),
                               lb=lookback: make_novel_key_fn(window, f, lb, df, t))
            for label, scope, lookback, _ in NOVELTY_VARIANTS}


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
