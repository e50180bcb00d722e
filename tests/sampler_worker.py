"""Run under `accelerate launch`: dump the index stream each rank gets through the prepare() path's
dataloader (finetune.data.sampler.distributed_dataloader + accelerator.prepare + set_epoch), for a grid."""

import json
import sys
from pathlib import Path

from accelerate import Accelerator

from finetune.data.sampler import distributed_dataloader


def main(out_dir: str, batch: int, epochs: int, lengths: list[int]) -> None:
    accelerator = Accelerator(cpu=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    streams = {}
    for n in lengths:
        for shuffle in (True, False):
            for drop_last in (True, False):
                loader = distributed_dataloader(list(range(n)), lambda items: items, world=world, batch_size=batch,
                                                shuffle=shuffle, seed=17, drop_last=drop_last)
                loader = accelerator.prepare(loader)
                per_epoch = []
                for epoch in range(epochs):
                    loader.set_epoch(epoch)
                    per_epoch.append([list(b) for b in loader])
                streams[f"{n},{int(shuffle)},{int(drop_last)}"] = per_epoch
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"world": world, "streams": streams}))


if __name__ == "__main__":
    from finetune import process

    # A finished rank ends without the interpreter's shutdown, as the training ranks do: gloo's teardown can abort
    # a rank whose work is done ("terminate called without an active exception").
    process.run_rank(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")])
