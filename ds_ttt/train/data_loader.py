"""Deterministic, resumable micro-batches of rendered trajectories for the pipeline engine.

Order: epoch e uses a permutation of the train split seeded by (seed, e); step k of the stage takes
the next `train_batch_size` trajectories. Within a global batch the trajectories are sorted by length
(bucketing: similar lengths share a micro-batch) and dealt to micro-batches, longest first; the
data-parallel ranks take them in serpentine order, so that each rank's share of the work is alike: in
accumulation round g rank d takes micro-batch g * dp + d when g is even and g * dp + (dp - 1 - d) when g
is odd (dp 2, accumulation 2: rank 0 the longest and the shortest, rank 1 the two between; dealt d,
d + dp, ... rank 0 held the longer of every pair and rank 1 waited for it at the gradient all-reduce,
about 9% of the token work). The cursor is simply the stage step, so resuming at step k
reproduces exactly the batches an uninterrupted run would see (every rank computes the same order).
Which trajectories step k draws depends on train_batch_size, the seed and the train split only, never
on the layout (micro-batch, accumulation, dp size): each rank takes its slice of the same global batch,
so a run moved to another layout continues on the same data (ds_ttt/train/layout_move.py).

Padding: right padding to a multiple of `bucket` tokens (capped at the capacity), token id 0,
kind -1 (no loss, and the event loop stops at the first pad), round id = the row's last round (round
ids stay non-decreasing and a padded query always sees itself, so no attention row is fully masked).
Right padding changes no loss and no gradient (tests/unit/test_train_pipeline_layers.py): real
queries never see later positions under any context policy.

Each item is DeepSpeed's `(inputs, labels)`: inputs = (input_ids_BT, kinds_BT, rounds_BT) int64 for
stage 0; labels is a placeholder for the last stage (the loss is computed inside the last stage).

Shape letters: B micro-batch, T padded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ds_ttt.data.token_kind import TokenKind

PAD_ID = 0


@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: Sequence[int]
    kinds: Sequence[int]
    rounds: Sequence[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def collate(rows, *, bucket: int, capacity: int):
    """rows: Samples or (ids, kinds, rounds) triples -> right-padded int64 (ids, kinds, rounds) [B, T]."""
    rows = [(r.input_ids, r.kinds, r.rounds) if isinstance(r, Sample) else r for r in rows]
    longest = max(len(r[0]) for r in rows)
    t = min(-(-longest // bucket) * bucket, max(capacity, longest))
    ids = torch.full((len(rows), t), PAD_ID, dtype=torch.long)
    kinds = torch.full((len(rows), t), TokenKind.PAD, dtype=torch.long)
    rounds = torch.zeros((len(rows), t), dtype=torch.long)
    for b, (i, k, r) in enumerate(rows):
        n = len(i)
        ids[b, :n] = torch.as_tensor(i)
        kinds[b, :n] = torch.as_tensor(k)
        rounds[b, :n] = torch.as_tensor(r)
        rounds[b, n:] = r[-1]
    return ids, kinds, rounds


def samples_from_manifest(manifest, split: str = "train") -> list[Sample]:
    """Rendered, capacity-filtered trajectories of a split, in the manifest's (id) order."""
    return [Sample(r.id, list(r.input_ids), list(r.kinds), list(r.rounds)) for r in manifest.rendered(split)]


class TrajectoryBatches:
    def __init__(self, samples: Sequence[Sample] | None, *, num_samples: int, train_batch_size: int, micro_batch_size: int,
                 gradient_accumulation_steps: int, dp_rank: int, dp_size: int, seed: int, bucket: int,
                 capacity: int):
        assert train_batch_size == micro_batch_size * gradient_accumulation_steps * dp_size
        # Only ranks that load data (first and last stage) need the samples; the order needs only the count.
        self.samples = list(samples) if samples is not None else None
        if self.samples is not None and len(self.samples) != num_samples:
            raise ValueError(f"{len(self.samples)} rendered trajectories, the manifest lists {num_samples}")
        self.num_samples = num_samples
        self.global_batch = train_batch_size
        self.micro = micro_batch_size
        self.gas = gradient_accumulation_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.bucket, self.capacity = seed, bucket, capacity
        self.steps_per_epoch = num_samples // train_batch_size
        if self.steps_per_epoch < 1:
            raise ValueError(f"{num_samples} trajectories < train_batch_size={train_batch_size}")
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_samples, generator=g).tolist(), epoch
        return self._perm

    def step_micro_batches(self, step: int) -> list[list[Sample]]:
        """All micro-batches of stage step `step` (0-based), longest first; rank_micro_batches deals them."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        idx = self._permutation(epoch)[pos * self.global_batch:(pos + 1) * self.global_batch]
        idx.sort(key=lambda i: (-len(self.samples[i]), i))
        rows = [self.samples[i] for i in idx]
        return [rows[m * self.micro:(m + 1) * self.micro] for m in range(self.gas * self.dp_size)]

    def rank_micro_batches(self, step: int) -> list[list[Sample]]:
        """This rank's `gas` micro-batches of stage step `step`, dealt in serpentine order (module docstring)."""
        mbs, dp, d = self.step_micro_batches(step), self.dp_size, self.dp_rank
        return [mbs[g * dp + (d if g % 2 == 0 else dp - 1 - d)] for g in range(self.gas)]

    def iterate(self, start_step: int) -> Iterator:
        """DeepSpeed data iterator from stage step `start_step` on (gas items per optimizer step)."""
        step = start_step
        while True:
            for rows in self.rank_micro_batches(step):
                yield collate(rows, bucket=self.bucket, capacity=self.capacity), torch.zeros(1)
            step += 1
