"""Fast weights: the prime SwiGLU MLP and the differentiable inner SGD step.

The prime MLP's matrices are *explicit tensors* passed into the forward, so one trajectory can carry
its own evolving copy W_0 -> W_1 -> ... while the nn.Parameters hold the meta-learned initial W_0.

The inner step itself (W' = W - lr * clip(dL_obs/dW)) is ds_ttt/model/inner_step.py.

Precision. In a bf16 model an inner step moves each weight by far less than half a bf16 ulp
(Qwen3-8B recipe: ~2.7e-6 per element against weights of ~1e-2, whose ulp is ~6e-5), so
`w_bf16 - lr * g` rounds most of every update away. The inner loop therefore carries its fast
weights in fp32 (`inner_loop_weights`: an fp32 copy of W_0 per trajectory, differentiable back to the
bf16 W_0) and updates them in fp32. Casting the whole fp32 W back to bf16 for the matmul would round
the update away again, so the prime MLP splits each projection into the bf16 W_0 and the fp32 delta
W - W_0, which has its own exponent and survives the cast to the compute dtype:
    x W^T = x W_0^T + x (W - W_0)^T          (both matmuls in the compute dtype, summed in fp32)
fp32 and fp64 models take the single-matmul path unchanged.

Memory key with context (`TTTConfig.key_shift` = S > 0). The prime MLP's input at a token is its
key: one inner step stores "key -> what the observation loss wants there". In a small model that
input is mostly the current token, so a value whose tokens repeat (`3c27bea8dc` -> `3 c 2 7 be a 8
dc`) maps one key to several next tokens and cannot be stored exactly. A learned causal depthwise
token shift (RWKV's token shift, the short convolutions of Mamba / DeltaNet) gives the key local
context:
    u_t = x_t + sum_{j=1..S} a_j * x_{t-j}          (a_j in R^C, per channel; zero-initialized)
a_j are slow weights (trained by the outer loop, never by the inner step). With a = 0 the model
computes exactly what it computes without the shift. History stops at a segment boundary (a new
round under the `current_round` policy, so no round's key sees an earlier round) and at the start
of the sequence (zeros). Chunked execution (training events, serving decode) carries the last S
inputs of each adaptive layer between chunks in a `KeyHistory`; chunked and whole-sequence
execution give the same u.

Round address (`TTTConfig.round_address`). A value's first token follows `<tool_response>\n` in
every round, so the shifted key of a value is the same in every round: every value of a world is
written to one address. The command that produced the observation names what it is about (the
file, the key), and the `current_round` policy lets the key see it, because the command is part of
the round. So the key gains a term pooled over the round's tokens so far:
    s_t = c * tanh(q . x_t / c)                                   (c = ADDRESS_SCORE_CAP)
    a_t = sum_{j in round, j<=t} e^{s_j} x_j / sum_{j in round, j<=t} e^{s_j}
    u_t = (shifted) x_t + P a_t
with the learned query q in R^C (zero at init: a mean pool) and the projection P in R^{C x C}
(zero at init, so a fresh model computes exactly what it computes without the address). The
learned score lets the pool pick out the tokens that name the thing (a file's name) and ignore the
verbs, flags and template every round shares. The soft cap bounds e^{s} to [e^-c, e^c], so the sums
are accumulated in fp32 without a running maximum. The pool restarts at every round (the address
is the current round's) and needs the round boundaries, so it requires `current_round` (where the
key shift's history restarts at the same place). Chunked execution carries (sum e^s x, sum e^s) of
the open round in two more rows of the key state (`KeyHistory`, in fp32), after the S shift rows.

Write rate (`TTTConfig.write_rate`, like DeltaNet's beta or LaCT's learned lr). The inner loss weighs
each observation label by beta_t = 2 sigmoid(w . u_t + b), u_t the key of the first adaptive layer at
the position that predicts it (w, b zero at init: beta = 1, today's step bit for bit). In the first
adaptive layer the key does not depend on the fast weights, so beta is a slow-weight function of
the context only; the inner gradient does not flow through it. Only the inner loss is weighted (the
outer observation term is not).

Per-row fast weights (serving many sessions in one batch): a fast weight of shape [B, F, D] applies
its row b to batch row b (`linear`); [F, D] applies to every row.

Shape letters: B batch, T tokens, D (= C) hidden, F prime width, S key-state width (shift rows + 2
address rows).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FastWeights = tuple[torch.Tensor, ...]  # flat (gate_FD, up_FD, down_DF) per adaptive layer, in layer order
ADDRESS_SCORE_CAP = 8.0  # the round address's soft cap on its pool scores (see the module docstring)
ADDRESS_ROWS = 2  # key-state rows of the round address: sum e^s x, then sum e^s (in every channel)


def fast_weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the inner loop carries fast weights in: fp32 at least (fp64 stays fp64 in tests)."""
    return torch.promote_types(dtype, torch.float32)


