"""Fine-tune with a plain accelerate loop: the same job as finetune/train.py, written out.

    accelerate launch --multi_gpu --num_processes 2 finetune/loop.py --config zero2 \
        --model_name_or_path MODEL --dataset data.jsonl --output_dir out

Same flags, presets, data, model code and data order (DistributedSampler's, see finetune/sampler.py)
as the Trainer path, and the same loss: each optimizer step minimizes the mean over the trained tokens
of the whole global batch. A test holds its per-step losses to the Trainer's.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path


import torch

from finetune.training import checkpoint
from finetune import config as C
from finetune.data.prepare import IGNORE_INDEX, make_collator
from finetune.models.load import load_model
from finetune.training.outputs import (commit_staged, data_or_exit, describe_run, exit_with, plan_or_exit, rank0_print,
                              resume_or_exit, staging_dir, verify_staged, write_json_atomic)
from finetune.data.sampler import distributed_dataloader
from finetune.models.verify import VerificationError


def main(argv: list[str] | None = None) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler, GradientAccumulationPlugin
    from transformers import get_scheduler

    # Config (TrainingArguments built first, so that ZeRO-3 loads the weights partitioned).
    cfg = C.load_or_exit(argv, prog="finetune loop")
    args = cfg.training
    plan_or_exit(cfg)
    accum = args.gradient_accumulation_steps
    accelerator = Accelerator(
        # Sync by our count of micro-batches, not by the end of the dataloader: each step's micro-batches are
        # fetched before its first forward (to count its tokens), which would end the epoch one batch early.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accum, sync_with_dataloader=False),
        deepspeed_plugin=args.deepspeed_plugin,
        step_scheduler_with_optimizer=False,  # we step it once per optimizer step ourselves
    )
    world = accelerator.num_processes
    zero_stage = accelerator.state.deepspeed_plugin.zero_stage if accelerator.state.deepspeed_plugin else 0
    # Resume: checked before anything heavy loads (a checkpoint for another world size or stage is refused).
    resume = resume_or_exit(cfg, path="loop", world_size=world)

    # Tokenizer and data.
    tokenizer, dataset, stats = data_or_exit(cfg, accelerator.local_process_index)
    dataloader = distributed_dataloader(
        dataset, make_collator(cfg, tokenizer), world=world, batch_size=args.per_device_train_batch_size,
        shuffle=True, seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
    )

    # Model, optimizer (DeepSpeed builds its own when its config names one), schedule.
    model = load_model(cfg.model, args)
    rank0_print(describe_run(cfg, stats, model, world))
    params = [p for p in model.parameters() if p.requires_grad]
    ds_config = args.hf_deepspeed_config.config if args.deepspeed else {}
    optimizer_cls = DummyOptim if "optimizer" in ds_config else torch.optim.AdamW
    optimizer = optimizer_cls(params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                              eps=args.adam_epsilon, weight_decay=args.weight_decay)
    steps_per_epoch = math.ceil(len(dataloader) / world / accum)
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    def schedule(opt):
        return get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=args.get_warmup_steps(max_steps),
                             num_training_steps=max_steps)

    # With DummyOptim the optimizer exists only after prepare(); DummyScheduler builds the schedule on it then.
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=schedule) if optimizer_cls is DummyOptim else schedule(optimizer)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    rank0_print(f"engine: {accelerator.distributed_type.value}")
    if args.process_index == 0:
        C.save_resolved(cfg, args.output_dir)

    # Resume: weights, optimizer, schedule (DeepSpeed: the engine's checkpoint), then the data position.
    log_history, step, epoch, skip = [], 0, 0, 0
    if resume is not None:
        accelerator.load_state(str(resume))
        if accelerator.distributed_type.value == "DEEPSPEED":
            checkpoint.restore_after_load(model, resume)
        position = json.loads((resume / POSITION).read_text())
        log_history, step, epoch, skip = (position[k] for k in ("log_history", "global_step", "epoch", "micro_batches_done"))
    save_every = checkpoint.save_interval(args, max_steps)

    # Train.
    model.train()
    while step < max_steps:
        dataloader.set_epoch(epoch)
        batches = iter(dataloader)
        micro_done = 0
        if skip:
            # Mid-epoch resume: the same micro-batches, in the same order, as the uninterrupted run; then its RNG
            # states as they were after step `step` (creating the iterator above drew from the RNG once more).
            for _ in zip(range(skip), batches):
                pass
            micro_done, skip = skip, 0
            checkpoint.load_rng(resume, accelerator.process_index)
        while step < max_steps:
            micro_batches = [b for _, b in zip(range(accum), batches)]
            if not micro_batches:
                break
            micro_done += len(micro_batches)
            # The loss of a step is the mean over the trained tokens of the whole global batch.
            n_tokens = accelerator.reduce(
                sum((b["labels"][:, 1:] != IGNORE_INDEX).sum() for b in micro_batches).to(accelerator.device), "sum"
            )
            # The epoch's last step may have fewer micro-batches: the optimizer steps after its last one.
            accelerator.step = accum - len(micro_batches)
            step_loss, grad_norm = torch.zeros((), device=accelerator.device), None
            learning_rate = scheduler.get_last_lr()[0]  # before DeepSpeed's engine steps it inside backward()
            for batch in micro_batches:
                with accelerator.accumulate(model):
                    loss = model(**batch, num_items_in_batch=n_tokens).loss  # token-loss sum / n_tokens
                    step_loss += loss.detach()
                    # accelerate (or DeepSpeed) divides by the accumulation steps, and DDP averages over ranks:
                    # undo both, since `loss` is already normalized over the whole global batch.
                    accelerator.backward(loss * world * accum)
                    if accelerator.sync_gradients and args.max_grad_norm > 0:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
            scheduler.step()
            step += 1
            entry = {"loss": accelerator.reduce(step_loss, "sum").item(), "learning_rate": learning_rate,
                     "epoch": epoch + 1, "step": step}
            if grad_norm is not None:
                entry["grad_norm"] = float(grad_norm)
            log_history.append(entry)
            if step % max(int(args.logging_steps), 1) == 0:
                rank0_print({k: round(v, 6) if isinstance(v, float) else v for k, v in entry.items()})
            if save_every and step % save_every == 0 and step < max_steps:
                save_checkpoint(accelerator, args.output_dir, zero_stage, {
                    "global_step": step, "epoch": epoch, "micro_batches_done": micro_done, "log_history": log_history})
        epoch += 1

    # Save: consolidated model (or adapter) + tokenizer + per-step losses, staged then committed.
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # every rank: gathers ZeRO-3 partitions
    staging, unwrapped = staging_dir(args.output_dir), accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        unwrapped.config.use_cache = True
        unwrapped.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        write_json_atomic(staging / "trainer_state.json", {"global_step": step, "log_history": log_history})
    # Under ZeRO-3 each rank holds a slice, so the gathered state dict is the reference; else the model itself.
    try:
        verify_staged(staging, state_dict if zero_stage == 3 else unwrapped, is_main=accelerator.is_main_process)
    except VerificationError as e:
        exit_with(str(e))
    if accelerator.is_main_process:
        commit_staged(staging, args.output_dir)
    accelerator.wait_for_everyone()
    rank0_print(f"saved to {args.output_dir}")
    checkpoint.end_process_group()


POSITION = "finetune_position.json"


def save_checkpoint(accelerator, output_dir, zero_stage: int, position: dict) -> None:
    """accelerate's save_state (model, optimizer, schedule; the engine's own checkpoint under DeepSpeed), this
    rank's RNG states, and where the data stands; then the completion marker once every rank is done."""
    folder = checkpoint.folder_for(output_dir, position["global_step"])
    accelerator.save_state(str(folder))
    checkpoint.save_rng(folder, accelerator.process_index)
    if accelerator.is_main_process:
        write_json_atomic(folder / POSITION, position)
    checkpoint.mark_complete(folder, path="loop", world_size=accelerator.num_processes, zero_stage=zero_stage,
                             global_step=position["global_step"])


if __name__ == "__main__":
    main()
