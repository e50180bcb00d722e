"""What a run prints and writes (the batch arithmetic at start, atomic final outputs), and how it stops on a user's
mistake: one message from rank 0, exit 2 on every rank (each rank reaches the same check, so none is left waiting)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

# Written last when moving a finished save into place: its presence marks a complete model folder.
_COMMIT_LAST = ("config.json", "adapter_config.json")
# The Trainer pickles its arguments next to the model; we keep outputs pickle-free (finetune_config.yaml holds the config).
_DROP = ("training_args.bin",)


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def rank0_print(*args, **kwargs) -> None:
    if is_rank0():
        print(*args, **kwargs, flush=True)


def exit_with(message: str) -> NoReturn:
    # Every rank reaches the same error (data errors reach the waiting ranks through the cache), so all exit.
    if is_rank0():
        print(f"finetune: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def resume_or_exit(cfg, *, path: str, world_size: int) -> Path | None:
    """--resume_from_checkpoint -> the folder to resume from (None: start at step 0). Checked before anything heavy
    loads: a cut-off checkpoint, or one for another path, world size or ZeRO stage, exits with what to do."""
    from finetune.training import checkpoint
    from finetune import config as C

    try:
        return checkpoint.resolve(cfg.training.resume_from_checkpoint, cfg.training.output_dir, path=path,
                                  world_size=world_size, zero_stage=C.zero_stage_of(cfg.launch.config) or 0,
                                  nvme=C.uses_nvme(cfg.deepspeed_config))
    except checkpoint.ResumeError as e:
        exit_with(str(e))


def data_or_exit(cfg, local_rank: int):
    """(tokenizer, tokenized data set, stats): tokenized once per node (local rank 0) and cached; a bad record stops
    every rank with its file and line; rank 0 prints the data summary."""
    from finetune.data.prepare import DataError, prepare_dataset
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    try:
        dataset, stats = prepare_dataset(cfg.data, tokenizer, local_rank=local_rank, log=rank0_print)
    except DataError as e:
        exit_with(f"data error: {e}")
    rank0_print(stats.summary())
    return tokenizer, dataset, stats


def plan_or_exit(cfg) -> None:
    """--plan_check: refuse (exit 2, every rank alike) a run the planner predicts will not fit, unless --force."""
    if not cfg.launch.plan_check:
        return
    from finetune.plan.planner import plan_check

    if problem := plan_check(cfg):
        if not cfg.launch.force:
            exit_with(problem)
        rank0_print(f"{problem}\n--force: starting anyway")


def describe_run(cfg, stats, model, world: int | None = None) -> str:
    """The batch arithmetic (per-device x accumulation x world = global) and the preset in force."""
    args = cfg.training
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    world = args.world_size if world is None else world
    global_batch = micro * accum * world
    mean_len = stats.tokens / max(stats.examples, 1)
    # ZeRO-3 leaves each parameter an empty placeholder; ds_numel is its real size.
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    preset = cfg.launch.config
    ds = f" ({cfg.deepspeed_config})" if cfg.deepspeed_config and str(cfg.deepspeed_config) != preset else ""
    return "\n".join([
        f"parallelism: {preset}{ds}, world size {world}, device {args.device}",
        f"batch: {micro} per device x {accum} accumulation x {world} processes = global batch {global_batch}",
        _tokens_per_step(cfg, stats, global_batch, mean_len),
        f"parameters: {trainable:,} trainable of {total:,}",
        "weights: partitioned across ranks at load (ZeRO-3)" if any(hasattr(p, "ds_id") for p in model.parameters())
        else "weights: a full copy on every rank",
    ])


def _tokens_per_step(cfg, stats, global_batch: int, mean_len: float) -> str:
    slots = global_batch * cfg.data.max_seq_length
    rows = getattr(stats, "packed_rows", 0)
    if rows:
        # A packed step is global_batch rows (not records): its slots are nearly all real tokens.
        eff = stats.packing_efficiency
        return (f"tokens/step: {global_batch} packed rows x {cfg.data.max_seq_length} = {slots} slots; "
                f"about {slots * eff:.0f} real tokens at packing efficiency {100 * eff:.1f}% "
                f"(about {stats.examples / rows:.1f} records per row)")
    real = f"about {global_batch * mean_len:.0f} at the data's mean length {mean_len:.1f}"
    if getattr(stats, "padding_free", False):
        return f"tokens/step: {real}, no padding slots (padding-free: one flattened row per micro-batch)"
    return f"tokens/step: up to {global_batch} x {cfg.data.max_seq_length} = {slots}; {real}"


def staging_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / ".staging-final"


def commit_staged(staging: Path, output_dir: str | Path) -> None:
    """Move a finished save from `staging` into `output_dir` so that a crash never leaves a folder that looks
    complete but is not: os.replace is atomic per file, and config.json / adapter_config.json go last."""
    out = Path(output_dir)
    for name in _DROP:
        (staging / name).unlink(missing_ok=True)
    files = sorted(p for p in staging.iterdir() if p.is_file())
    files.sort(key=lambda p: p.name in _COMMIT_LAST)
    for name in _COMMIT_LAST:  # an older save's marker must not vouch for half-replaced weights
        (out / name).unlink(missing_ok=True)
    for f in files:
        os.replace(f, out / f.name)
    shutil.rmtree(staging, ignore_errors=True)


def write_json_atomic(path: str | Path, data) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def verify_staged(staging: Path, reference, *, is_main: bool) -> None:
    """Check a staged save before it is committed, on every path: no empty tensors, it reloads with from_pretrained,
    and the reload's logits equal the in-memory model's. `reference`: on the main process, the unwrapped model or
    (under ZeRO-3, where each rank holds a slice) the gathered state dict. Collective when distributed: every rank
    raises if the main process found a fault, so no rank reports success for a save that is not the model."""
    import torch.distributed as dist

    from finetune.models.verify import VerificationError, verify_saved

    verdict = [None]
    if is_main:
        try:
            print(verify_saved(staging, reference), flush=True)
        except VerificationError as e:
            verdict = [str(e)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise VerificationError(f"the final save failed verification and was not committed: {verdict[0]}")


def save_final(trainer, output_dir: str | Path) -> None:
    """Trainer path: model (or adapter) + tokenizer + trainer_state.json, staged, verified, then committed."""
    staging = staging_dir(output_dir)
    if trainer.args.should_save:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    # Training turns the KV cache off; the saved model is for inference, where the cache is the default.
    trainer.accelerator.unwrap_model(trainer.model).config.use_cache = True
    # Every rank calls save_model: under ZeRO-3 it gathers the partitioned weights.
    trainer.save_model(str(staging))
    trainer.accelerator.wait_for_everyone()
    accelerator = trainer.accelerator
    if trainer.is_deepspeed_enabled and accelerator.state.deepspeed_plugin.zero_stage == 3:
        reference = accelerator.get_state_dict(trainer.model_wrapped)  # collective: gathers the partitions
    else:
        reference = accelerator.unwrap_model(trainer.model)
    verify_staged(staging, reference, is_main=accelerator.is_main_process)
    if trainer.args.should_save:
        trainer.state.save_to_json(str(staging / "trainer_state.json"))
        commit_staged(staging, output_dir)
    trainer.accelerator.wait_for_everyone()
