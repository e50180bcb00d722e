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
batch), same optimizer, schedule and clipping. Outputs: a from_pretrained-loadable model (or LoRA
adapter) with its tokenizer, trainer_state.json (per-step log_history) and finetune_config.yaml;
with --save_steps N, DeepSpeed checkpoints in OUTPUT_DIR/checkpoint-<step>/.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import sys
from pathlib import Path


from finetune import compat
from finetune.training import checkpoint
from finetune import config as C
from finetune.data.prepare import IGNORE_INDEX, make_collator
from finetune.models.load import load_model
from finetune.training.outputs import (commit_staged, data_or_exit, describe_run, exit_with, plan_or_exit, rank0_print,
                              resume_or_exit, staging_dir, verify_staged, write_json_atomic)
from finetune.models.verify import VerificationError

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
    # Config: the project's parser; `--deepspeed PATH` is `--config PATH`; `--local_rank=N` from the launcher is accepted.
    try:
        argv = map_deepspeed_flags(sys.argv[1:] if argv is None else argv)
    except C.ConfigError as e:
        exit_with(str(e))
    cfg = C.load_or_exit(argv, prog="deepspeed scripts/sft.py")
    args = cfg.training  # built before the model: under ZeRO-3 the weights then load partitioned
    plan_or_exit(cfg)
    if problems := unsupported(cfg):
        exit_with(str(C.ConfigError(problems)))
    import deepspeed
    import torch.distributed as dist
    from transformers import set_seed

    init_process_group(args)
    world, rank = dist.get_world_size(), dist.get_rank()
    deepspeed.utils.logger.setLevel(args.get_process_log_level())
    # Resume: checked before anything heavy loads (a checkpoint for another world size or stage is refused).
    resume = resume_or_exit(cfg, path="sft", world_size=world)

    # Tokenizer and data: tokenized once per node (local rank 0), cached.
    tokenizer, dataset, stats = data_or_exit(cfg, args.local_process_index)
    loader = build_loader(dataset, make_collator(cfg, tokenizer), args, world, rank)
    steps_in_epoch = len(loader)  # micro-batches per rank per epoch
    updates_per_epoch = -(-steps_in_epoch // args.gradient_accumulation_steps)
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * updates_per_epoch)

    # Model (and LoRA).
    model = load_model(cfg.model, args)
    rank0_print(describe_run(cfg, stats, model, world))
    set_seed(args.seed)  # where the Trainer seeds (its __init__): dropout draws the same numbers
    enable_activation_checkpointing(model, args)

    # Engine: "auto" values filled from the TrainingArguments as the Trainer does; optimizer from the DeepSpeed
    # config if it has one (DeepSpeedCPUAdam when offloaded), else the Trainer's; the Trainer's LR schedule.
    try:
        hf_ds = deepspeed_config(cfg, model, max_steps)
    except ValueError as e:  # a DeepSpeed value that contradicts a flag
        exit_with(str(e))
    ds_config = hf_ds.config
    optimizer = None if "optimizer" in ds_config else build_optimizer(args, model)
    if optimizer is not None and ds_config["zero_optimization"].get("stage", 0) > 0:
        ds_config["zero_allow_untested_optimizer"] = True  # as the Trainer does for a torch optimizer
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer,
        lr_scheduler=None if "scheduler" in ds_config else scheduler_factory(args, max_steps),
        config=ds_config,
    )
    if rank == 0:
        C.save_resolved(cfg, args.output_dir)

    # Resume: the engine's checkpoint (weights, ZeRO partitions, optimizer, schedule), then the data position.
    log_history: list[dict] = []
    window_loss, window_steps = 0.0, 0
    step, epoch, skip = 0, 0, 0
    if resume is not None:
        _, client_state = engine.load_checkpoint(str(resume.parent), tag=resume.name)
        checkpoint.restore_after_load(engine, resume)
        position = client_state["finetune"]
        step, epoch, skip = position["global_step"], position["epoch"], position["micro_batches_done_in_epoch"]
        log_history, window_loss, window_steps = position["log_history"], *position.get("window", (0.0, 0))

    # Train: one optimizer step = gradient_accumulation_steps micro-batches (fewer at an epoch's end, as the Trainer).
    save_every = save_interval(cfg, max_steps)
    engine.train()
    while step < max_steps:
        loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        micro_done = 0
        if skip:
            # Mid-epoch resume: the uninterrupted run's micro-batches, in its order; then its RNG states as they
            # were after step `step` (creating the iterator above drew from the RNG once more).
            for _ in zip(range(skip), batches):
                pass
            micro_done, skip = skip, 0
            checkpoint.load_rng(resume, rank)
        while micro_done < steps_in_epoch and step < max_steps:
            n = min(args.gradient_accumulation_steps, steps_in_epoch - micro_done)
            chunk = [next(batches) for _ in range(n)]
            micro_done += n
            loss, lr, grad_norm = train_step(engine, chunk, world)
            step += 1
            window_loss, window_steps = window_loss + loss, window_steps + 1
            if step % args.logging_steps == 0 or step == max_steps:
                entry = {"loss": window_loss / window_steps, "grad_norm": grad_norm, "learning_rate": lr,
                         "epoch": epoch + micro_done / steps_in_epoch, "step": step}
                log_history.append(entry)
                window_loss, window_steps = 0.0, 0
                if rank == 0:
                    print({k: round(v, 6) if isinstance(v, float) else v for k, v in entry.items()}, flush=True)
                    write_state(args.output_dir, log_history, step, max_steps)
            if save_every and step % save_every == 0 and step < max_steps:
                save_checkpoint(engine, args, step, {
                    "global_step": step, "epoch": epoch, "micro_batches_done_in_epoch": micro_done,
                    "data": {"world_size": world, "per_device_train_batch_size": args.per_device_train_batch_size,
                             "seed": data_seed(args), "drop_last": args.dataloader_drop_last},
                    "log_history": log_history, "window": [window_loss, window_steps],
                })
        epoch += 1

    # Save: consolidated model (or adapter) + tokenizer + trainer_state.json, moved in with config.json last.
    save_final(engine, hf_ds, tokenizer, args.output_dir, log_history, step, max_steps)
    rank0_print(f"saved to {args.output_dir}")
    checkpoint.end_process_group()


