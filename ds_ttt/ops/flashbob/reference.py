"""Reference (specification) backend of FlashBoB attention: readable PyTorch math.

This is the spec every kernel is tested against (see docs/flashbob_math.md). It is
plain autograd over explicit N×N tensors, so it is twice (and more) differentiable, runs on any
device and dtype, and doubles as the explicit `backend="reference"` fallback. It is O(N²) in
memory: use the `cpu` / `cuda` backends for long sequences.

Shapes: q_BHND [B, Hq, Nq, D], k_BKND / v_BKND [B, Hkv, Nk, D], Hq = G·Hkv (GQA; query head h
uses KV head h // G). The reference broadcasts K/V over the group through a view (no copy in the
math itself; autograd may materialise N×N intermediates, which is the point of a reference).

Mask (absolute positions i = local query index + q_offset, j = local key index + k_offset):
row i sees key j iff (not causal) or (0 <= i - j and (window == 0 or i - j < window)).
Rows that see no key give zeros (outputs and gradients), never NaN.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_reference", "visibility_mask", "default_q_offset"]


def default_q_offset(num_q: int, num_k: int, k_offset: int) -> int:
    """Right-aligned queries: the last query sits at the last key's position."""
    return num_k - num_q + k_offset


def visibility_mask(num_q: int, num_k: int, *, causal: bool, window: int, q_offset: int,
                    k_offset: int, device=None) -> torch.Tensor:
    """Bool [Nq, Nk]: True where query row i may attend key column j (absolute positions)."""
    i = torch.arange(num_q, device=device).unsqueeze(1) + q_offset
    j = torch.arange(num_k, device=device).unsqueeze(0) + k_offset
    if not causal:
        return torch.ones(num_q, num_k, dtype=torch.bool, device=device)
    delta = i - j
    visible = delta >= 0
    if window > 0:
        visible = visible & (delta < window)
    return visible


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                        scale: float | None = None, window: int = 0, q_offset: int | None = None,
                        k_offset: int = 0, upcast: bool = False, return_lse: bool = False):
    """softmax(scale·q kᵀ + mask) v with GQA, window, offsets; zeros on fully masked rows.

    upcast=True computes in float32 (for bf16/fp16 inputs) and casts the output back.
    return_lse=True also returns the natural-log logsumexp L [B, Hq, Nq] (float32 or float64),
    +inf on fully masked rows (so exp(S - L) = 0 there, as the kernels store it).
    Arguments are assumed validated (the public `attention` does that).
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if q_offset is None:
        q_offset = default_q_offset(Nq, Nk, k_offset)
    out_dtype = q.dtype
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()

    # Group query heads by their KV head: [B, Hkv, G, Nq, D]; K/V broadcast over G.
    q_BKGND = q.reshape(B, Hkv, G, Nq, D)
    k_BK1ND = k.unsqueeze(2)
    v_BK1ND = v.unsqueeze(2)
    s_BKGNM = torch.matmul(q_BKGND, k_BK1ND.transpose(-1, -2)) * scale

    visible_NM = visibility_mask(Nq, Nk, causal=causal, window=window, q_offset=q_offset,
                                 k_offset=k_offset, device=q.device)
    s_BKGNM = s_BKGNM.masked_fill(~visible_NM, float("-inf"))
    # Stable softmax; the max is detached (softmax is shift invariant, so gradients are exact).
    m_BKGN1 = s_BKGNM.detach().amax(dim=-1, keepdim=True)
    m_BKGN1 = torch.where(torch.isfinite(m_BKGN1), m_BKGN1, torch.zeros_like(m_BKGN1))
    e_BKGNM = torch.exp(s_BKGNM - m_BKGN1)          # exactly 0 where masked (exp(-inf))
    denom_BKGN1 = e_BKGNM.sum(dim=-1, keepdim=True)
    has_key_BKGN1 = denom_BKGN1 > 0
    p_BKGNM = e_BKGNM / torch.where(has_key_BKGN1, denom_BKGN1, torch.ones_like(denom_BKGN1))
    o_BKGND = torch.matmul(p_BKGNM, v_BK1ND)
    o = o_BKGND.reshape(B, Hq, Nq, D).to(out_dtype)
    if not return_lse:
        return o
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = (m_BKGN1 + torch.log(denom_BKGN1)).to(lse_dtype)
    lse = torch.where(has_key_BKGN1, lse, torch.full_like(lse, float("inf")))
    return o, lse.reshape(B, Hq, Nq)
