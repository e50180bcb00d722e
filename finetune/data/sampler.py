"""One data order for every training path: exactly `torch.utils.data.DistributedSampler`'s.

accelerate's `prepare(dataloader)` (and so the HF Trainer) deals whole batches of one batch sampler
round-robin to the ranks: rank r gets batches r, r + W, r + 2W, ... This batch sampler yields the
batches in the order that makes that deal hand rank r exactly what
`DistributedSampler(dataset, num_replicas=W, rank=r, shuffle, seed, drop_last)` with `set_epoch(e)`
yields, cut into micro-batches of `batch_size`. The indices come from torch's own DistributedSampler
(not a re-implementation), so the semantics cannot drift.

The uneven tail is DistributedSampler's: with `drop_last=False` the index list is padded by
repeating its start until every rank has ceil(N / W) indices (some samples are seen twice per epoch);
with `drop_last=True` the last N mod W indices are dropped. Each rank's last micro-batch may then be
shorter than `batch_size`; all ranks' last micro-batches have the same length, so no rank waits.

`repeat` > 1 (a method that trains several optimizer steps on one batch of generations: GRPO's --num_iterations)
yields each optimizer step's micro-batches (`accum` per rank) `repeat` times in a row, as TRL's RepeatSampler does;
the epoch's last step, when it has fewer than `accum` micro-batches per rank, is dropped (TRL drops an incomplete
generation batch too), so every repetition is a whole step.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DistributedSampler, Sampler


class _Length:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def rank_indices(n: int, world: int, rank: int, shuffle: bool, seed: int, drop_last: bool, epoch: int) -> list[int]:
    """The index stream DistributedSampler gives `rank` of `world` in `epoch`."""
    sampler = DistributedSampler(_Length(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


class _EpochHook:
    """accelerate's `DataLoaderShard.set_epoch` reaches a batch sampler it wrapped only through `.sampler.set_epoch`."""

    def __init__(self, order: "DistributedBatchOrder"):
        self.order = order

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)


class DistributedBatchOrder(Sampler[list[int]]):
    """Batch sampler for `DataLoader(batch_sampler=...)` before `accelerator.prepare`.

    It has no `batch_size` attribute on purpose: accelerate then treats every batch as complete and deals
    them round-robin, without the wrap-around padding it applies to short batches.
    """

    def __init__(self, n: int, world: int, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 repeat: int = 1, accum: int = 1, copies: int = 1):
        if n <= 0:
            raise ValueError("cannot sample from an empty data set")
        self.n, self.world, self.micro = n, world, batch_size
        self.repeat, self.accum = repeat, accum
        # Each batch `copies` times in a row: dealt round-robin over world x copies processes, consecutive ranks (a
        # sequence-parallel group, --sequence_parallel_size) get the same batch, and group g what rank g of `world`
        # would get.
        self.copies = copies
        self.shuffle, self.seed, self.drop_last_indices = shuffle, seed, drop_last
        self.drop_last = False  # read by accelerate: DataLoader-level drop_last; the tail policy is DistributedSampler's
        self.epoch = 0
        self.sampler = _EpochHook(self)
        if repeat > 1 and self.rounds() < accum:
            raise ValueError(f"{n} examples make {self.rounds()} micro-batches of {batch_size} per process, fewer than "
                             f"one optimizer step's {accum}: nothing to repeat")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def per_rank(self, rank: int) -> list[int]:
        return rank_indices(self.n, self.world, rank, self.shuffle, self.seed, self.drop_last_indices, self.epoch)

    def rounds(self) -> int:
        """Micro-batches per rank in an epoch (before any repetition)."""
        return -(-len(self.per_rank(0)) // self.micro)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self._batches():
            for _ in range(self.copies):
                yield batch

    def _batches(self) -> Iterator[list[int]]:
        streams = [self.per_rank(r) for r in range(self.world)]
        rounds = [[stream[start : start + self.micro] for stream in streams]
                  for start in range(0, len(streams[0]), self.micro)]
        if self.repeat == 1:
            for batches in rounds:
                yield from batches
            return
        for first in range(0, len(rounds) // self.accum * self.accum, self.accum):
            for _ in range(self.repeat):
                for batches in rounds[first : first + self.accum]:
                    yield from batches

    def __len__(self) -> int:
        if self.repeat == 1:
            return self.world * self.rounds() * self.copies
        return self.world * (self.rounds() // self.accum * self.accum) * self.repeat * self.copies


def distributed_dataloader(dataset, collate_fn, *, world: int, batch_size: int, shuffle: bool, seed: int,
                           drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False, repeat: int = 1,
                           accum: int = 1, persistent_workers: bool = False, copies: int = 1):
    """A DataLoader to hand to `accelerator.prepare` (the Trainer and the prepare() loop both use it). With
    `num_workers`, batches are collated in worker processes ahead of the step (packing itself is done once, before
    training, by finetune.data.pipeline)."""
    order = DistributedBatchOrder(len(dataset), world, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                  repeat=repeat, accum=accum, copies=copies)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=order, collate_fn=collate_fn, num_workers=num_workers, pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
    )