def save_checkpoint(engine, args, step: int, position: dict) -> None:
    """All ranks: each writes its own partition and RNG states; the marker follows once every rank is done."""
    import torch.distributed as dist

    folder = checkpoint.folder_for(args.output_dir, step)
    engine.save_checkpoint(args.output_dir, tag=folder.name, client_state={"finetune": position})
    checkpoint.save_rng(folder, dist.get_rank())
    checkpoint.mark_complete(folder, path="sft", world_size=dist.get_world_size(),
                             zero_stage=engine.zero_optimization_stage(), global_step=step)


# ----------------------------------------------------------------------------------------------


def map_deepspeed_flags(argv: list[str]) -> list[str]:
    """`--deepspeed PATH` / `--deepspeed_config PATH` -> `--config PATH`.

    A bare `--deepspeed` (the on/off flag of DeepSpeed's `add_config_arguments`) names nothing and is dropped.
    """
    out: list[str] = []
    given: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        key, eq, inline = argv[i].partition("=")
        i += 1
        if "--" + key[2:].replace("-", "_") not in ("--deepspeed", "--deepspeed_config", "--config"):
            out.append(argv[i - 1])
            continue
        if eq:
            value = inline
        elif i < len(argv) and not argv[i].startswith("--"):
            value, i = argv[i], i + 1
        elif key.startswith("--config"):
            out.append(argv[i - 1])  # `--config` without a value: the parser reports it
            continue
        else:
            continue
        given.append((key, value))
    if len({_same_file(v) for _, v in given}) > 1:
        flags = " and ".join(f"{k} {v}" for k, v in given)
        raise C.ConfigError([f"{flags}: these name different DeepSpeed configurations; give one"])
    if given:
        out += ["--config", given[-1][1]]
    return out


def _same_file(name: str) -> str:
    path = C.resolve_preset(name)
    return str(path.resolve()) if path is not None else name


def unsupported(cfg) -> list[str]:
    """Flags the Trainer path honours that this script does not (yet): refused, never silently ignored."""
    args, problems = cfg.training, []
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy not in ("no", "steps"):
        problems.append(f"save_strategy: scripts/sft.py saves checkpoints every --save_steps only, not '{strategy}'")
    return problems


def init_process_group(args) -> None:
    """DeepSpeed presets start the process group when TrainingArguments is built; `--config ddp` may not have."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ and "LOCAL_RANK" not in os.environ:
        # `python scripts/sft.py`: a world of one on loopback (DeepSpeed would otherwise look for MPI).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(C.free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def data_seed(args) -> int:
    return args.data_seed if args.data_seed is not None else args.seed


def build_loader(dataset, collate_fn, args, world: int, rank: int):
    """This rank's DataLoader: torch's DistributedSampler order (finetune.sampler gives the Trainer the same)."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=data_seed(args), drop_last=args.dataloader_drop_last
    )
    return DataLoader(
        dataset, batch_size=args.per_device_train_batch_size, sampler=sampler, collate_fn=collate_fn,
        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory and _on_gpu(),
    )


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def enable_activation_checkpointing(model, args) -> None:
    """--gradient_checkpointing / --activation_checkpointing, as the Trainer applies it at the start of train()."""
    if not getattr(args, "activation_checkpointing", False):
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
    )


