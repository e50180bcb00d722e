"""Fine-tune a Llama-style causal LM under DeepSpeed's own launcher, driving the DeepSpeed engine directly.

    deepspeed --num_gpus 2 scripts/sft.py --deepspeed ds_configs/zero2.json \
        --model_name_or_path MODEL --dataset data.jsonl --output_dir out
    deepspeed --hostfile hosts scripts/sft.py --config zero3 ...      # several nodes: nothing here is node-specific

The same job as finetune/train.py (the HF Trainer path), written the way DeepSpeed's tutorials write it:
`deepspeed.initialize`, `engine.backward(loss)`, `engine.step()`, `engine.save_checkpoint`. Flags, data,
model and LoRA come from the shared finetune modules, so a flag means the same thing on both paths;
`--deepspeed PATH` is an alias of `--config PATH` (and `--config zero2`, `zero3`, ... work too; `--config
ddp` is DeepSpeed's plain data parallelism, ZeRO stage 0). Per-step losses equal the Trainer's:
same data order (DistributedSampler's), same loss normalization (trained tokens of the whole global
batch), same optimizer, schedule and clipping, all from finetune.training.core (shared with loop.py).
Outputs: a from_pretrained-loadable model (or LoRA adapter) with its tokenizer, trainer_state.json
(log_history in the Trainer's logging windows) and finetune_config.yaml; with --save_steps N, DeepSpeed
checkpoints in OUTPUT_DIR/checkpoint-<step>/.
"""

from __future__ import annotations

import contextlib
import copy
from functools import partial

from finetune import methods
from finetune.data.packing import to_device
from finetune.training import checkpoint, core, evaluate, examples, sequence_parallel
from finetune.process import exit_with
from finetune.training.lifecycle import finish_run, resume_or_exit

# `--config ddp` has no DeepSpeed JSON: DeepSpeed's own data parallelism (ZeRO stage 0), "auto" filled like the presets.
STAGE0_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1000000,
    "wall_clock_breakdown": False,
}


def main(argv: list[str] | None = None) -> None:
    # Config: the project's parser (`--deepspeed PATH` is `--config PATH` there); `--local_rank=N` from the launcher is
    # accepted. The process group is up when it returns (DeepSpeed's communication layer, for `--config ddp` too).
    cfg = core.start(argv, "finetune engine", script="scripts/sft.py", deepspeed_engine=True)
    args = cfg.training  # built before the model: under ZeRO-3 the weights then load partitioned
    import deepspeed
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    deepspeed.utils.logger.setLevel(args.get_process_log_level())
    # Resume: checked before anything heavy loads (a checkpoint for another world size or stage is refused).
    resume = resume_or_exit(cfg, path="engine", world_size=world)

    # Tokenizer and data: the method's examples (finetune.methods), tokenized once per node (local rank 0), cached.
    method = methods.get(cfg.objective.method)
    tokenizer, train, held_out, stats = examples.datasets_or_exit(cfg, method, args.local_process_index)
    collator = method.collator(cfg, tokenizer)
    # --sequence_parallel_size N: groups of N ranks draw the same records and each trains its slice of every row
    # (finetune.training.sequence_parallel); data parallel over the groups.
    sp = cfg.launch.sequence_parallel_size
    data_world, data_rank = world, rank
    if sp > 1:
        from finetune.data.sequence import SequenceParallelCollator

        data_world, data_rank, sp_rank = sequence_parallel.groups_or_exit(sp, world, rank)
        collator = SequenceParallelCollator(collator, sp_rank, sp)
    loader = build_loader(train.dataset, collator, args, data_world, data_rank)
    max_steps = core.max_steps_of(args, len(loader))

    # Model (and LoRA).
    model = core.load_model_for_training(cfg, stats, world)
    if sp > 1:
        sequence_parallel.attach(model, sp)

    # Engine: "auto" values filled from the TrainingArguments as the Trainer does; optimizer from the DeepSpeed
    # config if it has one (DeepSpeedCPUAdam when offloaded), else the Trainer's; the Trainer's LR schedule.
    try:
        hf_ds = filled_ds_config(cfg, model, max_steps)
    except ValueError as e:  # a DeepSpeed value that contradicts a flag
        exit_with(str(e))
    ds_config = hf_ds.config
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=core.trainable_parameters(model),
        optimizer=core.build_optimizer(args, model, ds_config),
        lr_scheduler=None if "scheduler" in ds_config else core.scheduler_factory(args, max_steps),
        config=ds_config,
    )

    session = method.setup(cfg.objective, model, tokenizer, [train, held_out], collator, core.method_context(
        cfg, engine.device, lambda: engine.module, contextlib.nullcontext, resumed=resume is not None))

    # Resume: the engine's checkpoint (weights, ZeRO partitions, optimizer, schedule); core.train restores the rest.
    if resume is not None:
        engine.load_checkpoint(str(resume.parent), tag=resume.name)
        checkpoint.restore_after_load(engine, resume)

    def save(folder, position: dict) -> None:
        engine.save_checkpoint(args.output_dir, tag=folder.name, client_state={"finetune": position})

    # Evaluation (finetune.training.evaluate): every rank evaluates its share; ZeRO-3 generates in step.
    synced = cfg.preset.zero3 and world > 1
    evaluator = evaluate.method_evaluator(cfg, method, session, tokenizer, held_out, engine, engine.module,
                                          engine.device, synced_gpus=synced, max_steps=max_steps)

    def load(folder) -> None:  # the best checkpoint, for the final save (loaded as a resume loads it)
        engine.load_checkpoint(str(folder.parent), tag=folder.name)

    # Train: one optimizer step = gradient_accumulation_steps micro-batches (fewer at an epoch's end, as the Trainer).
    engine.train()
    path = core.TrainingPath("engine", cfg.preset.stage, partial(train_step, engine, session, world), save,
                             engine.device, method.count, cfg.fingerprint, evaluator=evaluator, load=load,
                             reporters=evaluate.Reporters(args, max_steps, engine.module),
                             metrics=(lambda: session.metrics(core.all_sum)) if method.metrics else None,
                             sequence_parallel=sp)
    log, pos = core.train(args, path, loader, len(loader), max_steps, resume)
    if sp > 1:
        sequence_parallel.detach()

    # Save: consolidated model (or adapter) + tokenizer + log_history, staged, verified, committed.
    state_dict = core.consolidated_state_dict(engine, engine.module)
    state = core.trainer_state(log, pos.step, max_steps, evaluator)
    core.save_final_module(engine.module, state_dict, tokenizer, args.output_dir, state, cfg)
    checkpoint.end_process_group()
    finish_run(cfg)  # the trackers' runs ended; --push_to_hub


