"""Context policy: which earlier tokens attention may see (everything else reaches a token only through W).

Three policies, identical in training, evaluation and serving:
  full           every earlier token (up to the capacity fixed at data preparation);
  window         the last `window` tokens, query included (absolute distance i - j < window);
  current_round  the task prompt (round 0) plus the earlier tokens of the query's own round
                 (the TTT-Terminal-World rule: only fast weights can carry a fact across rounds).

Two equivalent forms are provided:
  * `ContextPolicy.mask` - a [B, 1, T, T] boolean mask for a whole sequence at once (the frozen
    prefix layers, which run the full trajectory in one pass);
  * `ContextPolicy.select_chunks` - the rows of a per-layer key/value cache (kept as chunks) that new
    tokens may see (the inner loop, which runs event by event, selects them once per event). It returns
    the kept rows plus the absolute offsets to pass to `ds_ttt.ops.flashbob.attention`, so that its
    causal/window mask over (kept keys ++ new keys) equals `mask`. For current_round the kept keys are
    not contiguous in position (round 0, then the current round); we index them "compressed" (0..S-1)
    with the queries following at offset S, which is exact because every kept key precedes every new
    query. RoPE already used the true positions, so relative rotations are unaffected.
The policy's kind is a `PolicyKind`; callers ask the policy what they need (`attention_window`,
`sees_everything`, `rounds_are_segments`, ...) rather than compare its name.

Shape letters: B batch, T tokens, H kv heads, S cached tokens, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Sequence

import torch


@dataclass
class LayerCache:
    """Keys/values of earlier tokens for one layer of one trajectory (batch 1)."""

    k_1HSD: torch.Tensor
    v_1HSD: torch.Tensor
    positions_S: torch.Tensor  # int64 absolute positions (host tensors in the event loop)
    rounds_S: torch.Tensor  # int64 round ids

    @staticmethod
    def empty(like_1HTD: torch.Tensor) -> "LayerCache":
        b, h, _, d = like_1HTD.shape
        z = like_1HTD.new_zeros(b, h, 0, d)
        idx = torch.zeros(0, dtype=torch.long, device=like_1HTD.device)
        return LayerCache(z, z, idx, idx)

    def __len__(self) -> int:
        return int(self.positions_S.numel())

    def take(self, keep_S: torch.Tensor) -> "LayerCache":
        """Keep the rows where `keep_S` (computed from the metadata, on its device) is True. With host
        metadata (the event loop's) the selection never waits for the accelerator. A contiguous run of
        rows is a view of the keys/values (no copy); any other selection gathers them."""
        idx = keep_S.nonzero().squeeze(1)
        if len(idx) and int(idx[-1]) - int(idx[0]) + 1 == len(idx):
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            return LayerCache(self.k_1HSD[:, :, lo:hi], self.v_1HSD[:, :, lo:hi], self.positions_S[lo:hi],
                              self.rounds_S[lo:hi])
        kv_idx = idx.to(self.k_1HSD.device, non_blocking=True)
        return LayerCache(self.k_1HSD.index_select(2, kv_idx), self.v_1HSD.index_select(2, kv_idx),
                          self.positions_S[idx], self.rounds_S[idx])

    def append(self, k_1HTD, v_1HTD, positions_T, rounds_T) -> "LayerCache":
        return LayerCache(torch.cat([self.k_1HSD, k_1HTD], 2), torch.cat([self.v_1HSD, v_1HTD], 2),
                          torch.cat([self.positions_S, positions_T]), torch.cat([self.rounds_S, rounds_T]))


@dataclass(frozen=True)
class AttentionSpan:
    """Arguments for `attention(q, cat(k_cache, k_new), ...)` after `select`."""

    q_offset: int
    k_offset: int
    window: int


class PolicyKind(StrEnum):
    """The three policies (their names are `TTTConfig.context_policy`'s values)."""

    FULL = "full"
    WINDOW = "window"
    CURRENT_ROUND = "current_round"


@dataclass(frozen=True)
class ContextPolicy:
    kind: PolicyKind = PolicyKind.FULL
    window: int = 0

    def __post_init__(self):
        if self.kind not in set(PolicyKind):  # a name given as a string becomes its kind
            raise ValueError(f"context_policy must be one of {tuple(k.value for k in PolicyKind)}, got {self.kind!r}")
        object.__setattr__(self, "kind", PolicyKind(self.kind))

    @classmethod
    def from_ttt(cls, ttt) -> "ContextPolicy":
        return cls(kind=ttt.context_policy, window=ttt.window)

    def ttt_fields(self) -> dict:
        """The TTTConfig fields that hold this policy (from_ttt's inverse)."""
        return {"context_policy": self.kind.value, "window": self.window}

    def switched_to(self, kind: "PolicyKind | str", *, window: int | None = None) -> "ContextPolicy":
        """The policy `kind`: a window of `window` tokens, or of this policy's width when not given; the
        other kinds take no window (giving one is an error)."""
        kind = ContextPolicy(kind).kind
        if kind is PolicyKind.WINDOW:
            return ContextPolicy(kind, self.window if window is None else window)
        if window:
            raise ValueError(f"window={window} is only used with context_policy='window'")
        return ContextPolicy(kind)

    # ---- what callers ask (so that none of them compares policy names) ---------------------------
    @property
    def sees_everything(self) -> bool:
        """Does attention see every earlier token (full context)?"""
        return self.kind is PolicyKind.FULL

    @property
    def attention_window(self) -> int:
        """The sliding window attention kernels take (0: none)."""
        return self.window if self.kind is PolicyKind.WINDOW else 0

    @property
    def is_positional(self) -> bool:
        """Is visibility a function of positions alone (causal, or causal within a window), so that a
        causal/sliding-window kernel needs no mask? False for current_round, which also needs round ids."""
        return self.kind is not PolicyKind.CURRENT_ROUND

    @property
    def needs_rounds(self) -> bool:
        """Does visibility depend on round ids (a whole-sequence pass must be given them)?"""
        return not self.is_positional

    @property
    def rounds_are_segments(self) -> bool:
        """Does each round start a new segment, with nothing carried from the round before (attention
        context and the key state's history alike)? True for current_round."""
        return self.kind is PolicyKind.CURRENT_ROUND

    def visible_from(self, slot: int) -> int:
        """The first cache slot a query at cache slot `slot` may see, in a serving cache laid out as
        ds_ttt/serve/kv_cache.py says (window: slot = position, so the window's first slot)."""
        return max(0, slot - self.window + 1) if self.kind is PolicyKind.WINDOW else 0

    def new_round_slot(self, start: int, prompt_slots: int) -> int:
        """The cache slot of a new round starting at position `start`: current_round reuses the slots
        after round 0 (no later query may see an earlier round); full and window keep slot = position."""
        return prompt_slots if self.rounds_are_segments else start

    def segment_starts_at(self, slot: int, prompt_slots: int | None) -> bool:
        """Does a segment (a fresh key-state history) start at cache slot `slot`? At slot 0 always; under
        current_round also at each round's first slot after round 0 (`prompt_slots`; None before round 0
        is laid out)."""
        return slot == 0 or (self.rounds_are_segments and prompt_slots is not None and slot == prompt_slots)

    def may_see_event(self, start: int, round_id: int, event_end: int, event_round: int) -> bool:
        """May a query at positions start.. of round `round_id` see any token of an earlier event (one
        round: positions < event_end, round `event_round`)? The event loop keeps its KV cache as
        per-event chunks and hands an event only the chunks this allows; `select` then trims exactly."""
        if self.kind is PolicyKind.WINDOW:
            return event_end - 1 > start - self.window
        if self.kind is PolicyKind.CURRENT_ROUND:
            return event_round in (0, round_id)
        return True

    def mask(self, rounds_BT: torch.Tensor) -> torch.Tensor | None:
        """Boolean [B, 1, T, T] mask (True = may attend) for a right-padded batch, or None for plain causal.

        Positions are 0..T-1 per row. Right padding never needs masking: a real query only sees
        earlier (hence real) keys under every policy.
        """
        if self.kind is PolicyKind.FULL:
            return None
        _, t = rounds_BT.shape
        i = torch.arange(t, device=rounds_BT.device)
        allowed_TT = i[None, :] <= i[:, None]
        if self.kind is PolicyKind.WINDOW:
            allowed_TT = allowed_TT & (i[:, None] - i[None, :] < self.window)
            return allowed_TT[None, None]
        same_round_BTT = (rounds_BT[:, :, None] == rounds_BT[:, None, :]) | (rounds_BT[:, None, :] == 0)
        return (allowed_TT[None] & same_round_BTT)[:, None]

    def keep_rows(self, positions_S: torch.Tensor, rounds_S: torch.Tensor, start: int,
                  round_id: int) -> tuple[torch.Tensor | None, AttentionSpan]:
        """Which cached rows (their host positions and round ids) new tokens at positions start.. of round
        `round_id` may see (None: all of them), and the AttentionSpan for attention over kept ++ new."""
        if self.kind is PolicyKind.FULL:
            k_off = int(positions_S[0]) if len(positions_S) else start
            return None, AttentionSpan(q_offset=start, k_offset=k_off, window=0)
        if self.kind is PolicyKind.WINDOW:
            keep = positions_S > start - self.window
            kept = positions_S[keep]
            return keep, AttentionSpan(q_offset=start, k_offset=int(kept[0]) if len(kept) else start, window=self.window)
        keep = (rounds_S == 0) | (rounds_S == round_id)
        return keep, AttentionSpan(q_offset=int(keep.sum()), k_offset=0, window=0)

    def select_chunks(self, chunks: Sequence[LayerCache], start: int,
                      round_id: int) -> tuple[list[LayerCache], AttentionSpan]:
        """The rows of a layer's cache, kept as chunks, that new tokens at positions start.. (all in round
        `round_id`) may see (host metadata; no device sync): whole chunks where every row is kept, the
        kept rows of the others (a view when they are contiguous, as a window's are), none of a chunk
        with no row kept; and the AttentionSpan for attention over (kept ++ new)."""
        positions = torch.cat([c.positions_S for c in chunks]) if chunks else torch.zeros(0, dtype=torch.long)
        rounds = torch.cat([c.rounds_S for c in chunks]) if chunks else torch.zeros(0, dtype=torch.long)
        keep, span = self.keep_rows(positions, rounds, start, round_id)
        if keep is None:
            return [c for c in chunks if len(c)], span
        kept, i = [], 0
        for c in chunks:
            mask, i = keep[i:i + len(c)], i + len(c)
            if len(c) and bool(mask.all()):
                kept.append(c)
            elif bool(mask.any()):
                kept.append(c.take(mask))
        return kept, span
