"""A training run's lifecycle around the loop, the same on all three paths: resume (`latest`), the output folder's
guard and the run's fingerprint, the data and the plan check at start, the batch arithmetic it prints, and the
atomic, verified final save. A user's mistake found here stops every rank with one message (finetune.process)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from finetune.models import attention
from finetune.process import exit_with

# Written last when moving a finished save into place: its presence marks a complete model folder.
_COMMIT_LAST = ("config.json", "adapter_config.json")
# The Trainer pickles its arguments next to the model; we keep outputs pickle-free (finetune_config.yaml holds the config).
_DROP = ("training_args.bin",)


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def rank0_print(*args, **kwargs) -> None:
    if is_rank0():
        print(*args, **kwargs, flush=True)


def write_failure(folder: str | Path, exc: BaseException) -> str | None:
    """What stopped a write into `folder`, in words, when it is the disk's or the folder's fault (full, read-only,
    not permitted); None for anything else. torch.save words a full disk as "basic_ios::clear: iostream error" and
    safetensors as an I/O error, so a full disk is also recognized by a probe write failing with ENOSPC."""
    import errno
    import tempfile

    place = Path(folder)
    while not place.is_dir() and place != place.parent:
        place = place.parent
    mount = place.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    code = getattr(exc, "errno", None)
    if code is None:
        try:
            with tempfile.TemporaryFile(dir=place) as f:
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            code = e.errno
    if code == errno.ENOSPC:
        return f"no space left on {mount} (writing {folder})"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT):
        return f"cannot write {folder}: {os.strerror(code)}"
    return None


@contextlib.contextmanager
def saving(folder: str | Path, what: str, *, partial: Path | None = None):
    """Run a save; if the disk or folder refuses it (write_failure), remove `partial` (the half-written folder, never
    a complete one) and exit 2 with the place, saying that what was saved before is intact."""
    try:
        yield
    except Exception as e:  # OSError, torch's RuntimeError, safetensors' SafetensorError: write_failure decides
        reason = write_failure(folder, e)
        if reason is None:
            raise
        if partial is not None and is_rank0():
            shutil.rmtree(partial, ignore_errors=True)
        exit_with(f"{reason}: {what} was not saved; the checkpoints and model saved before are intact. Free space "
                  "(or keep fewer checkpoints: --save_total_limit N), then rerun with --resume_from_checkpoint latest")


def fsdp_version(preset) -> int:
    """The FSDP version a preset shards with (2), 0 without FSDP: what a checkpoint's marker records."""
    return int(preset.fsdp.get("version", 2)) if getattr(preset, "is_fsdp", False) else 0


def resume_or_exit(cfg, *, path: str, world_size: int) -> Path | None:
    """--resume_from_checkpoint -> the folder to resume from (None: start at step 0). Checked before anything heavy
    loads: a cut-off checkpoint, or one for another path, world size or ZeRO stage, exits with what to do; so does an
    output folder holding another run's model or checkpoints (guard_output_dir). `latest` on a run that has already
    saved its final model exits 0 with nothing done (every rank alike)."""
    from finetune.training import checkpoint, runlock

    args = cfg.training
    # One run per output folder: rank 0 takes the folder's lock before anything else looks at or writes into it.
    problem, run = (runlock.acquire(args.output_dir), runlock.held_run()) if is_rank0() else (None, None)
    problem, run = next((v for v in checkpoint.gather((problem, run)) if v[0] or v[1]), (problem, run))
    if problem:
        exit_with(problem)
    runlock.adopt(run)
    if is_rank0():  # a killed run's staging folder (the lock is ours: nobody else's)
        for leftover in Path(args.output_dir).glob(".staging-final*"):
            shutil.rmtree(leftover, ignore_errors=True)
    finished = guard_output_dir(cfg)
    if args.resume_from_checkpoint == "latest":
        # Collective: a final model that only some nodes see (no shared filesystem) must not finish those ranks and
        # leave the others training alone.
        views = checkpoint.gather(finished)
        if len(set(views)) > 1:
            exit_with(checkpoint.disagreement("latest", args.output_dir, [
                None if step is None else f"final model (global_step {step})" for step in views]))
    if finished is not None and args.resume_from_checkpoint == "latest":
        rank0_print(f"resume: {args.output_dir} already holds this run's final model (global_step {finished}); "
                    "nothing to do. To train further raise --max_steps; to train it again use a new --output_dir "
                    "or --overwrite_output_dir")
        checkpoint.end_process_group()
        raise SystemExit(0)
    try:
        return checkpoint.resolve(args.resume_from_checkpoint, args.output_dir, path=path,
                                  world_size=world_size, zero_stage=cfg.preset.stage, nvme=cfg.preset.uses_nvme,
                                  fingerprint=cfg.fingerprint, fsdp=fsdp_version(cfg.preset),
                                  sequence_parallel=cfg.launch.sequence_parallel_size)
    except checkpoint.ResumeError as e:
        exit_with(str(e))


