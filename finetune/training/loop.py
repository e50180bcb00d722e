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

from finetune import compat, methods
from finetune.training import checkpoint, core, evaluate, examples, sequence_parallel
from finetune.training.lifecycle import finish_run, fsdp_version, rank0_print, resume_or_exit


def main(argv: list[str] | None = None) -> None:
    # Config (TrainingArguments built first, so that ZeRO-3 loads the weights partitioned).
    cfg = core.start(argv, "finetune loop", script="finetune/loop.py")
    args = cfg.training
    # Only now torch and accelerate (seconds): a flag mistake is reported without them.
    import torch
    from accelerate import Accelerator
    from accelerate.utils import (DataLoaderConfiguration, DummyOptim, DummyScheduler, FullyShardedDataParallelPlugin,
                                  GradientAccumulationPlugin, TorchDynamoPlugin)

    from finetune.data.sampler import distributed_dataloader

    accum = args.gradient_accumulation_steps
    accelerator = Accelerator(
        # Sync by our count of micro-batches, not by the end of the dataloader: each step's micro-batches are
        # fetched before its first forward (to count its tokens), which would end the epoch one batch early.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accum, sync_with_dataloader=False),
        deepspeed_plugin=args.deepspeed_plugin,
        # FSDP2: the plugin the Trainer builds from the same arguments (the preset's fsdp_config, via TrainingArguments).
        fsdp_plugin=FullyShardedDataParallelPlugin(**args.fsdp_plugin_args) if cfg.preset.is_fsdp else None,
        mixed_precision=args.mixed_precision,  # --bf16 / --fp16 (under DeepSpeed its JSON's "auto" gets them)
        step_scheduler_with_optimizer=False,  # we step it once per optimizer step ourselves
        # --accelerator_config's non_blocking (a GPU default): batches copied from pinned memory without blocking.
        dataloader_config=DataLoaderConfiguration(non_blocking=bool(args.accelerator_config.non_blocking)),
        # --torch_compile: prepare() compiles the model as the Trainer's Accelerator does (TrainingArguments has
        # set torch_compile_backend, "inductor" by default).
        dynamo_plugin=TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
        if args.torch_compile else None,
    )
    world = accelerator.num_processes
    deepspeed, zero_stage = cfg.preset.is_deepspeed, cfg.preset.stage
    # Resume: checked before anything heavy loads (a checkpoint for another world size or stage is refused).
    resume = resume_or_exit(cfg, path="loop", world_size=world)

    # Tokenizer and data: the method's examples (finetune.methods), tokenized once per node and cached.
    method = methods.get(cfg.objective.method)
    tokenizer, train, held_out, stats = examples.datasets_or_exit(cfg, method, accelerator.local_process_index)
    collator = method.collator(cfg, tokenizer)
    # --sequence_parallel_size N: groups of N consecutive ranks get the same batches (each batch dealt N times in a
    # row) and each trains its slice of every row (finetune.training.sequence_parallel).
    sp = cfg.launch.sequence_parallel_size
    data_world = world
    if sp > 1:
        from finetune.data.sequence import SequenceParallelCollator

        data_world, _, sp_rank = sequence_parallel.groups_or_exit(sp, world, accelerator.process_index)
        collator = SequenceParallelCollator(collator, sp_rank, sp)
    dataloader = distributed_dataloader(
        train.dataset, collator, world=data_world, batch_size=args.per_device_train_batch_size, copies=sp,
        shuffle=True, seed=core.data_seed(args), drop_last=args.dataloader_drop_last,
        repeat=method.repeats(cfg.objective), accum=args.gradient_accumulation_steps,
        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
        persistent_workers=args.dataloader_persistent_workers,
    )
    micro_per_epoch = len(dataloader) // world  # this rank's micro-batches per epoch
    max_steps = core.max_steps_of(args, micro_per_epoch)

    # Model, optimizer (DeepSpeed builds its own when its config names one), schedule.
    model = core.load_model_for_training(cfg, stats, world)
    if sp > 1:
        sequence_parallel.attach(model, sp)
    # What else the method needs (DPO's reference: a frozen copy of full fine-tuning is taken here, before any update).
    session = method.setup(cfg.objective, model, tokenizer, [train, held_out], collator, core.method_context(
        cfg, accelerator.device, lambda: accelerator.unwrap_model(model), accelerator.autocast,
        resumed=resume is not None, step=lambda: path.position.step))
    if described := session.describe():
        rank0_print(described)
    ds_config = args.hf_deepspeed_config.config if deepspeed else {}
    optimizer = core.build_optimizer(args, model, ds_config) or DummyOptim(
        core.trainable_parameters(model), lr=args.learning_rate, weight_decay=args.weight_decay)
    schedule = core.scheduler_factory(args, max_steps)
    # With DummyOptim the optimizer exists only after prepare(); DummyScheduler builds the schedule on it then.
    if isinstance(optimizer, DummyOptim) or "scheduler" in ds_config:
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=None if "scheduler" in ds_config else schedule)
    else:
        scheduler = schedule(optimizer)
    if deepspeed:  # a multimodal checkpoint's sizes are in its text_config, which accelerate does not read
        compat.fill_zero_sizes(accelerator.state.deepspeed_plugin, model)
    if cfg.preset.is_fsdp and cfg.model.use_peft:
        # What the Trainer does under FSDP for a PEFT model: each adapter its own unit, and a 4-bit base's storage
        # dtype as the units' compute dtype.
        from transformers.distributed.fsdp import update_fsdp_plugin_peft

        update_fsdp_plugin_peft(model, accelerator)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    rank0_print(f"engine: {accelerator.distributed_type.value}")

    # Resume: weights, optimizer, schedule (DeepSpeed: the engine's checkpoint); core.train restores the rest.
    if resume is not None:
        accelerator.load_state(str(resume))
        if deepspeed:
            checkpoint.restore_after_load(model, resume)

    def step(chunk: list[dict], n_items: torch.Tensor):
        # The epoch's last step may have fewer micro-batches: the optimizer steps after its last one.
        accelerator.step = accum - len(chunk)
        total, grad_norm = torch.zeros((), device=accelerator.device), None
        learning_rate = scheduler.get_last_lr()[0]  # before DeepSpeed's engine steps it inside backward()
        session.step_start(chunk)  # the step's micro-batches, before their losses
        for batch in chunk:
            with accelerator.accumulate(model):
                loss = session.loss(model, batch, n_items)  # the micro-batch's loss sum / n_items
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
    synced = (zero_stage == 3 or cfg.preset.is_fsdp) and world > 1
    evaluator = evaluate.method_evaluator(cfg, method, session, tokenizer, held_out, model,
                                          accelerator.unwrap_model(model), accelerator.device, synced_gpus=synced,
                                          max_steps=max_steps)

    # Train.
    model.train()
    path = core.TrainingPath("loop", zero_stage, step, save, accelerator.device, method.count, cfg.fingerprint,
                             evaluator=evaluator, load=lambda folder: accelerator.load_state(str(folder)),
                             reporters=evaluate.Reporters(args, max_steps, accelerator.unwrap_model(model)),
                             metrics=(lambda: session.metrics(core.all_sum)) if method.metrics else None,
                             fsdp=fsdp_version(cfg.preset), sequence_parallel=sp)
    log, pos = core.train(args, path, dataloader, micro_per_epoch, max_steps, resume)
    if sp > 1:
        sequence_parallel.detach()

    # Save: consolidated model (or adapter) + tokenizer + log_history, staged, verified, committed.
    accelerator.wait_for_everyone()
    module = accelerator.unwrap_model(model)
    state_dict = core.consolidated_state_dict(model if deepspeed else None, module, accelerator)
    state = core.trainer_state(log, pos.step, max_steps, evaluator)
    core.save_final_module(module, state_dict, tokenizer, args.output_dir, state, cfg)
    checkpoint.end_process_group()
    finish_run(cfg)  # the trackers' runs ended; --push_to_hub


if __name__ == "__main__":
    main()
