"""The inner step: one clipped SGD step on the fast weights, differentiable for the meta-gradient.

Inner step (one per observed terminal output):
    g   = dL_obs/dW                       (create_graph=True while meta-training)
    W' = W - lr * g * min(1, max_norm / ||g||)      (global norm over all adaptive layers)
With create_graph=True the outer loss differentiates through g, i.e. the meta-gradient is full
second order (including the clip factor). A non-finite gradient skips the update (W' = W) on the
device, with `torch.where` and no host sync; the skip is returned as a 0-dim bool tensor.

The write is `ClippedSGD` (an autograd.Function that keeps g in the dtype it is exact in, and
scalars; its backward is derived in its docstring) and `apply_update`, the one definition of
W' = W - lr (g c) that the checkpointed event loop also rebuilds W with (event_checkpoint.py). With
a FactorTaps (fast_weights.py) the gradient is taken in factors, (dL/dy)^T x, and they are returned.
`inner_update` is the step as a TTTConfig sets it, shared by the event loop and serving.

Shape letters: F prime width, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_ttt.model.fast_weights import FactorTaps, FastWeights, factor_product, fast_weight_dtype


@dataclass
class InnerStepResult:
    weights: FastWeights
    grad_norm: torch.Tensor  # detached scalar (pre-clip global norm)
    skipped: torch.Tensor  # 0-dim bool on the weights' device: the gradient was non-finite, W' = W
    # the update itself, W' = apply_update(W, grads, coefs, lr): per weight the gradient with a
    # non-finite one zeroed (None for a weight the step does not update) and its clip factor
    # (None without clipping); what a checkpointed event stores to rebuild W' (event_checkpoint.py)
    grads: tuple[torch.Tensor | None, ...] = ()
    coefs: tuple[torch.Tensor | None, ...] = ()
    # with `taps`: per updated weight the gradient's factors (dL/dy, x), detached (FactorTaps)
    factors: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] = ()


def apply_update(w: torch.Tensor, g: torch.Tensor | None, coef: torch.Tensor | None, lr: float) -> torch.Tensor:
    """W' = W - lr * (g * coef) in W's dtype, outside autograd: the one definition of the write, shared by
    the inner step (ClippedSGD) and by the rebuild of a checkpointed event's weights (event_checkpoint.py),
    so both round alike, bit for bit."""
    if g is None:
        return w
    return _write_into(g.to(w.dtype, copy=True), w, coef, lr)


def _write_into(u: torch.Tensor, w: torch.Tensor, coef: torch.Tensor | None, lr: float) -> torch.Tensor:
    """W - lr * (u * coef), computed in u's own storage (u is consumed): one W-sized buffer, not three.
    The same elementwise operations in the same order as `w - lr * (u * coef)`, so the same bits."""
    if coef is not None:
        u.mul_(coef.to(u.dtype))
    return u.mul_(lr).neg_().add_(w)


def inner_sgd_step(loss: torch.Tensor, weights: FastWeights, *, lr: float, max_norm: float,
                   create_graph: bool, per_matrix: bool = False,
                   trainable: tuple[bool, ...] | None = None, first_order: bool = False,
                   grad_dtype: torch.dtype | None = None, taps: FactorTaps | None = None,
                   values: bool = True) -> InnerStepResult:
    """One clipped SGD step on the fast weights; differentiable when create_graph=True; no host sync.

    The update is computed in the weights' dtype (fp32 for `inner_loop_weights`). A non-finite
    gradient norm selects W' = W with `torch.where`; the gradient is zeroed first, so no NaN or inf
    reaches W' (and the cotangent flowing back into that event's gradient graph is zero).
    per_matrix: clip each matrix's gradient to max_norm on its own instead of one global norm.
    trainable: which weights the step updates (None = all; `fast_matrices="down"` passes only the
    down projections); the others are returned unchanged and get no gradient.
    grad_norm is the pre-clip global norm over the updated weights either way.
    first_order (with create_graph): W' stays differentiable in W, but the gradient (and its clip) is a
    constant: the graph of `loss` is kept for the outer loss, never differentiated through the step.
    grad_dtype: the dtype the gradient is exact in and kept in for the backward (`ClippedSGD`): the
    compute dtype of a low-precision model, whose fast weights enter only as a compute-dtype delta
    (`split_linear`), so their gradient is a compute-dtype tensor cast up. None: the gradient's dtype.
    taps: the forward's FactorTaps: the gradient is taken as (dL/dy)^T x and its factors are returned.
    values=False: W' is wanted for its graph only (a checkpointed event's recompute, whose W' only
    receives the later events' gradient): W' are zero-storage stand-ins, no W-sized buffer is written.
    """
    trainable = trainable or (True,) * len(weights)
    wanted = [w for w, t in zip(weights, trainable) if t]
    differentiable = create_graph and not first_order
    factors: list = []
    if taps is None:
        with torch.enable_grad():
            got = torch.autograd.grad(loss, wanted, create_graph=differentiable, retain_graph=create_graph,
                                      allow_unused=True)
    else:  # dL/dW = (dL/dy)^T x from the recorded (x, y) of each fast matrix (FactorTaps)
        pairs = [p for p, t in zip(taps.pairs, trainable) if t]
        if any(p is None for p in pairs):
            raise RuntimeError("FactorTaps: a fast matrix was not used in the forward it listened to")
        with torch.enable_grad():
            dys = torch.autograd.grad(loss, [y for _, y in pairs], create_graph=differentiable,
                                      retain_graph=create_graph, allow_unused=True)
        got = []
        for (x, y), dy, w in zip(pairs, dys, wanted):
            dy = torch.zeros_like(y) if dy is None else dy
            with torch.set_grad_enabled(differentiable):  # in the factors' dtype: exact there (FactorTaps)
                got.append(factor_product(dy, x if differentiable else x.detach()))
            factors.append((dy.detach(), x.detach()))
    gs = [torch.zeros_like(w) if g is None else g for g, w in zip(got, wanted)]
    spec = _ClipSpec(lr=lr, max_norm=max_norm, per_matrix=per_matrix, save_dtype=grad_dtype or gs[0].dtype,
                     values=values)
    new_fast = iter(ClippedSGD.apply(spec, *wanted, *gs))
    new = tuple(next(new_fast) if t else w for w, t in zip(weights, trainable))
    if not create_graph:
        new = tuple(w.detach().requires_grad_(True) if t else w for w, t in zip(new, trainable))
    kept, coefs, fs = iter(spec.kept), iter(spec.coefs), iter(factors)
    return InnerStepResult(weights=new, grad_norm=spec.norm, skipped=~spec.finite,
                           grads=tuple(next(kept) if t else None for t in trainable),
                           coefs=tuple(next(coefs) if t else None for t in trainable),
                           factors=tuple(next(fs) if t else None for t in trainable) if factors else ())


@dataclass
class _ClipSpec:
    """ClippedSGD's settings in, and its detached side results out (norm, finite, kept g, clip factors)."""

    lr: float
    max_norm: float
    per_matrix: bool
    save_dtype: torch.dtype
    values: bool = True  # False: return zero-storage stand-ins for W' (its graph is all that is needed)
    norm: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    kept: list = None
    coefs: list = None


