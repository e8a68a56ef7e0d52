"""Per-event checkpointing of the inner loop that keeps no dense copy of the fast weights per event.

The inner loop carries W_0 -> W_1 -> ... -> W_E through the events of a trajectory, W_r = W_{r-1} -
lr * clip(g_r), with every later action's loss differentiated through every update (the meta-gradient).
Checkpointing the events one by one (recompute each event's activations in the backward) still keeps
what each event's recompute needs: its inputs. With torch's checkpoint those inputs are the dense fp32
W_{r-1} of every event, one fp32 copy of every fast matrix per event, and it is most of the memory at
long context (docs/training.md, "Memory at long context").

What this module keeps instead, per event, is only the update: the gradient g_r, stored in the
compute dtype (bf16 for Qwen3-8B), and its clip factor (a scalar). That loses nothing: a fast matrix
enters the forward only as the bf16 delta (W - W_0).to(bf16) of `split_linear`, so its gradient is a
bf16 tensor cast up, exact in bf16. `FastWeightChain` rebuilds any W_r from W_0 (the parameters,
cast up) and the stored updates, applying them in the forward's own order with the forward's own
function (`apply_update`); the forward itself advances its W from the same stored updates. So the
W_r a backward rebuilds is, bit for bit, the W_r its forward used.

`EventFunction` is the checkpoint: an autograd.Function whose forward runs one event with its real
graph (so the inner `torch.autograd.grad` needs no recompute: each event's forward runs once in the
forward pass) and keeps nothing of that graph; its inputs for the fast matrices are the previous
event's stand-ins, zero-storage tensors of the right shape (`expand` of one scalar) that carry the
gradient dL/dW_{r-1} between events. Its backward rebuilds W_{r-1}, reruns the event with
create_graph=True (the inner step differentiable), and back-propagates into it the gradients of its
outputs: dL/dW_r for the weights it produced, the later events' gradients of its keys/values and key
state, and the outer loss's of its action and observation sums. The gradient of W_{r-1} it returns
is dense: the running fp32 adjoint of the chain, one copy alive at a time (plus the incoming one).
The trainable parameters the event reads (W_0 in the compute dtype, the key's slow weights, the norms,
the LM head) are inputs of the Function too, and their gradients are among what it returns: so
`torch.autograd.grad` with respect to a parameter works through it, and `.backward()` accumulates
`.grad` as it does anywhere else (unlike reentrant checkpointing, which writes `.grad` from inside).

Cost: rebuilding W_{r-1} in the backward applies r - 1 stored updates (E^2 / 2 elementwise updates
of the fast matrices for E events, memory-bound and small beside an event's matmuls).

Shape letters: F prime width, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ds_ttt.model.fast_weights import FastWeights, factor_product, fast_weight_dtype
from ds_ttt.model.inner_step import apply_update


@dataclass
class StepOut:
    """What one event's step returns (event_loop.py builds it)."""

    weights: FastWeights  # W_r (every matrix; the fast ones in the graph from W_{r-1} when differentiable)
    updates: list  # per inner step its InnerStepResult; [] when the event does not update
    new_kv: list  # this event's keys and values, per layer (k, v, k, v, ...)
    key_last: list  # the key state after the event, per key-state layer
    act_sum: torch.Tensor
    obs_sum: torch.Tensor
    skipped: torch.Tensor  # 0-dim int64
    extras: tuple = ()  # record=True only: per-label NLL and argmax (never checkpointed)


class FastWeightChain:
    """W_0 of one trajectory and every event's stored update; W_r rebuilt on demand, bit for bit.

    initial: the flat (gate, up, down) per adaptive layer the inner loop starts from (the parameters,
    in the compute dtype, or a caller's W_0); only references are kept. fast: which entries change.
    """

    def __init__(self, initial: FastWeights, fast: Sequence[bool], lr: float):
        # the matrices that are not fast are used as they are (a parameter keeps its gradient path);
        # the fast ones only as the start of the rebuild
        self.initial = tuple(w.detach() if f else w for w, f in zip(initial, fast))
        self.fast = tuple(fast)
        self.lr = lr
        self.events: list[list[tuple[tuple, tuple]]] = []  # per event, per inner step: (kept, coefs)
        self.current = self._start()  # W_{len(events)}: what the next event's forward uses

    @property
    def fast_index(self) -> list[int]:
        return [i for i, f in enumerate(self.fast) if f]

    def _start(self) -> FastWeights:
        return tuple(w.to(fast_weight_dtype(w.dtype)) if f else w for w, f in zip(self.initial, self.fast))

    def _apply(self, ws: FastWeights, steps) -> FastWeights:
        for kept, coefs in steps:
            ws = tuple(w if k is None else apply_update(w, _gradient(k), c, self.lr) for w, k, c in zip(ws, kept, coefs))
        return ws

    def weights(self, r: int) -> FastWeights:
        """W_r: W_0 with the updates of events 0..r-1 applied in the forward's order."""
        ws = self._start()
        for steps in self.events[:r]:
            ws = self._apply(ws, steps)
        return ws

    def push(self, results, compute_dtype: torch.dtype) -> None:
        """Store one event's inner steps (InnerStepResults) and advance `current` with the stored values,
        so the forward's W_r is the W_r a backward rebuilds. Per updated matrix the smaller of the
        gradient's two factors (dL/dy, x) and the gradient itself (FactorTaps), in the compute dtype:
        exact either way (see the module docstring)."""
        steps = []
        for res in results:
            finite = ~res.skipped.detach()
            kept = []
            for i, g in enumerate(res.grads):
                f = res.factors[i] if res.factors else None
                if g is None:
                    kept.append(None)
                elif f is not None and f[0].numel() + f[1].numel() < g.numel():
                    kept.append((f[0].to(compute_dtype), f[1].to(compute_dtype), finite))
                else:
                    kept.append(g.detach().to(compute_dtype))
            steps.append((tuple(kept), tuple(None if c is None else c.detach() for c in res.coefs)))
        self.events.append(steps)
        self.current = self._apply(self.current, steps)

    def stored_bytes(self) -> int:
        """Bytes of the stored updates (the chain's whole per-event cost)."""
        total = 0
        for steps in self.events:
            for kept, _ in steps:
                for k in kept:
                    for t in (k if isinstance(k, tuple) else (k,)):
                        if t is not None:
                            total += t.numel() * t.element_size()
        return total


