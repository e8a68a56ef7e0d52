"""Synthetic trajectories for benchmarks and tests: random token ids with a fixed round structure.

    from ds_ttt.data.synthetic import synthetic_trajectory
    ids_T, kinds_T, rounds_T = synthetic_trajectory(8192, vocab_size=151936, prompt=512, action=256,
                                                    observation=768, seed=0)

Layout (kinds are `TokenKind`s):

    prompt      `prompt` CONTEXT tokens, round 0 (the system prompt and task)
    each round  `header` CONTEXT (the assistant-turn header), `action` ACTION, `separator` CONTEXT,
                `observation` OBSERVATION, `separator` CONTEXT; numbered first_round, first_round + 1, ...

`num_rounds` rounds are laid out (default: as many as reach `num_tokens`), then the whole is cut at
`num_tokens` (the last round may be partial; None: no cut). Every round holds one observation, so
the event loop makes one inner update per round whose observation is within the cut.

The ids are one draw of `torch.randint(0, vocab_size)` over the whole length from `generator`, or
from a fresh generator seeded with `seed`: passing one generator to successive calls gives each
trajectory different ids, the same for the same sequence of calls. The tensors are 1-D [T] int64
on the CPU; callers add the batch dimension and move them.

The defaults (2-token header, 1-token separators, no prompt) are the shape of a rendered Qwen3
chat round; the benchmarks choose the lengths.
"""

from __future__ import annotations

import torch

from .token_kind import TokenKind

DEFAULT_HEADER_TOKENS = 2  # assistant-turn header (context) before each action
DEFAULT_SEPARATOR_TOKENS = 1  # context between action and observation, and after the observation


def round_kinds(*, action: int, observation: int, header: int = DEFAULT_HEADER_TOKENS,
                separator: int = DEFAULT_SEPARATOR_TOKENS) -> list[TokenKind]:
    """The kinds of one full round: header, action, separator, observation, separator."""
    return ([TokenKind.CONTEXT] * header + [TokenKind.ACTION] * action + [TokenKind.CONTEXT] * separator
            + [TokenKind.OBSERVATION] * observation + [TokenKind.CONTEXT] * separator)


def synthetic_kinds_rounds(num_tokens: int | None = None, *, action: int, observation: int, prompt: int = 0,
                           header: int = DEFAULT_HEADER_TOKENS, separator: int = DEFAULT_SEPARATOR_TOKENS,
                           num_rounds: int | None = None, first_round: int = 1) -> tuple[list[int], list[int]]:
    """(kinds, rounds) as plain int lists with the layout of the module docstring."""
    if action < 1 or observation < 1:
        raise ValueError(f"action={action} and observation={observation} must each be >= 1 token")
    if num_tokens is None and num_rounds is None:
        raise ValueError("give num_tokens, num_rounds or both")
    if num_tokens is not None and num_tokens <= prompt:
        raise ValueError(f"num_tokens={num_tokens} must exceed the prompt ({prompt} tokens)")
    one_round = [int(k) for k in round_kinds(action=action, observation=observation, header=header,
                                             separator=separator)]
    kinds, rounds = [int(TokenKind.CONTEXT)] * prompt, [0] * prompt
    r = first_round
    while (len(kinds) < num_tokens) if num_rounds is None else (r < first_round + num_rounds):
        kinds += one_round
        rounds += [r] * len(one_round)
        r += 1
    if num_tokens is not None:
        kinds, rounds = kinds[:num_tokens], rounds[:num_tokens]
    return kinds, rounds


def synthetic_trajectory(num_tokens: int | None = None, *, vocab_size: int, action: int, observation: int,
                         prompt: int = 0, header: int = DEFAULT_HEADER_TOKENS,
                         separator: int = DEFAULT_SEPARATOR_TOKENS, num_rounds: int | None = None,
                         first_round: int = 1, seed: int = 0,
                         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids_T, kinds_T, rounds_T of one trajectory (module docstring)."""
    kinds, rounds = synthetic_kinds_rounds(num_tokens, action=action, observation=observation, prompt=prompt,
                                           header=header, separator=separator, num_rounds=num_rounds,
                                           first_round=first_round)
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    ids_T = torch.randint(0, vocab_size, (len(kinds),), generator=g)
    return ids_T, torch.tensor(kinds), torch.tensor(rounds)
