"""The outer objective of one optimizer step: token-weighted over the whole global batch.

    loss_step = sum(action NLL) / N_action + obs_loss_weight * sum(obs NLL) / N_obs

where the sums and the counts run over every action (observation) label of the global batch: all
micro-batches of all data-parallel ranks. A trajectory with 500 action tokens weighs 100 times one
with 5 (a mean of per-micro-batch means would weigh them alike).

The counts are taken once per step before the forward, on the host, from the batch's token kinds
(`count_loss_tokens`, the event loop's own label rule) and summed over the data-parallel ranks with
one all-reduce (torchtitan's approach: the normaliser is known before any loss is computed, so each
micro-batch's contribution is final when it is computed and nothing is re-weighted afterwards).

DeepSpeed then averages: the backward of each micro-batch loss is divided by the accumulation steps
G, and the data-parallel all-reduce divides by dp. So micro-batch m returns

    loss_m = G * dp * (sum_m(action NLL) / N_action + w * sum_m(obs NLL) / N_obs)

whose gradient, averaged that way, is exactly d loss_step; the engine's reported loss (the mean of
loss_m over micro-batches and ranks) is loss_step itself.

    from ds_ttt.train.objective import StepObjective
    objective = StepObjective.for_step(rank_micro_batches, ttt, loss_scale=G * dp, dp_group=group)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_ttt.config import TTTConfig
from ds_ttt.data.token_kind import TokenKind
from ds_ttt.model.event_loop import observation_labels


def count_loss_tokens(kinds_BT: torch.Tensor, rounds_BT: torch.Tensor, *, obs_loss_with_end: bool) -> tuple[int, int]:
    """(action labels, observation-loss labels) of a right-padded batch, by the event loop's rule:
    label t predicts token t+1 (t < n-1, n = the row's real length), an action label is one whose
    token is an action, the observation labels of each round are `observation_labels` of that
    round's label kinds (rounds split where the round id changes)."""
    num_action = num_obs = 0
    kinds_BT, rounds_BT = kinds_BT.cpu(), rounds_BT.cpu()  # host tensors from the data loader: no device sync
    for kinds, rounds in zip(kinds_BT, rounds_BT):
        n = int((kinds != TokenKind.PAD).sum())
        label_kinds = kinds[1:n]
        num_action += int((label_kinds == TokenKind.ACTION).sum())
        starts = [0] + (torch.nonzero(rounds[1:n] != rounds[:n - 1]).squeeze(1) + 1).tolist()
        for start, end in zip(starts, starts[1:] + [n]):
            lk = label_kinds[start:min(end, n - 1)]
            num_obs += int(observation_labels(lk, with_end=obs_loss_with_end).sum())
    return num_action, num_obs


@dataclass(frozen=True)
class StepObjective:
    """The normalisers of one optimizer step (global token counts) and DeepSpeed's averaging factor."""

    num_action_tokens: int  # over the global batch (all micro-batches, all dp ranks)
    num_obs_tokens: int
    obs_loss_weight: float
    loss_scale: float  # gradient_accumulation_steps x dp: undoes DeepSpeed's averaging

    @classmethod
    def for_step(cls, micro_batches, ttt: TTTConfig, *, loss_scale: float, dp_group=None) -> "StepObjective":
        """From this rank's micro-batches of the step (each `(ids, kinds, rounds)` [B, T]); the counts
        are summed over `dp_group` (one all-reduce; None = no data parallelism)."""
        counts = [0, 0]
        for _, kinds, rounds in micro_batches:
            a, o = count_loss_tokens(kinds, rounds, obs_loss_with_end=ttt.obs_loss_with_end)
            counts[0] += a
            counts[1] += o
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            t = torch.tensor(counts, dtype=torch.int64,
                             device="cuda" if dist.get_backend(dp_group) == "nccl" else "cpu")
            dist.all_reduce(t, group=dp_group)
            counts = t.tolist()
        return cls(num_action_tokens=counts[0], num_obs_tokens=counts[1], obs_loss_weight=ttt.obs_loss_weight,
                   loss_scale=float(loss_scale))

    def step_loss(self, action_loss_sum: torch.Tensor, obs_loss_sum: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of loss_step (unscaled): its NLL sums over the global counts."""
        loss = action_loss_sum / max(self.num_action_tokens, 1)
        if self.obs_loss_weight > 0:
            loss = loss + self.obs_loss_weight * obs_loss_sum / max(self.num_obs_tokens, 1)
        return loss

    def micro_batch_loss(self, action_loss_sum: torch.Tensor, obs_loss_sum: torch.Tensor) -> torch.Tensor:
        """What the last stage returns to DeepSpeed for one micro-batch (see the module docstring)."""
        return self.loss_scale * self.step_loss(action_loss_sum, obs_loss_sum)
