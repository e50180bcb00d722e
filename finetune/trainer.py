"""The HF Trainer with narrow overrides: DistributedSampler data order, and resumable step checkpoints.

The stock Trainer deals whole batches of one seeded permutation round-robin over the ranks; the
prepare() loop and the DeepSpeed script use DistributedSampler's order. One order for all three paths
(finetune.sampler) is what lets their losses agree step for step.

Checkpoints: the Trainer writes them; we add the completion marker once every rank is done
(finetune.checkpoint), and make a resumed DeepSpeed optimizer continue bit for bit.
"""

from __future__ import annotations

import os

import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from finetune import checkpoint
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

    def zero_stage(self) -> int:
        return self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else 0

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        checkpoint.mark_complete(folder, path="trainer", world_size=self.accelerator.num_processes,
                                 zero_stage=self.zero_stage(), global_step=self.state.global_step)

    def _load_optimizer_and_scheduler(self, checkpoint_dir):
        # Under DeepSpeed the engine has loaded its checkpoint by now (and this returns early); finish what that
        # load leaves out (CPU Adam's step state; under NVMe offload, the unswapped partitions and step counts).
        super()._load_optimizer_and_scheduler(checkpoint_dir)
        if checkpoint_dir is not None and self.is_deepspeed_enabled:
            checkpoint.restore_after_load(self.model_wrapped, checkpoint_dir)