# ----------------------------------------------------------------------------------------------
# The run fingerprint: what makes two runs the same run (model, data, and the flags that change the result). It is
# recorded in every checkpoint marker and in the final finetune_config.yaml, so that a run never resumes from, or
# writes over, another run's outputs.

FINGERPRINT_LINE = "# finetune run fingerprint: "
# Keys that do not change what is trained (where it is written, how often it is logged or saved, how long it runs:
# raising --max_steps continues the same run), or that are covered by content hashes (model and data paths), or
# that the checkpoint marker checks with a better message (preset: ZeRO stage, world size).
_NOT_FINGERPRINTED = {
    "model_name_or_path", "dataset", "dataset_cache_dir", "output_dir", "logging_dir", "run_name", "report_to",
    "resume_from_checkpoint", "overwrite_output_dir", "max_steps", "num_train_epochs", "save_steps",
    "save_strategy", "save_total_limit", "logging_steps", "logging_strategy", "logging_first_step", "disable_tqdm",
    "plan_check", "force", "config", "nvme_path", "dataloader_num_workers", "dataloader_pin_memory",
    # where the result is pushed (finetune.ship.hub), not what is trained
    "push_to_hub", "hub_model_id", "hub_private_repo", "hub_strategy", "hub_always_push",
}
_SAMPLE = 1 << 20  # bytes hashed from each end of a large file
_WHOLE = 64 << 20  # files up to this size are hashed whole


def _hash_file(h, f: Path) -> None:
    size = f.stat().st_size
    h.update(f"{f.name}:{size}:".encode())
    with open(f, "rb") as fh:
        if size <= _WHOLE:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        else:  # weights of a real model: both ends (header with every tensor name and shape, last tensor's values)
            h.update(fh.read(_SAMPLE))
            fh.seek(size - _SAMPLE)
            h.update(fh.read(_SAMPLE))


def _hash_path(path, patterns=("*",)) -> str:
    import hashlib

    h, p = hashlib.sha256(), Path(path)
    if p.is_file():
        _hash_file(h, p)
    elif p.is_dir():
        for f in sorted({f for pattern in patterns for f in p.rglob(pattern) if f.is_file()}):
            h.update(str(f.relative_to(p)).encode())
            _hash_file(h, f)
    else:
        h.update(str(path).encode())
    return h.hexdigest()[:16]


