"""Autograd Functions wiring the FlashBoB kernels into a twice-differentiable attention.

    AttnFunc.forward      -> op.fwd      (O, logsumexp L)
    AttnFunc.backward     -> AttnBwdFunc.apply(...)  (so create_graph=True records a node)
    AttnBwdFunc.forward   -> op.bwd      (dQ, dK, dV)
    AttnBwdFunc.backward  -> AttnBwdBwdFunc.apply(...)
    AttnBwdBwdFunc.forward  -> op.bwd_bwd (Q̄, K̄, V̄, dŌ)  two-pass BoB
    AttnBwdBwdFunc.backward -> raises (third derivatives are not implemented)

O and L enter AttnBwdFunc as saved, detached values: the BoB formulas already contain their
dependence on Q, K, V (flashbob_math.md), so they get no gradient of their own. Tangents that
autograd does not provide (None: that first-order output was not used) are passed as None so the
kernel skips their products; a third derivative raises a clear RuntimeError.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .builder import load_cpu_op, load_cuda_emu_op, load_cuda_op

__all__ = ["AttnFunc", "AttnBwdFunc", "AttnBwdBwdFunc"]


def _op(backend: str):
    # "cuda_emu" (tests only, never chosen by `attention`): the CUDA kernels emulated on CPU.
    return {"cpu": load_cpu_op, "cuda": load_cuda_op, "cuda_emu": load_cuda_emu_op}[backend]()


def _attn_fwd(backend, q, k, v, causal, scale, window, q_offset, k_offset):
    o, lse = _op(backend).fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal, window,
                              q_offset, k_offset, scale)
    return o, lse


def _attn_bwd(backend, q, k, v, o, lse, do, causal, scale, window, q_offset, k_offset):
    dq, dk, dv = _op(backend).bwd(q.contiguous(), k.contiguous(), v.contiguous(), o, lse,
                                  do.contiguous(), causal, window, q_offset, k_offset, scale)
    return dq, dk, dv


def _attn_bwd_bwd(backend, q, k, v, o, lse, do, dq, uq, uk, uv, causal, scale, window, q_offset,
                  k_offset):
    def c(t):
        return None if t is None else t.contiguous()

    qbar, kbar, vbar, dobar = _op(backend).bwd_bwd(
        q.contiguous(), k.contiguous(), v.contiguous(), o, lse, do.contiguous(), dq, c(uq), c(uk),
        c(uv), causal, window, q_offset, k_offset, scale)[:4]
    return qbar, kbar, vbar, dobar


class AttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend, causal, scale, window, q_offset, k_offset):
        cfg = (backend, causal, scale, window, q_offset, k_offset)
        o, lse = _attn_fwd(backend, q, k, v, causal, scale, window, q_offset, k_offset)
        # Save the caller's q/k/v (not contiguous copies) so a second backward reaches them.
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.cfg = cfg
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = AttnBwdFunc.apply(q, k, v, o.detach(), lse, do, *ctx.cfg)
        return dq, dk, dv, None, None, None, None, None, None


class AttnBwdFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, o, lse, do, backend, causal, scale, window, q_offset, k_offset):
        dq, dk, dv = _attn_bwd(backend, q, k, v, o, lse, do, causal, scale, window, q_offset,
                               k_offset)
        ctx.save_for_backward(q, k, v, o, lse, do, dq)
        ctx.cfg = (backend, causal, scale, window, q_offset, k_offset)
        ctx.set_materialize_grads(False)  # unused first-order outputs arrive as None: skip them
        return dq, dk, dv

    @staticmethod
    def backward(ctx, uq, uk, uv):
        none = (None,) * 12
        if uq is None and uk is None and uv is None:
            return none
        q, k, v, o, lse, do, dq = ctx.saved_tensors
        qbar, kbar, vbar, dobar = AttnBwdBwdFunc.apply(q, k, v, o, lse, do, dq, uq, uk, uv,
                                                       *ctx.cfg)
        return (qbar, kbar, vbar, None, None, dobar) + (None,) * 6


class AttnBwdBwdFunc(torch.autograd.Function):
    """The BoB kernel as a node whose own backward refuses: a third derivative fails loudly.

    (`@once_differentiable` alone is not enough: its error node hangs off detached aliases, so
    `torch.autograd.grad(..., inputs=q)` prunes it and silently drops terms.)
    """

    @staticmethod
    def forward(ctx, q, k, v, o, lse, do, dq, uq, uk, uv, backend, causal, scale, window,
                q_offset, k_offset):
        return _attn_bwd_bwd(backend, q, k, v, o, lse, do, dq, uq, uk, uv, causal, scale,
                             window, q_offset, k_offset)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        raise RuntimeError("flashbob attention is twice differentiable only: a third derivative "
                           "(differentiating the backward-over-backward) is not implemented; "
                           "use backend='reference' for higher orders")
