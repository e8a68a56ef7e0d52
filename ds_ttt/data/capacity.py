"""Context capacity: keep each trajectory's valid prefix, never truncate text.

A round's action example is every token up to the end of its action; its observation example every
token up to the end of its observations. Rounds are contiguous, so the first round whose action or
observation example does not fit `capacity` is simply the first round r with
`len(tokens of rounds 0..r) > capacity`; it and every later round are excluded. If round 1 does not fit
(or round 0 alone is too long) nothing trainable is left and the trajectory is dropped
(`apply_capacity` returns `(None, 0)`); the manifest counts such drops.
"""

from __future__ import annotations

from .render import RenderedTrajectory


def apply_capacity(rendered: RenderedTrajectory, capacity: int) -> tuple[RenderedTrajectory | None, int]:
    """(prefix of rounds 0..R, R) for the largest R whose prefix fits in `capacity` tokens."""
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    ends: dict[int, int] = {}
    for pos, r in enumerate(rendered.rounds):
        if pos > 0 and r < rendered.rounds[pos - 1]:
            raise ValueError(f"{rendered.id}: round ids decrease at token {pos}")
        ends[r] = pos + 1
    retained = 0
    for r in sorted(ends):
        if ends[r] > capacity:
            break
        retained = r
    if retained == 0:
        return None, 0
    prefix = rendered.prefix(retained)
    prefix.meta["retained_rounds"] = retained
    prefix.meta["total_rounds"] = rendered.num_rounds
    return prefix, retained
