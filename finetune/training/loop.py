"""Fine-tune with a plain accelerate loop: the same job as finetune/train.py, written out.

    accelerate launch --multi_gpu --num_processes 2 finetune/loop.py --config zero2 \
        --model_name_or_path MODEL --dataset data.jsonl --output_dir out

Same flags, presets, data, model code and data order (DistributedSampler's, see finetune/data/sampler.py)
as the Trainer path, and the same loss: each optimizer step minimizes the mean over the trained tokens
of the whole global batch. Optimizer, schedule, logging window, checkpoints and the final save are
finetune.training.core's, shared with the DeepSpeed engine path. Tests hold its per-step losses and
log_history to the Trainer's.
"""

from __future__ import annotations

from finetune import config as C
from finetune.data.prepare import make_collator
from finetune.training import checkpoint, core, evaluate
from finetune.training.lifecycle import plan_or_exit, rank0_print, resume_or_exit


def main(argv: list[str] | None = None) -> None:
    # Config (TrainingArguments built first, so that ZeRO-3 loads the weights partitioned).
    core.start_run()  # no rank outlives its launcher; no silent wait
    cfg = C.load_or_exit(argv, prog="finetune loop")
    args = cfg.training
    plan_or_exit(cfg)
    core.check_flags_or_exit(cfg, "finetune/loop.py")
    # Only now torch and accelerate (seconds): a flag mistake is reported without them.
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, DummyScheduler, GradientAccumulationPlugin, TorchDynamoPlugin

    from finetune.data.sampler import distributed_dataloader

    accum = args.gradient_accumulation_steps
    accelerator = Accelerator(
        # Sync by our count of micro-batches, not by the end of the dataloader: each step's micro-batches are
        # fetched before its first forward (to count its tokens), which would end the epoch one batch early.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accum, sync_with_dataloader=False),
        deepspeed_plugin=args.deepspeed_plugin,
        mixed_precision=args.mixed_precision,  # --bf16 / --fp16 (under DeepSpeed its JSON's "auto" gets them)
        step_scheduler_with_optimizer=False,  # we step it once per optimizer step ourselves
        # --torch_compile: prepare() compiles the model as the Trainer's Accelerator does (TrainingArguments has
        # set torch_compile_backend, "inductor" by default).
        dynamo_plugin=TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
        if args.torch_compile else None,
    )
    world = accelerator.num_processes
    deepspeed = accelerator.distributed_type.value == "DEEPSPEED"
    zero_stage = accelerator.state.deepspeed_plugin.zero_stage if deepspeed else 0
    # Resume: checked before anything heavy loads (a checkpoint for another world size or stage is refused).
    resume = resume_or_exit(cfg, path="loop", world_size=world)

    # Tokenizer and data (preference pairs for --method dpo: finetune.training.dpo).
    dpo_run = cfg.objective.method == "dpo"
    if dpo_run:
        from finetune.data.preference import PairCollator
        from finetune.training import dpo

        tokenizer, pairs, held_out, stats = dpo.pairs_or_exit(cfg, accelerator.local_process_index)
        dataset, eval_dataset, collator = pairs.dataset, None, PairCollator(tokenizer.pad_token_id)
    else:
        tokenizer, dataset, eval_dataset, stats = evaluate.datasets_or_exit(cfg, accelerator.local_process_index)
        collator = make_collator(cfg, tokenizer)
    dataloader = distributed_dataloader(
        dataset, collator, world=world, batch_size=args.per_device_train_batch_size,
        shuffle=True, seed=core.data_seed(args), drop_last=args.dataloader_drop_last,
    )
    micro_per_epoch = len(dataloader) // world  # this rank's micro-batches per epoch
    max_steps = core.max_steps_of(args, micro_per_epoch)

    # Model, optimizer (DeepSpeed builds its own when its config names one), schedule.
    model = core.load_model_for_training(cfg, stats, world)
    if dpo_run:  # the frozen copy of full fine-tuning is taken here, before any update
        reference = dpo.Reference(cfg, model, lambda: accelerator.unwrap_model(model), [pairs, held_out], collator,
                                  accelerator.device, accelerator.autocast, resumed=resume is not None, log=rank0_print)
        options, metrics = dpo.Options(cfg.objective.beta, cfg.objective.label_smoothing), dpo.Metrics()
        rank0_print(reference.describe())
    ds_config = args.hf_deepspeed_config.config if deepspeed else {}
    optimizer = core.build_optimizer(args, model, ds_config) or DummyOptim(
        core.trainable_parameters(model), lr=args.learning_rate, weight_decay=args.weight_decay)
    schedule = core.scheduler_factory(args, max_steps)
    # With DummyOptim the optimizer exists only after prepare(); DummyScheduler builds the schedule on it then.
    if isinstance(optimizer, DummyOptim) or "scheduler" in ds_config:
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=None if "scheduler" in ds_config else schedule)
    else:
        scheduler = schedule(optimizer)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    rank0_print(f"engine: {accelerator.distributed_type.value}")

    # Resume: weights, optimizer, schedule (DeepSpeed: the engine's checkpoint); core.train restores the rest.
    if resume is not None:
        accelerator.load_state(str(resume))
        if deepspeed:
            checkpoint.restore_after_load(model, resume)

    def step(chunk: list[dict], n_tokens: torch.Tensor):
        # The epoch's last step may have fewer micro-batches: the optimizer steps after its last one.
        accelerator.step = accum - len(chunk)
        total, grad_norm = torch.zeros((), device=accelerator.device), None
        learning_rate = scheduler.get_last_lr()[0]  # before DeepSpeed's engine steps it inside backward()
        if dpo_run:  # the pairs of the global batch, not its tokens
            n_pairs = core.all_sum(torch.tensor(dpo.pair_count(chunk), device=accelerator.device))
        for batch in chunk:
            with accelerator.accumulate(model):
                if dpo_run:  # the pairs' loss sum / n_pairs
                    loss = dpo.micro_batch_loss(model, reference.prepare(batch), reference.logps, options, n_pairs,
                                                metrics, accelerator.autocast)
                else:
                    loss = model(**batch, num_items_in_batch=n_tokens).loss  # token-loss sum / n_tokens
                total += loss.detach()
                # accelerate (or DeepSpeed) divides by the accumulation steps, and DDP averages over ranks:
                # undo both, since `loss` is already normalized over the whole global batch.
                accelerator.backward(loss * world * accum)
                if accelerator.sync_gradients:  # the Trainer logs the norm even when it does not clip
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
        return total, learning_rate, grad_norm

    def save(folder, position: dict) -> None:
        accelerator.save_state(str(folder))  # model, optimizer, schedule; the engine's own checkpoint under DeepSpeed

    # Evaluation (finetune.training.evaluate): every rank evaluates its share; ZeRO-3 generates in step.
    eval_set = evaluate.eval_set(cfg, tokenizer, eval_dataset)
    synced = zero_stage == 3 and world > 1
    evaluator = evaluate.evaluator(cfg, lambda: evaluate.evaluate(
        model, accelerator.unwrap_model(model), eval_set, accelerator.device, synced_gpus=synced), max_steps)
    if dpo_run and held_out is not None:
        evaluator = evaluate.evaluator(cfg, lambda: dpo.evaluate(
            model, reference, held_out, args.per_device_eval_batch_size, options), max_steps)

    # Train.
    model.train()
    job = core.Job("loop", zero_stage, step, save, accelerator.device, cfg.fingerprint, evaluator=evaluator,
                   load=lambda folder: accelerator.load_state(str(folder)),
                   reporters=evaluate.Reporters(args, max_steps, accelerator.unwrap_model(model)),
                   metrics=(lambda: metrics.pop(core.all_sum)) if dpo_run else None)
    log, pos = core.train(args, job, dataloader, micro_per_epoch, max_steps, resume)

    # Save: consolidated model (or adapter) + tokenizer + log_history, staged, verified, committed.
    accelerator.wait_for_everyone()
    module = accelerator.unwrap_model(model)
    state_dict = core.consolidated_state_dict(model if deepspeed else None, module)
    core.save_final(module, state_dict, tokenizer, args.output_dir, core.trainer_state(log, pos.step, max_steps, evaluator),
                    cfg)
    checkpoint.end_process_group()


if __name__ == "__main__":
    main()
