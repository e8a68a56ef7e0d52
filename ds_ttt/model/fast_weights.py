"""Fast weights: the prime SwiGLU MLP and the differentiable inner SGD step.

The prime MLP's matrices are *explicit tensors* passed into the forward, so one trajectory can carry
its own evolving copy W_0 -> W_1 -> ... while the nn.Parameters hold the meta-learned initial W_0.

Inner step (one per observed terminal output):
    g   = dL_obs/dW                       (create_graph=True while meta-training)
    W' = W - lr * g * min(1, max_norm / ||g||)      (global norm over all adaptive layers)
With create_graph=True the outer loss differentiates through g, i.e. the meta-gradient is full
second order (including the clip factor). A non-finite gradient skips the update (W' = W) on the
device, with `torch.where` and no host sync; the skip is returned as a 0-dim bool tensor.

Precision. In a bf16 model an inner step moves each weight by far less than half a bf16 ulp
(Qwen3-8B recipe: ~2.7e-6 per element against weights of ~1e-2, whose ulp is ~6e-5), so
`w_bf16 - lr * g` rounds most of every update away. The inner loop therefore carries its fast
weights in fp32 (`inner_loop_weights`: an fp32 copy of W_0 per trajectory, differentiable back to the
bf16 W_0) and updates them in fp32. Casting the whole fp32 W back to bf16 for the matmul would round
the update away again, so the prime MLP splits each projection into the bf16 W_0 and the fp32 delta
W - W_0, which has its own exponent and survives the cast to the compute dtype:
    x W^T = x W_0^T + x (W - W_0)^T          (both matmuls in the compute dtype, summed in fp32)
fp32 and fp64 models take the single-matmul path unchanged.

Shape letters: T tokens, D hidden, F prime width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FastWeights = tuple[torch.Tensor, ...]  # flat (gate_FD, up_FD, down_DF) per adaptive layer, in layer order


def fast_weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the inner loop carries fast weights in: fp32 at least (fp64 stays fp64 in tests)."""
    return torch.promote_types(dtype, torch.float32)


def inner_loop_weights(weights: FastWeights, *, differentiable: bool) -> FastWeights:
    """Per-trajectory fp32 (at least) copies of W_0 for the inner loop, ready for `torch.autograd.grad`.

    differentiable=True (meta-training): a differentiable cast, so the meta-gradient reaches the
    (bf16) W_0 parameters; an fp32 W_0 that requires grad is used as is. Otherwise (evaluation,
    serving): detached leaf copies that require grad only for the inner gradient.
    """
    out = []
    for w in weights:
        if differentiable and w.requires_grad:
            out.append(w.to(fast_weight_dtype(w.dtype)))
        else:
            out.append(w.detach().to(fast_weight_dtype(w.dtype), copy=True).requires_grad_(True))
    return tuple(out)


def prime_mlp(x: torch.Tensor, gate_FD: torch.Tensor, up_FD: torch.Tensor, down_DF: torch.Tensor) -> torch.Tensor:
    """SwiGLU: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate_FD)) * F.linear(x, up_FD), down_DF)


def split_linear(x: torch.Tensor, w0: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T for a high-precision W near the compute-dtype W_0: x W_0^T + x (W - W_0)^T, summed in fp32.

    W - W_0 is exact in fp32 (Sterbenz) and keeps its relative precision when cast to x's dtype.
    """
    delta = (w - w0.to(w.dtype)).to(x.dtype)
    acc = fast_weight_dtype(x.dtype)
    return (F.linear(x, w0).to(acc) + F.linear(x, delta).to(acc)).to(x.dtype)


class PrimeMLP(nn.Module):
    """Holds the initial fast weights W_0 under Qwen3-style names (gate_proj/up_proj/down_proj).

    down_proj starts at zero, so an untrained TTT model computes exactly what the base Qwen3 computes.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.down_proj.weight)

    def initial_weights(self) -> FastWeights:
        return (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)

    def forward(self, x: torch.Tensor, weights: FastWeights | None = None) -> torch.Tensor:
        if weights is None:
            return prime_mlp(x, *self.initial_weights())
        if all(w.dtype == x.dtype for w in weights):
            return prime_mlp(x, *weights)
        # fp32 fast weights in a low-precision model (see the module docstring)
        gate0, up0, down0 = self.initial_weights()
        gate, up, down = weights
        h = F.silu(split_linear(x, gate0, gate)) * split_linear(x, up0, up)
        return split_linear(h, down0, down)


@dataclass
class InnerStepResult:
    weights: FastWeights
    grad_norm: torch.Tensor  # detached scalar (pre-clip global norm)
    skipped: torch.Tensor  # 0-dim bool on the weights' device: the gradient was non-finite, W' = W


def inner_sgd_step(loss: torch.Tensor, weights: FastWeights, *, lr: float, max_norm: float,
                   create_graph: bool) -> InnerStepResult:
    """One clipped SGD step on the fast weights; differentiable when create_graph=True; no host sync.

    The update is computed in the weights' dtype (fp32 for `inner_loop_weights`). A non-finite
    gradient norm selects W' = W with `torch.where`; the gradient is zeroed first, so no NaN or inf
    reaches W' (and the cotangent flowing back into that event's gradient graph is zero).
    """
    with torch.enable_grad():
        grads = torch.autograd.grad(loss, weights, create_graph=create_graph, allow_unused=True)
    grads = tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, weights))
    acc = fast_weight_dtype(grads[0].dtype)  # fp32 at least (bf16 weights), fp64 in tests
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.to(acc)) for g in grads]))
    finite = torch.isfinite(norm)
    safe_norm = torch.where(finite, norm, torch.zeros_like(norm))
    grads = tuple(torch.where(finite, g, torch.zeros_like(g)) for g in grads)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (safe_norm + 1e-6), max=1.0)
        grads = tuple(g * coef.to(g.dtype) for g in grads)
    new = tuple(w - lr * g.to(w.dtype) for w, g in zip(weights, grads))
    if not create_graph:
        new = tuple(w.detach().requires_grad_(True) for w in new)
    return InnerStepResult(weights=new, grad_norm=norm.detach(), skipped=~finite.detach())
