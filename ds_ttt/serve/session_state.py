"""What one agent episode holds between requests: its tokens, KV cache, fast weights and history; and the errors a session raises.

    state = SessionState(ids=..., kinds=..., rounds=..., cache=kv, num_slots=n, prompt_slots=n, weights=w0, ...)
    twin = state.copy()        # an independent copy (a fork): lists, cache and history copied, W shared
    log = state.history[-1]    # RoundLog of the last round: its action, NLLs, observation, update

An AgentSession (session.py) owns one SessionState per episode and changes it only when a request
succeeds; a reply being generated (decode.py `Decode`) reads it and writes only cache slots no
committed state needs. Round r's tokens are `<|im_start|>assistant\\n`, the action, `\\n`, then the tool
results; `round_start` / `round_slot` are where the open round begins in positions and cache slots
(kv_cache.py lays the slots out per context policy).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from ds_ttt.serve.kv_cache import KVCache


class SessionError(RuntimeError):
    """A request that does not fit the session's state (the session itself is unchanged)."""


class ContextFullError(SessionError):
    """The conversation does not fit the model's context (`max_context` tokens)."""

    def __init__(self, needed: int, capacity: int):
        super().__init__(f"context full: {needed} tokens > max_context={capacity}")
        self.needed, self.capacity = needed, capacity


@dataclass
class RoundLog:
    round: int
    action_ids: list[int] = field(default_factory=list)
    action_token_nll: list[float] = field(default_factory=list)  # model NLL of each action token (temperature 1)
    forced: bool = False
    truncated: bool = False
    obs_tokens: int = 0
    obs_nll: float | None = None  # mean observation NLL with W_{r-1} (what observe() returns)
    obs_nll_after: float | None = None  # with W_r (only with track_after=True)
    updated: bool = False
    skipped: bool = False

    @property
    def action_nll(self) -> float | None:
        return sum(self.action_token_nll) / len(self.action_token_nll) if self.action_token_nll else None


@dataclass
class SessionState:
    ids: list[int]
    kinds: list[int]
    rounds: list[int]
    cache: KVCache
    num_slots: int  # valid cache slots (see kv_cache.py for the layout)
    prompt_slots: int  # slots of round 0 (system prompt + task)
    weights: tuple
    round: int
    phase: str  # "act" (expects act) | "acted" (expects observe or act)
    round_start: int  # position of the current round's first token
    round_slot: int  # its cache slot
    messages: list[dict]
    history: list[RoundLog]
    tools: list | None
    num_updates: int = 0
    num_skipped: int = 0

    def copy(self) -> "SessionState":
        """An independent copy: its lists, messages, history and cache (the valid slots) are its own; the
        fast weights are shared (never written in place: an update makes new tensors)."""
        return dataclasses.replace(
            self, ids=list(self.ids), kinds=list(self.kinds), rounds=list(self.rounds),
            cache=self.cache.clone(self.num_slots), messages=copy.deepcopy(self.messages),
            history=copy.deepcopy(self.history), tools=copy.deepcopy(self.tools))