def _gradient(kept) -> torch.Tensor:
    """A stored update's gradient: the dense tensor, or its factors' product (zero when it was skipped)."""
    if not isinstance(kept, tuple):
        return kept
    dy, x, finite = kept
    return torch.where(finite, factor_product(dy, x), 0.0)


@dataclass
class EventRun:
    """One event of the checkpointed loop: its step, the trajectory's chain, its index, and how the
    Function's flat tensor inputs split (h, the fast stand-ins, the keys/values, the key states)."""

    step: Callable[..., StepOut]  # step(h, ws, kvs, tails, differentiable, values=True) -> StepOut
    chain: FastWeightChain
    index: int  # r: the event uses W_r, the chain holds the updates of events 0..r-1
    num_kv: int
    num_tails: int
    params: list  # the trainable parameters the step reads (inputs, so their gradients are returned)
    needs_grad: list = field(default_factory=list)  # per saved input (h, kvs, tails): did it require grad


class EventFunction(torch.autograd.Function):
    """One checkpointed event: (h, *fast stand-ins, *kvs, *tails, *params) -> (*fast stand-ins of W_r,
    *new kvs, *key states, act_sum, obs_sum, skipped). See the module docstring."""

    @staticmethod
    def forward(ctx, run: EventRun, h, *tensors):
        num_fast = len(run.chain.fast_index)
        kvs = tensors[num_fast:num_fast + run.num_kv]
        tails = tensors[num_fast + run.num_kv:num_fast + run.num_kv + run.num_tails]
        ctx.run = run
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, *kvs, *tails)
        run.needs_grad = [t.requires_grad for t in (h, *kvs, *tails)]
        assert run.index == len(run.chain.events), "events must run in order"
        with torch.enable_grad():  # the event's own graph, for the inner gradient only (freed on return)
            ws = _leaves(run.chain, run.chain.current)
            out = run.step(h.detach(), ws, [t.detach() for t in kvs], [t.detach() for t in tails], False)
        run.chain.push(out.updates, h.dtype)
        stand_ins = [_stand_in(run.chain.current[i]) for i in run.chain.fast_index]
        return (*stand_ins, *[t.detach() for t in out.new_kv], *[t.detach() for t in out.key_last],
                out.act_sum.detach(), out.obs_sum.detach(), out.skipped)

    @staticmethod
    def backward(ctx, *grads):
        run = ctx.run
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip(saved, run.needs_grad)]
        h, kvs, tails = inputs[0], inputs[1:1 + run.num_kv], inputs[1 + run.num_kv:]
        ws = _leaves(run.chain, run.chain.weights(run.index))
        fast = run.chain.fast_index
        with torch.enable_grad():
            out = run.step(h, ws, kvs, tails, True, False)  # W_r only receives its gradient: no value
            outs = [out.weights[i] for i in fast] + list(out.new_kv) + list(out.key_last) + [out.act_sum, out.obs_sum]
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wrt = [t for t in (h, *[ws[i] for i in fast], *kvs, *tails, *run.params)]
            wanted = [t for t in wrt if t.requires_grad]
            got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                       if pairs and wanted else [None] * len(wanted))
        del out, outs, pairs
        return (None, *[next(got) if t.requires_grad else None for t in wrt])


def _leaves(chain: FastWeightChain, ws: FastWeights) -> FastWeights:
    """The fast entries as fresh leaves that require grad (the inner gradient's variables); the others
    (W_0 parameters) as they are."""
    return tuple(w.detach().requires_grad_(True) if f else w for w, f in zip(ws, chain.fast))


def _stand_in(w: torch.Tensor) -> torch.Tensor:
    """A tensor of w's shape, dtype and device with no storage of its own: what carries W_r between
    checkpointed events in the autograd graph (its gradient is dense)."""
    return w.new_zeros(()).expand(w.shape)