def run_fingerprint(cfg) -> dict:
    """{"model", "data", "config"}: short hashes of the model's config and weights, the data, and the flags."""
    import hashlib

    flags = {k: v for k, v in cfg.resolved().items() if k not in _NOT_FINGERPRINTED}
    return {
        "model": _hash_path(cfg.model.model_name_or_path, ("config.json", "*.safetensors", "*.bin")),
        "data": "+".join(_hash_path(d) for d in cfg.data.datasets()),
        "config": hashlib.sha256(json.dumps(flags, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "adapter": bool(cfg.model.use_peft),  # what the checkpoints hold (checkpoint.check_same_model)
    }


def saved_fingerprint(output_dir) -> dict | None:
    """The fingerprint in a final finetune_config.yaml, or None (absent: not a run of this version of finetune)."""
    f = Path(output_dir) / "finetune_config.yaml"
    if f.is_file():
        for line in f.read_text().splitlines():
            if line.startswith(FINGERPRINT_LINE):
                try:
                    return json.loads(line[len(FINGERPRINT_LINE):])
                except ValueError:
                    return None
    return None


def _differs(ours: dict, theirs: dict | None) -> str:
    if not isinstance(theirs, dict):
        return "it records no finetune run fingerprint"
    parts = {"model": "another model", "data": "other data", "config": "other training flags"}
    what = [text for key, text in parts.items() if theirs.get(key) != ours[key]]
    return "it was trained on " + " and ".join(what) if what else ""


def guard_output_dir(cfg) -> int | None:
    """Refuse (exit 2, every rank) an --output_dir that holds another run's final model or checkpoints, unless
    --overwrite_output_dir (which then retires them: checkpoints removed, the old model's config files removed so
    it no longer looks finished). Returns the final model's global_step when the folder holds THIS run's finished
    model (global_step at least --max_steps), else None."""
    import shutil

    from finetune.training import checkpoint

    args, out = cfg.training, Path(cfg.training.output_dir)
    ours = run_fingerprint(cfg)
    cfg.fingerprint = ours
    foreign, stale, final, final_why = [], [], None, ""
    # No early return before the collective below: a rank that finds no folder yet must still join it, since
    # another rank may look after rank 0 has created the folder (a hang seen in a ZeRO-3 run).
    if out.is_dir():
        for folder in sorted(p for p in out.iterdir() if p.is_dir() and checkpoint._STEP.match(p.name)):
            if checkpoint.problem(folder) is not None:
                stale.append(folder)
                continue
            why = _differs(ours, checkpoint.read_meta(folder).get("fingerprint"))
            if why:
                foreign.append((folder, why))
        final = next((out / n for n in _COMMIT_LAST if (out / n).is_file()), None)
        final_why = _differs(ours, saved_fingerprint(out)) if final is not None else ""
        if final_why:
            foreign.insert(0, (out, final_why))
    overwrite = cfg.launch.overwrite_output_dir
    # Collective (every rank has looked before rank 0 removes anything): nodes without a shared filesystem see
    # different folders, and what any rank finds stops every rank. The branches below that exit or reach a barrier
    # follow the gathered view, so every rank takes the same one.
    seen = [f for f in checkpoint.gather(foreign[0] if foreign else None) if f is not None]
    if seen and not overwrite:
        where, why = seen[0]
        what = "a final model" if where == out else f"the checkpoint {where.name}"
        exit_with(f"--output_dir {out} holds {what} of another run ({why}); a run never writes over or resumes "
                  "another run's outputs. Use a new --output_dir, or --overwrite_output_dir to replace them")
    if seen and overwrite:
        if is_rank0():
            for folder, _ in foreign:
                if folder != out:
                    shutil.rmtree(folder)
            for folder in stale:
                shutil.rmtree(folder, ignore_errors=True)
            if final_why:
                for name in (*_COMMIT_LAST, "finetune_config.yaml", "trainer_state.json"):
                    (out / name).unlink(missing_ok=True)
            print(f"--overwrite_output_dir: retired another run's outputs in {out}", file=sys.stderr, flush=True)
        _barrier()
        return None
    if final is None:
        return None
    try:
        state = json.loads((out / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    target = args.max_steps if args.max_steps > 0 else state.get("max_steps", 0)
    return state["global_step"] if state.get("global_step", 0) >= max(target, 1) else None


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def write_resolved(cfg, folder) -> None:
    """finetune_config.yaml (a recipe that reproduces the run) with the run fingerprint, into a final save's folder."""
    from finetune import config as C

    target = C.save_resolved(cfg, folder)
    fingerprint = getattr(cfg, "fingerprint", None) or run_fingerprint(cfg)
    target.write_text(f"{FINGERPRINT_LINE}{json.dumps(fingerprint, sort_keys=True)}\n{target.read_text()}")


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
    split = getattr(getattr(cfg, "launch", None), "sequence_parallel_size", 1)
    global_batch = micro * accum * (world // split)
    processes = (f"{world // split} data-parallel groups of {split} processes (sequence parallel: each record split "
                 f"over {split})" if split > 1 else f"{world} processes")
    mean_len = stats.tokens / max(stats.examples, 1)
    # ZeRO-3 leaves each parameter an empty placeholder; ds_numel is its real size.
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return "\n".join([
        f"parallelism: {cfg.preset.describe()}, world size {world}, device {args.device}",
        f"batch: {micro} per device x {accum} accumulation x {processes} = global batch {global_batch}",
        _tokens_per_step(cfg, stats, global_batch, mean_len),
        f"parameters: {trainable:,} trainable of {total:,}",
        _precision(cfg, model),
        "weights: partitioned across ranks at load (ZeRO-3)" if any(hasattr(p, "ds_id") for p in model.parameters())
        else "weights: loaded whole, then sharded across ranks by FSDP2 (fully_shard) when the path prepares the model"
        if getattr(cfg.preset, "is_fsdp", False) else "weights: a full copy on every rank",
    ] + ([attention.describe(_device_type(args), model.config, getattr(model, "dtype", None))]
         if getattr(getattr(model, "config", None), "_attn_implementation", None) == attention.VARLEN else []))


def _device_type(args) -> str:
    device = getattr(args, "device", "cpu")
    return getattr(device, "type", str(device).split(":")[0])


def _precision(cfg, model) -> str:
    """Weights' dtype and the mixed precision in force; a GPU's bf16 default says it is one."""
    args = cfg.training
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()})
    mixed = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    if mixed is None:
        return f"precision: weights {'/'.join(dtypes)}, no mixed precision"
    why = " (the default on this GPU; --bf16 false turns it off)" if mixed == "bf16" and "bf16" not in \
        getattr(cfg, "sources", {"bf16": "cli"}) else ""
    return f"precision: weights {'/'.join(dtypes)}, {mixed} mixed precision (autocast){why}"


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
    if getattr(stats, "format", "") == "preference":  # a pair is two rows: prompt + chosen, prompt + rejected
        return (f"tokens/step: up to {global_batch} pairs x 2 rows x {cfg.data.max_seq_length} = {2 * slots}; about "
                f"{global_batch * mean_len:.0f} at the data's mean of {mean_len:.1f} per pair")
    return f"tokens/step: up to {global_batch} x {cfg.data.max_seq_length} = {slots}; {real}"


def staging_dir(output_dir: str | Path) -> Path:
    """The final save's temporary folder, named for this run (runlock.run_id): no other run's is the same."""
    from finetune.training import runlock

    run = runlock.run_id()
    return Path(output_dir) / (f".staging-final-{run}" if run else ".staging-final")


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
    from finetune.training import runlock

    runlock.release()  # the run's outputs are in place: the folder is free for the next run (a resume)


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


def save_final_trainer(trainer, output_dir: str | Path, cfg=None) -> None:
    """Trainer path: model (or adapter) + tokenizer + trainer_state.json, staged, verified, then committed."""
    staging = staging_dir(output_dir)
    if trainer.args.should_save:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    # Training turns the KV cache off; the saved model is for inference, where the cache is the default.
    from finetune.models.load import set_use_cache

    set_use_cache(trainer.accelerator.unwrap_model(trainer.model).config, True)
    # Every rank calls save_model: under ZeRO-3 it gathers the partitioned weights. Under FSDP2 with sharded state
    # dicts save_model writes nothing: every rank gathers the shards (collective) and rank 0 writes the whole model.
    fsdp_state_dict = None
    with saving(staging, "the final model", partial=staging):
        if getattr(trainer.accelerator, "is_fsdp2", False):
            fsdp_state_dict = trainer.accelerator.get_state_dict(trainer.model)
            if trainer.args.should_save:
                trainer._save(str(staging), state_dict=fsdp_state_dict)
        else:
            trainer.save_model(str(staging))
    trainer.accelerator.wait_for_everyone()
    accelerator = trainer.accelerator
    if trainer.is_deepspeed_enabled and accelerator.state.deepspeed_plugin.zero_stage == 3:
        reference = accelerator.get_state_dict(trainer.model_wrapped)  # collective: gathers the partitions
    elif getattr(accelerator, "is_fsdp2", False):
        reference = fsdp_state_dict  # gathered once, for the save and its check
    else:
        reference = accelerator.unwrap_model(trainer.model)
    verify_staged(staging, reference, is_main=accelerator.is_main_process)
    if trainer.args.should_save:
        with saving(staging, "the final model", partial=staging):
            trainer.state.save_to_json(str(staging / "trainer_state.json"))
            if cfg is not None:
                write_resolved(cfg, staging)
        commit_staged(staging, output_dir)
    trainer.accelerator.wait_for_everyone()


# ----------------------------------------------------------------------------------------------
# After the final save: the trackers' runs ended, then --push_to_hub.


def end_tracker_runs() -> None:
    """End the trackers' open runs. A training process ends without the interpreter's shutdown (finetune.process),
    which is where wandb would finish its run: unfinished, its offline run file holds nothing. MLflow's callback ends
    its run at on_train_end already; ending it here too covers a run it left open."""
    wandb, mlflow = sys.modules.get("wandb"), sys.modules.get("mlflow")
    # The model is saved and verified: a tracker that fails now says so in one line and does not hide it.
    try:
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.finish()
    except Exception as e:  # noqa: BLE001 - any tracker's error; the run's result stands
        _tracker_warning("wandb", e)
    try:
        if mlflow is not None and hasattr(mlflow, "active_run") and mlflow.active_run() is not None:
            mlflow.end_run()
    except Exception as e:  # noqa: BLE001
        _tracker_warning("mlflow", e)


def _tracker_warning(name: str, e: Exception) -> None:
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    print(f"finetune: warning: report_to {name}: ending its run failed ({first}); the trained model is saved as usual",
          file=sys.stderr, flush=True)


def finish_run(cfg) -> None:
    """The last step of every path, once the final save is verified and committed (the process group already
    ended): on the main process, the trackers' runs ended, then the push of the output folder (finetune.ship.hub:
    one commit with a model card; a failure exits 1 and leaves the folder as it is)."""
    if not is_rank0():
        return
    end_tracker_runs()
    args = cfg.training
    if getattr(args, "push_to_hub", False):
        from finetune.ship import hub

        out = Path(args.output_dir)
        what = "LoRA adapter" if (out / "adapter_config.json").is_file() else "model"
        hub.push_or_exit(out, hub.run_files(out, write_report=True), run_folder=out, what=what,
                         repo_id=args.hub_model_id, private=args.hub_private_repo, token=args.hub_token)

