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

    def __init__(self, n: int, world: int, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if n <= 0:
            raise ValueError("cannot sample from an empty data set")
        self.n, self.world, self.micro = n, world, batch_size
        self.shuffle, self.seed, self.drop_last_indices = shuffle, seed, drop_last
        self.drop_last = False  # read by accelerate: DataLoader-level drop_last; the tail policy is DistributedSampler's
        self.epoch = 0
        self.sampler = _EpochHook(self)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def per_rank(self, rank: int) -> list[int]:
        return rank_indices(self.n, self.world, rank, self.shuffle, self.seed, self.drop_last_indices, self.epoch)

    def __iter__(self) -> Iterator[list[int]]:
        streams = [self.per_rank(r) for r in range(self.world)]
        per_rank = len(streams[0])
        for start in range(0, per_rank, self.micro):
            for stream in streams:
                yield stream[start : start + self.micro]

    def __len__(self) -> int:
        per_rank = len(self.per_rank(0))
        return self.world * -(-per_rank // self.micro)


def distributed_dataloader(dataset, collate_fn, *, world: int, batch_size: int, shuffle: bool, seed: int,
                           drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False):
    """A DataLoader to hand to `accelerator.prepare` (the Trainer and the prepare() loop both use it)."""
    order = DistributedBatchOrder(len(dataset), world, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=order, collate_fn=collate_fn, num_workers=num_workers, pin_memory=pin_memory
    )
