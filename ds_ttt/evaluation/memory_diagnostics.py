"""Diagnostics of the fast-weight memory on memory worlds: where a readback fails, not only whether.

    from ds_ttt.evaluation.memory_diagnostics import readback_sites, world_diagnostics, addressing_margins
    sites = readback_sites(world, rendered, tokenizer)        # per readback: the read and write positions
    diag = world_diagnostics(worlds, sites, records, passed)  # first-token accuracy, worlds by #keys, ids
    margin = addressing_margins(model, rendered, sites)       # cosine of the memory key, own vs other write

Used by every memory report: the fair comparison's rows (ds_ttt/evaluation/comparison.py, the main
job) and the memory test (ds_ttt/evaluation/memory.py).

  first-token accuracy  the first token of each readback's value predicted exactly (greedy, given the
                        real history): a readback can miss on its first token (the address picked the
                        wrong value) or later (the value was stored but not all of it);
  worlds by #keys       worlds passed, counted by their number of keys (1-4): today's key passes the
                        one-key worlds and no other, so this separates addressing from storing;
  passed ids            the ids of the worlds that passed (so two runs can be compared world by world);
  addressing margin     at each readback of a world with two keys or more, the cosine of the memory key
                        (the prime MLP's input, fast_weights.PrimeMLP.key) at the position that
                        predicts the value's first token with the key at the same position of its own
                        write (the round that showed the value), minus the largest cosine with another
                        key's write. > 0: the read is closer to its own write than to any other; a
                        key that carries no name gives ~0 (every value at one address). Per adaptive
                        layer, from one whole-sequence pass with W_0 (the key of the first adaptive
                        layer never depends on the fast weights; the later layers' would move a little
                        with the updates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_ttt.data.token_kind import TokenKind
from ds_ttt.evaluation.intervals import wilson_interval

MAX_KEYS_REPORTED = 4  # memory worlds have 1-4 keys (the training pool) or 2 (the held-out pool)


@dataclass(frozen=True)
class ReadbackSite:
    """One readback of a world: the label position that predicts its value's first token (p - 1), that
    token, and the same for the write of this key and of every other key of the world."""

    round: int
    read: int  # position predicting the value's first token in the readback round
    first_token: int  # the value's first token id
    write: int  # position predicting the value's first token in the round that showed it
    other_writes: tuple[int, ...]  # the same for the world's other keys


def _first_value_position(rendered, tokenizer, value: str, round_: int) -> int | None:
    from ds_ttt.data.render import find_fact_tokens

    pos = find_fact_tokens(rendered, tokenizer, value, round_, TokenKind.OBSERVATION)
    return pos[0] if pos else None


def readback_sites(world: dict, rendered, tokenizer) -> list[ReadbackSite | None]:
    """Per readback of `world` (meta `readbacks`, each with its `source_round`), its site; None where the
    value is not found in the readback's or the source's observation (never in generated worlds)."""
    rbs = world["meta"]["readbacks"]
    writes = {}
    for rb in rbs:
        p = _first_value_position(rendered, tokenizer, rb["value"], rb["source_round"])
        writes[rb["value"]] = None if p is None else p - 1
    out = []
    for rb in rbs:
        p = _first_value_position(rendered, tokenizer, rb["value"], rb["round"])
        w = writes[rb["value"]]
        if p is None or w is None:
            out.append(None)
            continue
        others = tuple(v for k, v in writes.items() if k != rb["value"] and v is not None)
        out.append(ReadbackSite(round=rb["round"], read=p - 1, first_token=rendered.input_ids[p], write=w,
                                other_writes=others))
    return out


def first_token_hits(sites: list[ReadbackSite | None], records) -> list[bool]:
    """Was each readback's first value token the greedy prediction? (records: the world's EventRecords)"""
    pred = {}
    for rec in records:
        for p, a in zip(rec.label_positions.tolist(), rec.argmax.tolist()):
            pred[p] = a
    return [s is not None and pred.get(s.read) == s.first_token for s in sites]


def world_diagnostics(worlds: list[dict], sites: list[list], records: list[list], passed: list[bool]) -> dict:
    """First-token accuracy (Wilson interval), worlds passed by number of keys, the passed worlds' ids."""
    hits = [h for s, r in zip(sites, records) for h in first_token_hits(s, r)]
    k, n = sum(hits), len(hits)
    lo, hi = wilson_interval(k, n)
    by_keys: dict[str, list[int]] = {}
    for w, ok in zip(worlds, passed):
        nk = len(w["meta"]["values"])
        cell = by_keys.setdefault(str(min(nk, MAX_KEYS_REPORTED)), [0, 0])
        cell[0] += int(ok)
        cell[1] += 1
    multi = [ok for w, ok in zip(worlds, passed) if len(w["meta"]["values"]) >= 2]
    return {"first_token": k / n if n else None, "first_token_lo": lo, "first_token_hi": hi,
            "first_token_count": [k, n],
            "by_num_keys": dict(sorted(by_keys.items())),
            "multi_key_passed": [sum(multi), len(multi)],
            "passed_ids": [w["id"] for w, ok in zip(worlds, passed) if ok]}


def prime_inputs(model, rendered) -> list[torch.Tensor]:
    """The memory key (each adaptive layer's prime-MLP input) at every position: [T, C] per layer, from one
    whole-sequence pass with W_0 under the model's context policy."""
    got: list[torch.Tensor] = []
    hooks = [layer.prime_mlp.register_forward_pre_hook(lambda _m, args: got.append(args[0][0].detach().float()))
             for layer in model.adaptive_layers]
    try:
        ids = torch.tensor([rendered.input_ids])
        rounds = torch.tensor([rendered.rounds])
        with torch.no_grad():
            model(ids, rounds)
    finally:
        for h in hooks:
            h.remove()
    return got


def addressing_margins(model, rendered_worlds: list, sites: list[list]) -> dict:
    """Per adaptive layer: the mean addressing margin over the readbacks of worlds with two keys or more,
    the share of them above zero, and the mean own / other cosines (module docstring)."""
    layers = model.adaptive_layers
    rows: list[list[tuple[float, float]]] = [[] for _ in layers]
    for rendered, world_sites in zip(rendered_worlds, sites):
        usable = [s for s in world_sites if s is not None and s.other_writes]
        if not usable:
            continue
        keys = prime_inputs(model, rendered)
        for li, u in enumerate(keys):
            unit = torch.nn.functional.normalize(u, dim=-1)
            for s in usable:
                own = float(unit[s.read] @ unit[s.write])
                other = max(float(unit[s.read] @ unit[o]) for o in s.other_writes)
                rows[li].append((own, other))
    out = {}
    for layer, pairs in zip(layers, rows):
        n = len(pairs)
        margins = [a - b for a, b in pairs]
        out[str(layer.layer_idx)] = {
            "readbacks": n, "margin": sum(margins) / n if n else None,
            "above_zero": [sum(m > 0 for m in margins), n],
            "cos_own": sum(a for a, _ in pairs) / n if n else None,
            "cos_other": sum(b for _, b in pairs) / n if n else None}
    return out
