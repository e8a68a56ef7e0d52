"""Per-round evaluation metrics from the event loop's records (`trajectory_loss(..., record=True)`).

For round r (its action, then the terminal output(s) that follow it), with the fast weights W_{r-1}
the model holds *before* learning round r's observation:

  action NLL / token accuracy   mean NLL and argmax accuracy over the action tokens (teacher forcing
                                on the real history);
  action exact match            every action token is the argmax given the real history and the real
                                earlier action tokens. Greedy decoding reproduces a token sequence
                                exactly iff every token is the argmax given its exact prefix, so this
                                equals "the action decoded greedily given the real history is exact";
  observation NLL before/after  mean NLL of the observation tokens with W_{r-1} and with W_r (after the
                                update on this very observation; ttt mode only);
  observation exact match       the terminal output predicted greedily from the command, *including*
                                the token that closes it (the first token after each observation span,
                                the `</tool_response>` wrapper), i.e. the world-model view "exact with end";
  memory facts                  (generator memory family, meta.memory_checks [{round, fact}]) the fact's
                                first occurrence in that round's action is reproduced exactly: every
                                action token overlapping its characters is the argmax.
  memory-check round            the round has at least one meta.memory_checks entry: its action must use
                                an earlier fact. Summaries give the action exact match of these rounds
                                (the WHOLE action, not only the fact) and their token-weighted action NLL;
  recovery round                the round is in meta.recovery_rounds (error_recovery family): the action
                                right after a failing command. Summaries give its token-weighted action NLL.
Aggregates are token-weighted for NLL/accuracy and round-weighted for exact matches. Every rate
carries a 95% Wilson interval (`<name>_lo`, `<name>_hi`) and every NLL a 95% bootstrap interval over
rounds (ds_ttt/evaluation/intervals.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ds_ttt.data.token_kind import TokenKind
from ds_ttt.evaluation.intervals import bootstrap_ratio_interval, wilson_interval



@dataclass
class RoundMetrics:
    round: int
    action_tokens: int = 0
    action_nll_sum: float = 0.0
    action_correct: int = 0
    action_exact: bool | None = None  # None: the round has no action tokens
    obs_tokens: int = 0
    obs_nll_sum: float = 0.0
    obs_nll_after_sum: float | None = None  # None: no update happened on this observation
    obs_exact: bool | None = None  # None: the round has no observation
    updated: bool = False
    skipped: bool = False
    memory: list[dict] = field(default_factory=list)  # [{"fact", "source_round", "exact"}]
    memory_check: bool = False  # the action must use an earlier fact (>= 1 meta.memory_checks entry)
    recovery: bool = False  # the action right after a failing command (meta.recovery_rounds)

    @property
    def action_nll(self) -> float | None:
        return self.action_nll_sum / self.action_tokens if self.action_tokens else None

    @property
    def obs_nll(self) -> float | None:
        return self.obs_nll_sum / self.obs_tokens if self.obs_tokens else None

    @property
    def obs_nll_after(self) -> float | None:
        return self.obs_nll_after_sum / self.obs_tokens if self.obs_nll_after_sum is not None and self.obs_tokens else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(action_nll=self.action_nll, action_token_acc=(self.action_correct / self.action_tokens
                                                               if self.action_tokens else None),
                 obs_nll=self.obs_nll, obs_nll_after=self.obs_nll_after)
        return d


def observation_end_positions(obs_mask: torch.Tensor) -> list[int]:
    """Indices (into the round's label list) of the token closing each observation span: the first
    label after a run of observation labels (when the round still has one)."""
    n = int(obs_mask.numel())
    return [i + 1 for i in range(n) if bool(obs_mask[i]) and (i + 1 < n and not bool(obs_mask[i + 1]))]


def fact_exact(tokenizer, action_ids: list[int], correct: list[bool], fact: str) -> bool | None:
    """Is the first occurrence of `fact` in the decoded action reproduced exactly (every token that
    overlaps its characters correct)? None when the action does not contain the fact at all."""
    offsets = [0]
    for i in range(1, len(action_ids) + 1):  # cumulative decode keeps multi-byte characters whole
        offsets.append(len(tokenizer.decode(action_ids[:i], skip_special_tokens=False)))
    text = tokenizer.decode(action_ids, skip_special_tokens=False)
    at = text.find(fact)
    if at < 0:
        return None
    lo, hi = at, at + len(fact)
    return all(c for c, s, e in zip(correct, offsets[:-1], offsets[1:]) if s < hi and e > lo)


def round_metrics(record, *, memory_checks: list[dict] = (), recovery_rounds=(), tokenizer=None) -> RoundMetrics:
    """Metrics of one EventRecord (recorded with every label position of its round)."""
    kinds, labels, nll, argmax = record.label_kinds, record.labels, record.token_nll.double(), record.argmax
    correct = argmax == labels
    act, obs = kinds == TokenKind.ACTION, kinds == TokenKind.OBSERVATION
    m = RoundMetrics(round=int(record.round), updated=bool(record.updated), skipped=bool(record.skipped))
    m.memory_check = any(int(c["round"]) == m.round for c in memory_checks)
    m.recovery = m.round in {int(r) for r in recovery_rounds}
    m.action_tokens = int(act.sum())
    if m.action_tokens:
        m.action_nll_sum = float(nll[act].sum())
        m.action_correct = int(correct[act].sum())
        m.action_exact = bool(correct[act].all())
    m.obs_tokens = int(obs.sum())
    if m.obs_tokens:
        m.obs_nll_sum = float(nll[obs].sum())
        ends = observation_end_positions(obs)
        m.obs_exact = bool(correct[obs].all()) and all(bool(correct[i]) for i in ends)
        if record.obs_nll_after is not None:
            m.obs_nll_after_sum = float(record.obs_nll_after.double().sum())
    for check in memory_checks:
        if int(check["round"]) != m.round:
            continue
        exact = None
        if tokenizer is not None and m.action_tokens:
            exact = fact_exact(tokenizer, labels[act].tolist(), correct[act].tolist(), str(check["fact"]))
        m.memory.append({"fact": check["fact"], "source_round": check.get("source_round"), "exact": exact})
    return m


def summarize(rounds: list[RoundMetrics]) -> dict:
    """Token-weighted NLL/accuracy and round-weighted exact-match rates over a set of rounds."""
    a_tok = sum(r.action_tokens for r in rounds)
    o_tok = sum(r.obs_tokens for r in rounds)
    upd = [r for r in rounds if r.obs_nll_after_sum is not None]
    upd_tok = sum(r.obs_tokens for r in upd)
    a_em = [r.action_exact for r in rounds if r.action_exact is not None]
    o_em = [r.obs_exact for r in rounds if r.obs_exact is not None]
    facts = [f["exact"] for r in rounds for f in r.memory if f["exact"] is not None]
    mem = [r for r in rounds if r.memory_check and r.action_exact is not None]
    mem_em = [r.action_exact for r in mem]
    rec = [r for r in rounds if r.recovery and r.action_tokens]
    rec_tok = sum(r.action_tokens for r in rec)

    def div(a, b):
        return a / b if b else None

    out = {
        "num_rounds": len(rounds),
        "action_tokens": a_tok,
        "action_nll": div(sum(r.action_nll_sum for r in rounds), a_tok),
        "action_token_acc": div(sum(r.action_correct for r in rounds), a_tok),
        "action_exact": div(sum(a_em), len(a_em)),
        "action_exact_count": [int(sum(a_em)), len(a_em)],
        "obs_tokens": o_tok,
        "obs_nll": div(sum(r.obs_nll_sum for r in rounds), o_tok),
        # before/after over the same (updated) rounds, so the pair is comparable
        "obs_nll_before_updated": div(sum(r.obs_nll_sum for r in upd), upd_tok),
        "obs_nll_after": div(sum(r.obs_nll_after_sum for r in upd), upd_tok),
        "obs_exact": div(sum(o_em), len(o_em)),
        "obs_exact_count": [int(sum(o_em)), len(o_em)],
        "memory_fact_exact": div(sum(facts), len(facts)),
        "memory_fact_count": [int(sum(facts)), len(facts)],
        # what adaptation should improve: whole-action exact match where an earlier fact is needed, and
        # the action after a failing command
        "memory_action_exact": div(sum(mem_em), len(mem_em)),
        "memory_action_exact_count": [int(sum(mem_em)), len(mem_em)],
        "memory_action_nll": div(sum(r.action_nll_sum for r in mem), sum(r.action_tokens for r in mem)),
        "recovery_action_nll": div(sum(r.action_nll_sum for r in rec), rec_tok),
        "recovery_action_tokens": rec_tok,
        "recovery_rounds": len(rec),
        "num_updates": sum(r.updated for r in rounds),
        "num_skipped": sum(r.skipped for r in rounds),
    }
    rates = {"action_exact": a_em, "obs_exact": o_em, "memory_fact_exact": facts, "memory_action_exact": mem_em}
    for name, outcomes in rates.items():
        out[f"{name}_lo"], out[f"{name}_hi"] = wilson_interval(int(sum(outcomes)), len(outcomes))
    nlls = {"action_nll": [r for r in rounds if r.action_tokens], "memory_action_nll": mem, "recovery_action_nll": rec}
    for name, units in nlls.items():
        out[f"{name}_lo"], out[f"{name}_hi"] = bootstrap_ratio_interval(
            [r.action_nll_sum for r in units], [r.action_tokens for r in units])
    return out


def by_round_index(per_traj: list[list[RoundMetrics]]) -> list[dict]:
    """summarize() per round index r across trajectories (round 0, the prompt, has no scored tokens)."""
    grouped: dict[int, list[RoundMetrics]] = {}
    for rounds in per_traj:
        for r in rounds:
            grouped.setdefault(r.round, []).append(r)
    return [{"round": k, "num_trajectories": len(v), **summarize(v)} for k, v in sorted(grouped.items()) if k > 0]

