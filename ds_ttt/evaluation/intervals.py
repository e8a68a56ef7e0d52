"""Confidence intervals for evaluation numbers: Wilson intervals for rates, bootstrap for NLLs.

    from ds_ttt.evaluation.intervals import wilson_interval, bootstrap_ratio_interval
    lo, hi = wilson_interval(5, 32)                          # 95% interval of 5/32
    lo, hi = bootstrap_ratio_interval(nll_sums, token_counts) # token-weighted mean NLL over units

Wilson's score interval (not the normal approximation) keeps its coverage at small n and at rates of
0 or 1, which is where the adaptation numbers live. The bootstrap resamples whole units (rounds or
trajectories) with replacement and recomputes the token-weighted ratio sum(nll)/sum(tokens); the
percentile interval of `num_resamples` resamples, with a fixed seed so reports are reproducible.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Z_95 = 1.959963984540054  # standard normal quantile for a two-sided 95% interval
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float | None, float | None]:
    """Wilson score interval for successes/trials; (None, None) when there are no trials."""
    if trials < 0 or successes < 0 or successes > trials:
        raise ValueError(f"wilson_interval: need 0 <= successes <= trials, got {successes}/{trials}")
    if trials == 0:
        return None, None
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_ratio_interval(numerators: Sequence[float], denominators: Sequence[float], *,
                             num_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                             level: float = 0.95) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval of sum(num)/sum(den) over resampled units; (None, None) if empty."""
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape:
        raise ValueError(f"bootstrap_ratio_interval: {num.shape} numerators vs {den.shape} denominators")
    keep = den > 0
    num, den = num[keep], den[keep]
    if num.size == 0:
        return None, None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.size, size=(num_resamples, num.size))
    ratios = num[idx].sum(1) / den[idx].sum(1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return float(lo), float(hi)
