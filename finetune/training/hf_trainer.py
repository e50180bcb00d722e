"""The HF Trainer with the Trainer path's narrow overrides (finetune.training.trainer's main builds it): data in
DistributedSampler order, resumable step checkpoints, the token-normalized evaluation. Its own module because it
imports transformers' Trainer (torch, peft: seconds), which `finetune train` imports only once its flags are read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from finetune import compat
from finetune.data.sampler import distributed_dataloader
from finetune.training import checkpoint, evaluate, faults
from finetune.training.lifecycle import saving


class Trainer(transformers.Trainer):
    repeat = 1  # optimizer steps per step's micro-batches (Method.repeats)

    def get_train_dataloader(self):
        args = self.args
        loader = distributed_dataloader(
            self.train_dataset, self.data_collator, world=self.accelerator.num_processes,
            batch_size=self._train_batch_size, shuffle=True,
            seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
            repeat=self.repeat, accum=args.gradient_accumulation_steps,
            persistent_workers=args.dataloader_persistent_workers,
        )
        self._batch_order = loader.batch_sampler
        return self.accelerator.prepare(loader)

    def _run_epoch(self, *args, epoch: int, **kwargs):
        # A mid-epoch resume wraps the prepared loader in accelerate's skip_first_batches: its SkipBatchSampler
        # hides our batch order from the set_epoch calls that follow, which would then replay epoch 0's order in
        # any later epoch. Set the epoch on the order itself; it is read only when the epoch's iterator is made.
        self._batch_order.set_epoch(epoch)
        if self.state.global_step >= self.state.max_steps:
            # Resumed from the checkpoint of the last step (the final save did not finish): nothing is left to train,
            # and the Trainer would run one step past max_steps before it checks.
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, epoch=epoch, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Under DeepSpeed the engine steps the LR schedule inside backward(), before the Trainer reads the learning
        # rate to log: it would log the next step's. Keep the one this step uses (what it logs without DeepSpeed).
        if self.is_deepspeed_enabled:
            self._step_learning_rate = super()._get_learning_rate()
        return super().training_step(model, inputs, num_items_in_batch)

    # --include_num_input_tokens_seen: the Trainer gathers and reads every micro-batch's count (an .item(), a host-
    # device sync in every step). Counted here where the batch is, and read when an entry is logged or a checkpoint
    # saved (every rank does both at the same steps), so a step that does not log waits for no device.
    _pending_tokens = 0

    def _track_num_input_tokens(self, inputs):
        how = self.args.include_num_input_tokens_seen
        if how == "no":
            return
        ids, pad = inputs["input_ids"], getattr(self.processing_class, "pad_token_id", None)
        if how == "non_padding" and "attention_mask" in inputs:
            n = inputs["attention_mask"].sum()
        elif how == "non_padding" and pad is not None:
            n = (ids != pad).sum()
        else:
            n = ids.numel()
        self._pending_tokens = self._pending_tokens + n

    def _read_tokens(self) -> None:
        if self.args.include_num_input_tokens_seen == "no":
            return
        n = torch.as_tensor(self._pending_tokens, device=self.args.device, dtype=torch.int64)
        self._pending_tokens = 0
        self.state.num_input_tokens_seen += int(self.accelerator.gather(n).sum().item())

    def log(self, logs, start_time=None):
        self._read_tokens()
        super().log(logs, start_time)

    def _get_learning_rate(self) -> float:
        lr = getattr(self, "_step_learning_rate", None)
        return super()._get_learning_rate() if lr is None else lr

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        # finetune.training.evaluate instead of evaluation_loop, whose loss is a mean of batch means over a
        # DistributedSampler-padded set: the token-normalized loss of the whole set, as on the other two paths.
        # Logged, and handed to the callbacks (early stopping), as Trainer.evaluate does.
        eval_set = self.eval_set if eval_dataset is None else dataclasses.replace(self.eval_set, dataset=eval_dataset)
        synced = (self.zero_stage() == 3 or self.is_fsdp_enabled) and self.accelerator.num_processes > 1
        metrics = evaluate.eval_set_metrics(self.model_wrapped, self.accelerator.unwrap_model(self.model), eval_set,
                                            self.args.device, synced_gpus=synced, prefix=metric_key_prefix)
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def zero_stage(self) -> int:
        return self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else 0

    def _save_checkpoint(self, model, trial):
        self._read_tokens()  # the count in the checkpoint's trainer_state.json is the step's
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with saving(folder, f"checkpoint {os.path.basename(folder)}", partial=Path(folder)):
            super()._save_checkpoint(model, trial)
            checkpoint.mark_complete(folder, path="trainer", world_size=self.accelerator.num_processes,
                                     zero_stage=self.zero_stage(), global_step=self.state.global_step,
                                     fsdp=self.accelerator.state.fsdp_plugin.fsdp_version if self.is_fsdp_enabled else 0,
                                     fingerprint=getattr(self, "fingerprint", None))

    def _save(self, output_dir=None, state_dict=None):
        if state_dict is not None:  # under ZeRO-1/2 accelerate hands over clones: tie lm_head to the embeddings again
            state_dict = compat.retie_state_dict(self.accelerator.unwrap_model(self.model), state_dict)
        super()._save(output_dir, state_dict)

    # --push_to_hub: the run pushes its verified final save once, in one commit with a model card, after training
    # (finetune.training.lifecycle.finish_run). The Trainer's own pushes are off: the repo it creates at start, a
    # commit per checkpoint, and one per save_model (which the final save calls on the unverified staging folder).
    def init_hf_repo(self, token=None, private=None) -> None:
        return None

    def _push_from_checkpoint(self, checkpoint_folder) -> None:
        return None

    def save_model(self, output_dir=None, _internal_call=False):
        return super().save_model(output_dir, _internal_call=True)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = model if model is not None else self.model
        # A full model whose saved names are not its modules' (a vision-language model): finetune.compat.
        if not self.is_deepspeed_enabled and not hasattr(model, "peft_config"):
            compat.reload_converted_checkpoint(model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint_dir):
        # Under DeepSpeed the engine has loaded its checkpoint by now (and this returns early); finish what that
        # load leaves out (CPU Adam's step state; under NVMe offload, the unswapped partitions and step counts).
        super()._load_optimizer_and_scheduler(checkpoint_dir)
        if checkpoint_dir is not None and self.is_deepspeed_enabled:
            checkpoint.restore_after_load(self.model_wrapped, checkpoint_dir)


class MethodTrainer(Trainer):
    """The Trainer for a method with a loss of its own (finetune.methods: DPO): the method's loss of each micro-batch
    over the count of the whole global batch (Method.count: DPO's pairs), its metrics in every training log entry,
    and, for a method with an evaluation of its own, that evaluation; the rest is the Trainer path's."""

    loss_is_scaled_for_ga = True  # each micro-batch's loss is already over the global batch's count

    def __init__(self, *args, method, session, held_out=None, repeat: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.method, self.session, self.held_out, self.repeat = method, session, held_out, repeat

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batch_samples:  # the step's micro-batches, before their losses (Session.step_start)
            self.session.step_start(batch_samples)
        return batch_samples, num_items_in_batch

    def _get_num_items_in_batch(self, batch_samples, device):
        # A host count (DPO's pairs) copied without blocking: a blocking copy waits for the device's queue.
        n = torch.as_tensor(self.method.count(batch_samples)).to(device, non_blocking=True)
        return self.accelerator.gather(n).sum() if self.args.world_size > 1 else n

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if num_items_in_batch is None:  # outside training (no global count): this batch's mean
            num_items_in_batch = self.method.count([inputs])
        loss = self.session.loss(model, inputs, num_items_in_batch)
        # DDP and DeepSpeed average the gradients over ranks; the loss is over the global batch already.
        loss = loss * self.accelerator.num_processes
        return (loss, None) if return_outputs else loss

    def log(self, logs, start_time=None):
        if "loss" in logs and self.method.metrics:
            # A training entry: every rank is here (the Trainer gathered the loss just before).
            logs = {**logs, **self.session.metrics(self._reduce)}
        super().log(logs, start_time)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        if not self.method.own_evaluation:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        examples = self.held_out if eval_dataset is None else dataclasses.replace(self.held_out, dataset=eval_dataset)
        metrics = self.session.evaluate(self.model_wrapped, examples, self.args.per_device_eval_batch_size,
                                        prefix=metric_key_prefix)
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _reduce(self, t):
        return self.accelerator.reduce(t.to(self.args.device), reduction="sum") if self.args.world_size > 1 else t


class StopPoint(transformers.TrainerCallback):
    """faults.stop_point at the Trainer's step end (before its log, evaluate and save, as in the other paths)."""

    def on_step_end(self, args, state, control, **kwargs):
        faults.stop_point(state.global_step)