# ----------------------------------------------------------------------------------------------


def unsupported(cfg) -> list[str]:
    """Flags the Trainer path honours that this script does not: refused, never silently ignored."""
    return core.refused_flags(cfg, "scripts/sft.py")


def build_loader(dataset, collate_fn, args, world: int, rank: int):
    """This rank's DataLoader: torch's DistributedSampler order (finetune.data.sampler gives the Trainer the same)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=core.data_seed(args),
                                 drop_last=args.dataloader_drop_last)
    return DataLoader(
        dataset, batch_size=args.per_device_train_batch_size, sampler=sampler, collate_fn=collate_fn,
        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory and torch.cuda.is_available(),
        persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
    )


def filled_ds_config(cfg, model, max_steps: int):
    """The DeepSpeed config with every "auto" filled from the TrainingArguments (transformers' own code for it).

    Returns the HfTrainerDeepSpeedConfig; keep it alive (transformers reads it through a weak reference).
    """
    args = cfg.training
    hf_ds = getattr(args, "hf_deepspeed_config", None)
    if hf_ds is None:
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        hf_ds = HfTrainerDeepSpeedConfig(copy.deepcopy(STAGE0_CONFIG))
        hf_ds.trainer_config_process(args)
    hf_ds.trainer_config_finalize(args, model, max_steps)
    return hf_ds


def train_step(engine, session, world: int, chunk: list[dict], n_items):
    """One optimizer step over `chunk` (this rank's micro-batches): (this rank's loss sum, learning rate, grad norm).

    The Trainer's normalization: every micro-batch loss is its loss sum (SFT: over its trained tokens) over n_items,
    the method's count of the whole global batch (finetune.methods). DeepSpeed averages gradients over ranks, so the
    loss is multiplied by the world size, and scale_wrt_gas=False keeps DeepSpeed from dividing by the accumulation
    steps again (the Trainer does the same).
    """
    import torch

    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    for i, batch in enumerate(chunk):
        engine.set_gradient_accumulation_boundary(i == len(chunk) - 1)
        loss = session.loss(engine, to_device(batch, engine.device, non_blocking=True), n_items)
        engine.backward(loss * world, scale_wrt_gas=False)
        total += loss.detach().float()
    # The learning rate this step uses (the Trainer logs it too), read before engine.step() advances the schedule.
    lr = engine.lr_scheduler.get_last_lr()[0] if engine.lr_scheduler is not None else engine.get_lr()[0]
    engine.step()
    return total, lr, engine.get_global_grad_norm()


def save_interval(cfg, max_steps: int) -> int:
    """Checkpoint every N steps: --save_strategy steps, or --save_steps given on its own."""
    return checkpoint.save_interval(cfg.training, max_steps, cfg.sources)


if __name__ == "__main__":
    main()
