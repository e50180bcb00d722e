"""The HF Trainer with one narrow override: training data in DistributedSampler order.

The stock Trainer deals whole batches of one seeded permutation round-robin over the ranks; the
prepare() loop and the DeepSpeed script use DistributedSampler's order. One order for all three paths
(finetune.sampler) is what lets their losses agree step for step.
"""

from __future__ import annotations

import transformers

from finetune.sampler import distributed_dataloader


class Trainer(transformers.Trainer):
    def get_train_dataloader(self):
        args = self.args
        loader = distributed_dataloader(
            self.train_dataset, self.data_collator, world=self.accelerator.num_processes,
            batch_size=self._train_batch_size, shuffle=True,
            seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)
