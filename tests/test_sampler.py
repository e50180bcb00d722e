"""The prepare() path's data sharding is exactly torch.utils.data.DistributedSampler's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.data.sampler import DistributedBatchOrder, rank_indices
from launch import launcher, run
from torch.utils.data import DistributedSampler

BATCH, EPOCHS, SEED = 3, 3, 17


def reference(n: int, world: int, rank: int, shuffle: bool, drop_last: bool, epoch: int) -> list[int]:
    sampler = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_prepare_path_index_streams_equal_distributed_sampler(world, tmp_path):
    # Lengths divisible by world x batch, and not (a short tail, and an uneven split over ranks).
    lengths = [world * BATCH * 4, world * BATCH * 4 + 1, world * BATCH * 4 + world * BATCH - 1]
    worker = str(Path(__file__).parent / "sampler_worker.py")
    cmd = launcher("accelerate", world, script=worker) + [str(tmp_path), str(BATCH), str(EPOCHS), ",".join(map(str, lengths))]
    run(cmd, timeout=240).check()
    for rank in range(world):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["world"] == world  # some launcher flags silently start one process
        for n in lengths:
            for shuffle in (True, False):
                for drop_last in (True, False):
                    epochs = got["streams"][f"{n},{int(shuffle)},{int(drop_last)}"]
                    assert len(epochs) == EPOCHS
                    for epoch, batches in enumerate(epochs):
                        want = reference(n, world, rank, shuffle, drop_last, epoch)
                        flat = [i for b in batches for i in b]
                        assert flat == want, (n, shuffle, drop_last, epoch, rank)
                        # micro-batches are consecutive chunks of the stream, all full but the last
                        assert [len(b) for b in batches] == [len(want[i:i + BATCH]) for i in range(0, len(want), BATCH)]
                    if shuffle:
                        assert epochs[0] != epochs[1]  # set_epoch reached the sampler


def test_batch_order_deals_each_rank_its_stream():
    """In-process: the order accelerate deals round-robin is rank 0's batch, rank 1's batch, ..."""
    for n, world, micro in [(10, 2, 3), (11, 3, 2), (7, 4, 1)]:
        for drop_last in (True, False):
            order = DistributedBatchOrder(n, world, micro, shuffle=True, seed=5, drop_last=drop_last)
            order.set_epoch(2)
            batches = list(order)
            assert len(batches) == len(order)
            for r in range(world):
                dealt = [i for b in batches[r::world] for i in b]
                assert dealt == rank_indices(n, world, r, True, 5, drop_last, 2)


def test_repeat_deals_each_step_again():
    """repeat (GRPO's --num_iterations): each rank gets each optimizer step's micro-batches (`accum` of its stream)
    `repeat` times in a row; the epoch's last step, short of `accum` micro-batches, is dropped."""
    for n, world, micro, accum, repeat in [(20, 2, 2, 2, 2), (23, 3, 1, 3, 3), (9, 1, 2, 2, 2)]:
        order = DistributedBatchOrder(n, world, micro, shuffle=True, seed=5, repeat=repeat, accum=accum)
        order.set_epoch(1)
        batches = list(order)
        assert len(batches) == len(order)
        for r in range(world):
            stream = rank_indices(n, world, r, True, 5, False, 1)
            steps = [stream[i:i + micro * accum] for i in range(0, len(stream), micro * accum)]
            steps = [s for s in steps if len(s) > micro * (accum - 1)]  # whole steps only
            want = [i for s in steps for _ in range(repeat) for i in s]
            assert [i for b in batches[r::world] for i in b] == want
    with pytest.raises(ValueError, match="fewer than one optimizer step's 4"):
        DistributedBatchOrder(5, 2, 1, repeat=2, accum=4)