class ClippedSGD(torch.autograd.Function):
    """W'_i = W_i - lr * c_i * where(finite, g_i, 0): the clipped write, saving only g in the dtype it is
    exact in (`_ClipSpec.save_dtype`, bf16 for a bf16 model) and scalars.

    Forward, with n_i = ||g_i|| and n = ||(n_1, n_2, ...)|| (fp32 at least), finite = isfinite(n):
        global clip  c = min(1, M / (n + eps))         per-matrix clip  c_i = min(1, M / (n_i + eps))
        (n replaced by 0 when not finite, so c = 1 and the zeroed g writes nothing; no clip: c = 1)
    Backward, given a_i = dL/dW'_i (m = finite as 0/1):
        dL/dW_i = a_i
        dL/dg_j = -lr m (c a_j + (sum_i <a_i, g_i>) c'(n) g_j / n)     global
        dL/dg_j = -lr m (c_j a_j + <a_j, g_j> c'(n_j) g_j / n_j)       per matrix
        c'(x) = -M / (x + eps)^2 where M / (x + eps) <= 1 (the clip binds; clamp's own rule), else 0.
    Autograd's graph of the same expression keeps g and where(finite, g, 0) in fp32 (two fp32 copies of
    every fast matrix per update); this keeps one in the compute dtype. The backward is not itself
    differentiated (the meta-gradient differentiates the inner loss twice, this step once).
    """

    @staticmethod
    def forward(ctx, spec: _ClipSpec, *tensors):
        k = len(tensors) // 2
        ws, gs = tensors[:k], tensors[k:]
        acc = fast_weight_dtype(ws[0].dtype)  # fp32 at least (bf16 weights), fp64 in tests
        norms = [torch.linalg.vector_norm(g.to(acc)) for g in gs]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        finite = torch.isfinite(norm)
        safe = (lambda n: torch.where(finite, n, torch.zeros_like(n)))
        coefs: list = [None] * k
        if spec.max_norm > 0:
            if spec.per_matrix:
                coefs = [torch.clamp(spec.max_norm / (safe(n) + 1e-6), max=1.0) for n in norms]
            else:
                coefs = [torch.clamp(spec.max_norm / (safe(norm) + 1e-6), max=1.0)] * k
        spec.kept, new = [], []
        for w, g, c in zip(ws, gs, coefs):
            # kept in the dtype g is exact in (no W-sized fp32 buffer but the write's own); the write
            # takes a fresh fp32 copy and consumes it
            kept = torch.where(finite, g.to(spec.save_dtype), 0.0)
            spec.kept.append(kept)
            new.append(_write_into(kept.to(w.dtype, copy=True), w, c, spec.lr) if spec.values
                       else w.new_zeros(()).expand(w.shape))
        spec.norm, spec.finite, spec.coefs = norm.detach(), finite.detach(), coefs
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*spec.kept, safe(norm), *[safe(n) for n in norms], finite)
        return tuple(new)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        spec = ctx.spec
        k = len(grads)
        saved = ctx.saved_tensors
        kept, norm, norms, finite = saved[:k], saved[k], saved[k + 1:2 * k + 1], saved[-1]
        wants_g = ctx.needs_input_grad[1 + k:]
        if not any(wants_g):
            return (None, *grads, *([None] * k))
        acc = norm.dtype
        m = finite.to(acc)
        dgs: list = [None] * k
        # each dL/dg_j built in one fresh buffer (in-place arithmetic): at most one temporary at a time
        if spec.max_norm <= 0:
            dgs = [None if a is None else a.to(acc, copy=True).mul_(-spec.lr * m) for a in grads]
        else:
            def clip(n):
                x = spec.max_norm / (n + 1e-6)
                return torch.clamp(x, max=1.0), torch.where(x <= 1.0, -spec.max_norm / (n + 1e-6) ** 2, torch.zeros_like(n))

            def dot(a, g):
                return torch.zeros((), dtype=acc, device=g.device) if a is None else torch.dot(a.reshape(-1).to(acc), g.reshape(-1).to(acc))

            def combine(a, g, c, scale):  # -lr m (c a + scale g)
                dg = g.to(acc, copy=True).mul_(scale)
                if a is not None:
                    dg.add_(a.to(acc) * c) if a.dtype != acc else dg.addcmul_(a, c)
                return dg.mul_(-spec.lr * m)

            if spec.per_matrix:
                for j, (a, g, n) in enumerate(zip(grads, kept, norms)):
                    if a is None:
                        continue
                    c, dc = clip(n)
                    dgs[j] = combine(a, g, c, torch.where(n > 0, dot(a, g) * dc / n, torch.zeros_like(n)))
            elif any(a is not None for a in grads):
                c, dc = clip(norm)
                total = sum(dot(a, g) for a, g in zip(grads, kept))
                scale = torch.where(norm > 0, total * dc / norm, torch.zeros_like(norm))
                dgs = [combine(a, g, c, scale) for a, g in zip(grads, kept)]
        return (None, *grads, *[None if not want or d is None else d for d, want in zip(dgs, wants_g)])


