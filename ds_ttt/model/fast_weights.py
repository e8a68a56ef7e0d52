"""Fast weights: the prime SwiGLU MLP and the differentiable inner SGD step.

The prime MLP's matrices are *explicit tensors* passed into the forward, so one trajectory can carry
its own evolving copy W_0 -> W_1 -> ... while the nn.Parameters hold the meta-learned initial W_0.

Inner step (one per observed terminal output):
    g   = dL_obs/dW                       (create_graph=True while meta-training)
    W' = W - lr * g * min(1, max_norm / ||g||)      (global norm over all adaptive layers)
With create_graph=True the outer loss differentiates through g, i.e. the meta-gradient is full
second order (including the clip factor). A non-finite gradient skips the update (W' = W) and is
counted, so NaN never enters W.

Shape letters: D hidden, F prime width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FastWeights = tuple[torch.Tensor, ...]  # flat (gate_FD, up_FD, down_DF) per adaptive layer, in layer order


def prime_mlp(x: torch.Tensor, gate_FD: torch.Tensor, up_FD: torch.Tensor, down_DF: torch.Tensor) -> torch.Tensor:
    """SwiGLU: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate_FD)) * F.linear(x, up_FD), down_DF)


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
        return prime_mlp(x, *(weights if weights is not None else self.initial_weights()))


@dataclass
class InnerStepResult:
    weights: FastWeights
    grad_norm: torch.Tensor  # detached scalar (pre-clip global norm)
    skipped: bool


def inner_sgd_step(loss: torch.Tensor, weights: FastWeights, *, lr: float, max_norm: float,
                   create_graph: bool) -> InnerStepResult:
    """One clipped SGD step on the fast weights; differentiable when create_graph=True."""
    with torch.enable_grad():
        grads = torch.autograd.grad(loss, weights, create_graph=create_graph, allow_unused=True)
    grads = tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, weights))
    acc = torch.promote_types(grads[0].dtype, torch.float32)  # fp32 at least (bf16 weights), fp64 in tests
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.to(acc)) for g in grads]))
    if not bool(torch.isfinite(norm)):
        return InnerStepResult(weights=weights, grad_norm=norm.detach(), skipped=True)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = tuple(g * coef.to(g.dtype) for g in grads)
    new = tuple(w - lr * g for w, g in zip(weights, grads))
    if not create_graph:
        new = tuple(w.detach().requires_grad_(True) for w in new)
    return InnerStepResult(weights=new, grad_norm=norm.detach(), skipped=False)
