"""The kind of every token of a rendered trajectory: the one definition that data preparation, the
model's event loop, the trainer, evaluation and serving all use.

    from ds_ttt.data.token_kind import TokenKind
    action_mask = kinds_BT == TokenKind.ACTION

  PAD          -1  right padding of a batch (no loss, never attended by a real query)
  CONTEXT       0  system prompt, task, chat headers and wrappers (no loss)
  ACTION        1  the expert's tokens: thinking, text, tool calls (the outer, meta-learned loss)
  OBSERVATION   2  real terminal output inside <tool_response> (the inner loss on the fast weights)
"""

from __future__ import annotations

from enum import IntEnum


class TokenKind(IntEnum):
    PAD = -1
    CONTEXT = 0
    ACTION = 1
    OBSERVATION = 2