def deepspeed_config(cfg, model, max_steps: int):
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


def build_optimizer(args, model):
    """The optimizer the Trainer builds (--optim, default fused AdamW), biases and norm weights without weight decay."""
    from transformers import Trainer

    # Trainer.get_decay_parameter_names only reads the model; call it rather than copy its name patterns.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return optimizer_cls(groups, **kwargs)


def scheduler_factory(args, max_steps: int):
    """DeepSpeed calls this with the optimizer it ends up with (its own or ours) and steps it once per optimizer step."""
    from transformers import get_scheduler

    def make(optimizer):
        return get_scheduler(
            args.lr_scheduler_type, optimizer, num_warmup_steps=args.get_warmup_steps(max_steps),
            num_training_steps=max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )

    return make


def train_step(engine, chunk: list[dict], world: int) -> tuple[float, float, float | None]:
    """One optimizer step over `chunk` (this rank's micro-batches); returns (loss, learning rate, grad norm).

    The Trainer's normalization: every micro-batch loss is its token-loss sum over N, the trained tokens of the whole
    global batch (all ranks, all micro-batches). DeepSpeed averages gradients over ranks, so the loss is multiplied by
    the world size, and scale_wrt_gas=False keeps DeepSpeed from dividing by the accumulation steps again (the
    Trainer does the same). The gradient is then d(global token mean) and the logged loss is the global token mean.
    """
    import torch
    import torch.distributed as dist

    device = engine.device
    n_items = sum((b["labels"][..., 1:] != IGNORE_INDEX).sum() for b in chunk).to(device)
    dist.all_reduce(n_items)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for i, batch in enumerate(chunk):
        engine.set_gradient_accumulation_boundary(i == len(chunk) - 1)
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = engine(**batch, num_items_in_batch=n_items).loss
        engine.backward(loss * world, scale_wrt_gas=False)
        total += loss.detach().float()
    # The learning rate this step uses (the Trainer logs it too), read before engine.step() advances the schedule.
    lr = engine.lr_scheduler.get_last_lr()[0] if engine.lr_scheduler is not None else engine.get_lr()[0]
    engine.step()
    dist.all_reduce(total)
    grad_norm = engine.get_global_grad_norm()
    grad_norm = float(grad_norm) if grad_norm is not None else None
    return total.item(), float(lr), grad_norm


def save_interval(cfg, max_steps: int) -> int:
    """Checkpoint every N steps: --save_strategy steps, or --save_steps given on its own."""
    return checkpoint.save_interval(cfg.training, max_steps, cfg.sources)


def write_state(folder, log_history: list[dict], step: int, max_steps: int) -> None:
    """trainer_state.json with the per-step log_history (the Trainer's format), written atomically (rank 0)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(folder) / "trainer_state.json",
                      {"global_step": step, "max_steps": max_steps, "log_history": log_history})


def save_final(engine, hf_ds, tokenizer, output_dir, log_history, step: int, max_steps: int) -> None:
    """Write everything to a staging folder, then move it in file by file with config.json / adapter_config.json
    last, so a crash never leaves a folder that looks complete but is not (like finetune.outputs.save_final)."""
    import torch.distributed as dist

    staging = staging_dir(output_dir)
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(staging, ignore_errors=True)
    model = engine.module
    is_adapter = hasattr(model, "peft_config")
    state_dict = None
    if hf_ds.is_zero3():
        # Every rank takes part in gathering the partitions; rank 0 gets the whole state dict (on CPU).
        # For an adapter only the trainable (LoRA) weights are needed.
        state_dict = compat.zero3_consolidated_state_dict(engine, exclude_frozen_parameters=is_adapter)
    if rank0:
        model.config.use_cache = True  # turned off for training; the saved model is for inference
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        write_state(staging, log_history, step, max_steps)
    # Under ZeRO-3 each rank holds a slice, so the gathered state dict is the reference; else the model itself.
    try:
        verify_staged(staging, state_dict if state_dict is not None else model, is_main=rank0)
    except VerificationError as e:
        exit_with(str(e))
    if rank0:
        commit_staged(staging, output_dir)
    dist.barrier()


if __name__ == "__main__":
    main()