def inner_loop_weights(weights: FastWeights, *, differentiable: bool,
                       trainable: tuple[bool, ...] | None = None) -> FastWeights:
    """Per-trajectory fp32 (at least) copies of W_0 for the inner loop, ready for `torch.autograd.grad`.

    differentiable=True (meta-training): a differentiable cast, so the meta-gradient reaches the
    (bf16) W_0 parameters; an fp32 W_0 that requires grad is used as is. Otherwise (evaluation,
    serving): detached leaf copies that require grad only for the inner gradient.
    trainable: which entries the inner step updates (None = all; see `trainable_fast_weights`). The
    others are returned as they are (W_0 in the compute dtype): nothing is cast, copied or multiplied
    for a matrix that is not fast, and the prime MLP uses it with one plain matmul.
    """
    trainable = trainable or (True,) * len(weights)
    out = []
    for w, fast in zip(weights, trainable):
        if not fast:
            out.append(w if differentiable else w.detach())
        elif differentiable and w.requires_grad:
            out.append(w.to(fast_weight_dtype(w.dtype)))
        else:
            out.append(w.detach().to(fast_weight_dtype(w.dtype), copy=True).requires_grad_(True))
    return tuple(out)


def linear(x_BTD: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T for a shared W [F, D] or per-row W [B, F, D] (row b of x uses W[b])."""
    if w.dim() == 2:
        return F.linear(x_BTD, w)
    return torch.matmul(x_BTD, w.transpose(-1, -2))


def prime_mlp(x: torch.Tensor, gate_FD: torch.Tensor, up_FD: torch.Tensor, down_DF: torch.Tensor) -> torch.Tensor:
    """SwiGLU: down(silu(gate x) * up x)."""
    return linear(F.silu(linear(x, gate_FD)) * linear(x, up_FD), down_DF)


def split_linear(x: torch.Tensor, w0: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T for a high-precision W near the compute-dtype W_0: x W_0^T + x (W - W_0)^T, summed in fp32.

    W - W_0 is exact in fp32 (Sterbenz) and keeps its relative precision when cast to x's dtype.
    W may be per-row ([B, F, D]; W_0 is always the shared [F, D]): the base product is one batched
    matmul, the delta is applied per row (the Punica / S-LoRA layout).
    """
    delta = (w - w0.to(w.dtype)).to(x.dtype)
    acc = fast_weight_dtype(x.dtype)
    return (F.linear(x, w0).to(acc) + linear(x, delta).to(acc)).to(x.dtype)


def fast_linear(x: torch.Tensor, w0: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T: `split_linear` for a high-precision fast W, one plain matmul for a W in x's dtype (W_0
    itself, or a model computing in W's dtype). Records (x, x W^T) when a FactorTaps is listening for W."""
    y = linear(x, w) if w.dtype == x.dtype else split_linear(x, w0, w)
    taps = _LISTENING.get()
    if taps is not None:
        taps.record(w, x, y)
    return y


class FactorTaps:
    """The inputs and outputs of the fast matrices in one forward, for the inner gradient in factors.

    For y = x W^T over n tokens, dL/dW = (dL/dy)^T x: the product of an [n, out] and an [n, in]
    factor. A checkpointed event stores an update as these two factors whenever they are smaller than
    the matrix (n (in + out) < in x out: rounds shorter than 410 tokens for hidden 512 / width 2048,
    3,072 for Qwen3-8B's 4096 / 12288), and rebuilds the gradient from them (event_checkpoint.py).
    In a bf16 model dL/dy is the bf16 gradient of the bf16 output of `split_linear`'s delta branch
    (the casts around it are exact both ways), x the bf16 input: both are exact in bf16.

        with FactorTaps(ws) as taps: out = forward(...)      # taps.pairs[i] = (x, y) of ws[i]
    """

    def __init__(self, weights: FastWeights):
        self._slot = {id(w): i for i, w in enumerate(weights)}
        self.pairs: list = [None] * len(weights)
        self._token = None

    def record(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        i = self._slot.get(id(w))
        if i is not None:
            self.pairs[i] = (x, y)

    def __enter__(self) -> "FactorTaps":
        self._token = _LISTENING.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _LISTENING.reset(self._token)


_LISTENING: contextvars.ContextVar[FactorTaps | None] = contextvars.ContextVar("ds_ttt_factor_taps", default=None)


def factor_product(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(dL/dy)^T x of a linear y = x W^T: [..., n, out] and [..., n, in] -> [out, in], in their dtype."""
    return dy.reshape(-1, dy.shape[-1]).transpose(0, 1) @ x.reshape(-1, x.shape[-1])


@dataclass
class KeyHistory:
    """The key state of one adaptive layer for one chunk of tokens (see the module docstring).

    prev_BSC: in, the state before the chunk (None = zeros: a fresh sequence or segment): the S
        prime-MLP inputs right before it, oldest first, then with the round address its 2 pool rows.
    segments_BT: in, a segment id per token of the chunk (history stops where it changes; None = one
        segment, continuing prev). last_BSC: out, set by the layer: the state after the chunk's last
        token (the next chunk's prev_BSC). write_rate_BT: out, set by a layer with a write rate: beta
        per token of the chunk (fp32).
    """

    prev_BSC: torch.Tensor | None = None
    segments_BT: torch.Tensor | None = None
    last_BSC: torch.Tensor | None = None
    write_rate_BT: torch.Tensor | None = None


def shift_keys(x_BTC: torch.Tensor, shift_SC: torch.Tensor, history: KeyHistory | None) -> torch.Tensor:
    """u_t = x_t + sum_j shift[j-1] * x_{t-j} within a segment; sets `history.last_BSC` when given."""
    b, t, c = x_BTC.shape
    s = shift_SC.shape[0]
    prev = history.prev_BSC if history is not None else None
    if prev is None:
        prev = x_BTC.new_zeros(b, s, c)
    x_ext = torch.cat([prev.to(x_BTC.dtype), x_BTC], 1)  # [B, S+T, C]: prev rows continue the first token's segment
    seg = history.segments_BT if history is not None else None
    keep = None
    if seg is not None:
        seg_ext = torch.cat([seg[:, :1].expand(b, s), seg], 1)
    u = x_BTC
    for j in range(1, s + 1):
        past = x_ext[:, s - j: s - j + t]
        if seg is not None:
            keep = (seg_ext[:, s - j: s - j + t] == seg).unsqueeze(-1)
            past = past * keep.to(past.dtype)
        u = u + shift_SC[j - 1].to(x_BTC.dtype) * past
    if history is not None:
        last = x_ext[:, -s:]
        if seg is not None:
            last = last * (seg_ext[:, -s:] == seg[:, -1:]).unsqueeze(-1).to(last.dtype)
        history.last_BSC = last
    return u


def round_address(x_BTC: torch.Tensor, query_C: torch.Tensor, prev_B2C: torch.Tensor | None,
                  segments_BT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The round address's pool a_t (module docstring) in fp32 at least, and the state after the last
    token, [B, 2, C]: (sum e^s x, sum e^s) of its segment. `prev_B2C` continues the first token's
    segment (None = zeros); with `segments_BT`, every later segment starts from zero."""
    acc = fast_weight_dtype(x_BTC.dtype)
    b, t, c = x_BTC.shape
    xs = x_BTC.to(acc)
    score = ADDRESS_SCORE_CAP * torch.tanh(xs @ query_C.to(acc) / ADDRESS_SCORE_CAP)  # [B, T]
    e = torch.exp(score)
    if segments_BT is None:
        num, den = torch.cumsum(e.unsqueeze(-1) * xs, 1), torch.cumsum(e, 1)
        first = None
    else:  # segment-local prefix sums: a difference of prefix sums, taken in fp64 so no precision is lost
        wide = torch.promote_types(acc, torch.float64)
        cn = F.pad(torch.cumsum((e.unsqueeze(-1) * xs).to(wide), 1), (0, 0, 1, 0))  # [B, T+1, C], row 0 = 0
        cd = F.pad(torch.cumsum(e.to(wide), 1), (1, 0))
        starts = torch.zeros_like(segments_BT, dtype=torch.long)
        idx = torch.arange(1, t, device=x_BTC.device).expand(b, t - 1)
        starts[:, 1:] = torch.where(segments_BT[:, 1:] != segments_BT[:, :-1], idx, 0)
        starts = torch.cummax(starts, 1).values  # each token's segment start
        num = (cn[:, 1:] - cn.gather(1, starts.unsqueeze(-1).expand(b, t, c))).to(acc)
        den = (cd[:, 1:] - cd.gather(1, starts)).to(acc)
        first = starts == 0  # the tokens that continue prev's segment
    if prev_B2C is not None:
        prev = prev_B2C.to(acc)
        keep = torch.ones_like(den) if first is None else first.to(acc)
        num = num + keep.unsqueeze(-1) * prev[:, :1]
        den = den + keep * prev[:, 1, :1]
    last = torch.stack([num[:, -1], den[:, -1:].expand(b, c)], 1)
    return num / den.unsqueeze(-1), last


class PrimeMLP(nn.Module):
    """Holds the initial fast weights W_0 under Qwen3-style names (gate_proj/up_proj/down_proj), and the
    slow weights of its key: the token shift, the round address and the write rate (all zero at init).

    down_proj starts at zero, so an untrained TTT model computes exactly what the base Qwen3 computes.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, key_shift: int = 0, *,
                 round_address: bool = False, write_rate: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # the memory key's learned token shift (a slow weight; zero = no shift), HF name `...prime_mlp.key_shift`
        self.key_shift = nn.Parameter(torch.zeros(key_shift, hidden_size)) if key_shift > 0 else None
        # the round address: `...prime_mlp.address_query` (q, [C]) and `...prime_mlp.address_proj` (P, [C, C]);
        # plain zero Parameters, not nn.Linear: building them draws no random numbers, so every other
        # weight of a seeded model is initialised as without them
        self.address_query = nn.Parameter(torch.zeros(hidden_size)) if round_address else None
        self.address_proj = nn.Parameter(torch.zeros(hidden_size, hidden_size)) if round_address else None
        # the write rate beta = 2 sigmoid(w . u + b): `...prime_mlp.write_rate` (w, [C]) and
        # `...prime_mlp.write_rate_bias` (b, [1]); first adaptive layer only
        self.write_rate = nn.Parameter(torch.zeros(hidden_size)) if write_rate else None
        self.write_rate_bias = nn.Parameter(torch.zeros(1)) if write_rate else None
        self.zero_slow_weights()

    @torch.no_grad()
    def zero_slow_weights(self) -> None:
        """The init that makes the layer compute exactly what the base model computes: the down
        projection, the key shift, the address query/projection and the write rate at zero."""
        self.down_proj.weight.zero_()
        for p in (self.key_shift, self.address_query, self.address_proj, self.write_rate, self.write_rate_bias):
            if p is not None:
                p.zero_()

    @property
    def shift_width(self) -> int:
        return 0 if self.key_shift is None else self.key_shift.shape[0]

    @property
    def key_state_width(self) -> int:
        """Rows of the key state carried between chunks: the shift's S, plus the address's 2."""
        return self.shift_width + (ADDRESS_ROWS if self.address_query is not None else 0)

    @property
    def has_key_io(self) -> bool:
        """Does the key read or write a KeyHistory (a state to carry, or the write rate to report)?"""
        return self.key_state_width > 0 or self.write_rate is not None

    def empty_key_state(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        """Zeros of the key state: like's dtype for a shift alone (as before), fp32 at least with the
        address (its pool sums)."""
        dtype = fast_weight_dtype(like.dtype) if self.address_query is not None else like.dtype
        return like.new_zeros(batch, self.key_state_width, like.shape[-1], dtype=dtype)

    def key(self, x_BTC: torch.Tensor, history: KeyHistory | None = None) -> torch.Tensor:
        """The MLP's input with its key context (identity without a key shift or round address); sets
        `history.last_BSC` (the state) and `history.write_rate_BT` when the layer has them."""
        if not self.has_key_io:
            return x_BTC
        s = self.shift_width
        prev = history.prev_BSC if history is not None else None
        seg = history.segments_BT if history is not None else None
        parts = []
        u = x_BTC
        if self.key_shift is not None:
            shift_hist = KeyHistory(prev_BSC=None if prev is None else prev[:, :s], segments_BT=seg)
            u = shift_keys(x_BTC, self.key_shift, shift_hist)
            parts.append(shift_hist.last_BSC)
        if self.address_query is not None:
            pooled, last = round_address(x_BTC, self.address_query, None if prev is None else prev[:, s:], seg)
            u = u + F.linear(pooled.to(x_BTC.dtype), self.address_proj)
            parts = [p.to(last.dtype) for p in parts] + [last]
        if history is not None:
            history.last_BSC = torch.cat(parts, 1) if parts else x_BTC.new_zeros(x_BTC.shape[0], 0, x_BTC.shape[-1])
            if self.write_rate is not None:
                acc = fast_weight_dtype(u.dtype)
                history.write_rate_BT = 2 * torch.sigmoid(
                    F.linear(u.to(acc), self.write_rate.to(acc)[None], self.write_rate_bias.to(acc)).squeeze(-1))
        return u

    def initial_weights(self) -> FastWeights:
        return (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)

    def forward(self, x: torch.Tensor, weights: FastWeights | None = None) -> torch.Tensor:
        if weights is None:
            return prime_mlp(x, *self.initial_weights())
        # fp32 fast weights in a low-precision model take split_linear (see the module docstring); a
        # matrix in the compute dtype (not fast: W_0 itself; or an fp32 model) one plain matmul
        gate0, up0, down0 = self.initial_weights()
        gate, up, down = weights
        h = F.silu(fast_linear(x, gate0, gate)) * fast_linear(x, up0, up)
        return fast_linear(h, down0, down)
