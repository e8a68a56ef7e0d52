"""Round 0 of a session's episode (system prompt, tool schemas, task): rendered once, as its system block and the rest.

    rendered = render_round0(messages, tools, tokenizer)      # ids, kinds, rounds, block
    r0 = session.begin_reset(messages, tools=tools)            # a Round0: rendered, the block in its cache
    session.prefill_rest(r0)                                   # or batched with others: prefill.py
    session.end_reset(r0)

Round 0 is prefilled in two chunks, its system block (the system message with the tool schemas, or
the tool schemas alone) and the rest, so that a shared system-prompt cache (prefix_cache.py) can supply
the first exactly. `render_round0` renders each part once; together they are exactly
`render_trajectory` of the round-0 messages, which renders message by message (data/render.py): the
block is the first message's rendering (or the tools' turn), the rest the others', and nothing of the
first message changes how a later round-0 message (a user or another system turn) is rendered.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_ttt.data.render import render_trajectory
from ds_ttt.serve.kv_cache import KVCache


def default_system_prompt() -> str:
    from ds_ttt.data.generator import SYSTEM_PROMPT

    return SYSTEM_PROMPT


def default_tools() -> list[dict]:
    from ds_ttt.data.generator import BASH_TOOL

    return [BASH_TOOL]


@dataclass
class RenderedRound0:
    ids: list[int]
    kinds: list[int]
    rounds: list[int]
    block: int  # tokens of the system block: ids[:block] (0: none, or it is the whole of round 0)


def render_round0(messages: list[dict], tools: list | None, tokenizer) -> RenderedRound0:
    """Round 0's tokens (equal to render_trajectory of `messages` with `tools`) and its system block's
    length, each part rendered once (module docstring)."""
    head = messages[:1] if messages[0]["role"] == "system" else []
    block = (render_trajectory({"id": "session", "messages": head, "tools": tools or None}, tokenizer)
             if head or tools else None)
    rest = render_trajectory({"id": "session", "messages": messages[len(head):], "tools": None}, tokenizer)
    ids = (block.input_ids if block else []) + rest.input_ids
    kinds = (block.kinds if block else []) + rest.kinds
    b = len(block.input_ids) if block else 0
    return RenderedRound0(ids=ids, kinds=kinds, rounds=[0] * len(ids), block=b if 0 < b < len(ids) else 0)


@dataclass
class Round0:
    """A session's round 0 between `begin_reset` and `end_reset`: rendered, its cache holding the system
    block (slots 0..block-1); the rest, ids[block:], still to be prefilled at slots (= positions) block.."""

    session: object  # the AgentSession (session.py) that began it
    messages: list[dict]
    tools: list | None
    ids: list[int]
    kinds: list[int]
    rounds: list[int]
    cache: KVCache
    weights: tuple
    block: int  # tokens of the system block (0: none)
    cached: int  # of them, taken from the prefix cache

    @property
    def rest(self) -> list[int]:
        return self.ids[self.block:]