def trainable_fast_weights(fast_matrices: str, num_weights: int) -> tuple[bool, ...]:
    """Which entries of a flat (gate, up, down) * L tuple the inner step updates."""
    if fast_matrices == "all":
        return (True,) * num_weights
    if fast_matrices == "down":
        return tuple(i % 3 == 2 for i in range(num_weights))
    raise ValueError(f"fast_matrices must be 'all' or 'down', got {fast_matrices!r}")


def inner_update(obs_loss_sum: torch.Tensor, num_obs: int, weights: FastWeights, ttt, *,
                 create_graph: bool, grad_dtype: torch.dtype | None = None,
                 taps: FactorTaps | None = None, values: bool = True) -> InnerStepResult:
    """One inner step as `ttt` configures it (loss reduction, clip, fast matrices): the one place the
    event loop and serving turn an observation's summed NLL into W' (so both compute the same step)."""
    loss = obs_loss_sum if ttt.inner_loss == "sum" else obs_loss_sum / num_obs
    return inner_sgd_step(loss, weights, lr=ttt.inner_lr, max_norm=ttt.inner_max_norm, create_graph=create_graph,
                          grad_dtype=grad_dtype, taps=taps, values=values,
                          per_matrix=ttt.inner_clip == "per_matrix",
                          trainable=trainable_fast_weights(ttt.fast_matrices, len(weights)), first_order=ttt.first_order)
