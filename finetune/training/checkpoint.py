"""Step checkpoints shared by the three training paths: the completion marker, `latest`, resume checks.

A checkpoint folder is complete only when its marker (`finetune_checkpoint.json`) exists. The marker is
written last, by rank 0, after a barrier that every rank reaches only once its own files (ZeRO
partitions, RNG states) are written; it lists every file with its size. `latest` is the newest folder
whose marker exists and whose files still have the sizes it lists, so a checkpoint cut off mid-write
(a killed rank, a full disk) is skipped, with a note, instead of being resumed from.

The marker also records the world size, the ZeRO stage (or the FSDP version) and which path wrote it: ZeRO
partitions and FSDP2 shards belong to one world size and stage, and resuming them elsewhere would not load the same
weights and data position, so that is refused with the fix (DeepSpeed's universal checkpoint; FSDP2: the saved
world size, or `finetune export` and a new run) instead of being attempted.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from finetune import compat
from finetune.errors import ResumeError  # noqa: F401  (raised here; compat raises it too)

MARKER = "finetune_checkpoint.json"
PREFIX = "checkpoint-"
# The path names a marker records: "trainer", "loop", "engine". Markers written before the DeepSpeed engine path was
# named "engine" say "sft"; they are that path's checkpoints and still resume on it.
FORMER_PATH_NAMES = {"sft": "engine"}
_STEP = re.compile(rf"^{PREFIX}(\d+)$")


def folder_for(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"{PREFIX}{step}"


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def mark_complete(folder: str | Path, *, path: str, world_size: int, zero_stage: int, global_step: int,
                  fingerprint: dict | None = None, fsdp: int = 0, sequence_parallel: int = 1) -> None:
    """Collective: call on every rank after it has written its part of `folder`.

    The barrier comes first: rank 0 must not vouch for partition files other ranks are still writing.
    A second barrier keeps any rank from starting a step (that a kill could then interrupt) before the
    marker exists, so "checkpoint-k was reported" always means "checkpoint-k is resumable".
    """
    folder = Path(folder)
    _barrier()
    if _rank() == 0:
        paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER and not p.name.startswith(".")]
        files = {str(p.relative_to(folder)): p.stat().st_size for p in paths}
        meta = {"path": path, "world_size": world_size, "zero_stage": zero_stage, "global_step": global_step,
                **({"fsdp": fsdp} if fsdp else {}),
                **({"sequence_parallel": sequence_parallel} if sequence_parallel > 1 else {}), "fingerprint": fingerprint, "files": files,
                HASH: {str(p.relative_to(folder)): file_hash(p) for p in paths}}
        tmp = folder / f".{MARKER}.tmp{os.getpid()}"  # never another process's temporary name
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / MARKER)
    _barrier()


# Content hashes of a checkpoint's files, in its marker. xxh3-128 (xxhash, a dependency of datasets) is not for
# adversaries but finds any garbled byte, and hashes 3x faster than sha256 here (docs/resume.md has the numbers).
HASH = "xxh3_128"


def file_hash(path: Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def garbled(folder: str | Path) -> str | None:
    """The first file of a complete checkpoint whose content differs from what the save wrote (same size, other
    bytes: a disk or copy fault), as a message; None if every file hashes as recorded (or none was recorded)."""
    folder = Path(folder)
    for name, digest in (read_meta(folder).get(HASH) or {}).items():
        if file_hash(folder / name) != digest:
            return (f"{folder / name} is not the file the checkpoint saved (same size, other content: its "
                    f"{HASH} hash differs)")
    return None


def problem(folder: str | Path) -> str | None:
    """Why `folder` is not a complete checkpoint, or None if it is."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        return f"no {MARKER} (the save did not finish)"
    try:
        meta = json.loads(marker.read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MARKER} is unreadable"
    for name, size in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the save wrote {size}"
    return None


def read_meta(folder: str | Path) -> dict:
    return json.loads((Path(folder) / MARKER).read_text())


def latest(output_dir: str | Path, log=None) -> Path | None:
    """The newest complete checkpoint-<step> folder in `output_dir`; incomplete ones are skipped with a note."""
    log = log or _note
    out = Path(output_dir)
    if not out.is_dir():
        return None
    steps = sorted(((int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _STEP.match(p.name))),
                   reverse=True)
    for _, folder in steps:
        why = problem(folder)
        if why is None:
            return folder
        log(f"resume: skipping {folder}: incomplete checkpoint ({why})")
    return None


def _note(message: str) -> None:
    if _rank() == 0:
        print(message, file=sys.stderr, flush=True)


def conversion_hint(folder: Path) -> str:
    # ds_to_universal reads the DeepSpeed tag folder (the one holding the *optim_states.pt partitions).
    tag = next((p.parent for p in sorted(Path(folder).rglob("*optim_states.pt"))), Path(folder))
    return (
        "convert it to a DeepSpeed universal checkpoint first:\n"
        f"    python -m deepspeed.checkpoint.ds_to_universal --input_folder {tag} --output_folder {tag}_universal\n"
        'and load that with "checkpoint": {"load_universal": true} in your DeepSpeed JSON (--config path/to/ds.json)'
    )


def resolve(requested: str | None, output_dir: str | Path, *, path: str, world_size: int, zero_stage: int,
            nvme: bool = False, fingerprint: dict | None = None, fsdp: int = 0,
            sequence_parallel: int = 1) -> Path | None:
    """`--resume_from_checkpoint` (None, `latest` or a folder) -> the folder to resume from, or ResumeError.

    `latest` with no complete checkpoint yet starts from scratch (with a note), so one command line both
    starts a job and restarts it after a crash. A folder named explicitly must be complete and compatible.
    Collective: every rank looks in its own view of `output_dir`, and all must find the same checkpoint (nodes
    without a shared filesystem do not), else every rank raises the same ResumeError; none starts alone.
    """
    if not requested:
        return None
    folder, error = None, None
    try:
        folder = _resolve_here(requested, output_dir, path=path, world_size=world_size, zero_stage=zero_stage,
                               nvme=nvme, fingerprint=fingerprint, fsdp=fsdp, sequence_parallel=sequence_parallel)
    except ResumeError as e:
        error = str(e)
    views = gather((None if folder is None else folder.name, error))
    errors = [(r, e) for r, (_, e) in enumerate(views) if e is not None]
    if errors:
        r, e = errors[0]
        raise ResumeError(e if r == 0 else f"on rank {r}: {e}")
    if len({name for name, _ in views}) > 1:
        raise ResumeError(disagreement(requested, output_dir, [name for name, _ in views]))
    if folder is None:
        _note(f"resume: no complete checkpoint in {output_dir}; starting from step 0")
    else:
        _note(f"resume: from {folder}")
    return folder


SHARED_FS_HINT = ("every rank must see the same checkpoints: put --output_dir on a filesystem all nodes share, or copy "
                  "every node's checkpoint folder into each node's --output_dir (a node writes only its own ranks' "
                  "files) (docs/multi-node.md)")


def disagreement(requested: str, output_dir: str | Path, seen: list) -> str:
    """The refusal when ranks found different checkpoints (or a final model on some ranks only)."""
    groups: dict[str, list[int]] = {}
    for r, name in enumerate(seen):
        groups.setdefault("none" if name is None else str(name), []).append(r)
    views = "; ".join(f"{_ranks(rs)}: {name}" for name, rs in groups.items())
    return (f"--resume_from_checkpoint {requested}: the ranks do not see the same checkpoint in --output_dir "
            f"{output_dir} ({views}), so they would resume from different steps and the job would hang; "
            f"{SHARED_FS_HINT}")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def gather(value) -> list:
    """Every rank's `value` (picklable), in rank order; collective. [value] without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _resolve_here(requested: str, output_dir: str | Path, *, path: str, world_size: int, zero_stage: int,
                  nvme: bool, fingerprint: dict | None, fsdp: int = 0, sequence_parallel: int = 1) -> Path | None:
    """This rank's answer for resolve(), from the files it sees."""
    if requested == "latest":
        folder = latest(output_dir)
        if folder is None:
            return None
    else:
        folder = Path(requested)
        if not folder.is_dir():
            raise ResumeError(f"--resume_from_checkpoint {requested}: no such folder")
        if (why := problem(folder)) is not None:
            raise ResumeError(f"--resume_from_checkpoint {requested}: incomplete checkpoint ({why}); "
                              "resume from an earlier one, or use --resume_from_checkpoint latest")
    check_compatible(folder, path=path, world_size=world_size, zero_stage=zero_stage, fsdp=fsdp,
                     sequence_parallel=sequence_parallel)
    check_same_model(folder, fingerprint)
    if (why := garbled(folder)) is not None:
        raise ResumeError(f"resume: {why}; its weights or optimizer state would be wrong. Resume from an earlier "
                          f"checkpoint (--resume_from_checkpoint {folder.parent / (PREFIX + 'N')}), or remove {folder}")
    # DeepSpeed keeps NVMe-offloaded partitions in the checkpoint's offloaded_tensors/ and leaves them out of the
    # ZeRO files, so neither direction loads (measured: a size-mismatch RuntimeError, or a missing folder).
    saved_nvme = any(folder.rglob("offloaded_tensors"))
    if saved_nvme != nvme:
        raise ResumeError(
            f"{folder} was saved {'with' if saved_nvme else 'without'} NVMe offload and this run is "
            f"{'without' if saved_nvme else 'with'} it; DeepSpeed cannot load ZeRO partitions across that change. "
            + ("Resume with --config zero3_nvme --nvme_path FOLDER." if saved_nvme
               else "Resume with the preset it was saved with (zero3: CPU offload)."))
    return folder


def check_compatible(folder: Path, *, path: str, world_size: int, zero_stage: int, fsdp: int = 0,
                     sequence_parallel: int = 1) -> None:
    meta = read_meta(folder)
    saved_path = FORMER_PATH_NAMES.get(meta["path"], meta["path"])
    if saved_path != path:
        raise ResumeError(f"{folder} was written by the {saved_path} path; resume it with that path "
                          f"(this is the {path} path: the checkpoint formats differ)")
    saved_stage, saved_world, saved_fsdp = meta["zero_stage"], meta["world_size"], meta.get("fsdp", 0)
    if saved_fsdp != fsdp:
        saved, this = (f"FSDP{saved_fsdp}" if saved_fsdp else _plain(saved_stage)), (f"FSDP{fsdp}" if fsdp else _plain(zero_stage))
        other = (f"Resume with --config fsdp2 (or fsdp2_offload), or export it ({export_command(folder)}) and start "
                 "a new run from DIR" if saved_fsdp else
                 f"Resume with the checkpoint's preset, or {conversion_hint(folder)}" if saved_stage else
                 f"Resume with --config ddp, or start a new run from its weights (--model_name_or_path {folder})")
        raise ResumeError(f"{folder} was saved under {saved}, this run uses {this}: the checkpoint formats differ. "
                          + other)
    if saved_fsdp and saved_world != world_size:
        raise ResumeError(f"{folder} holds FSDP{saved_fsdp} shards (and each rank's data position) for {saved_world} "
                          f"processes, this run has {world_size}: rerun with {saved_world} processes "
                          f"(--num_processes {saved_world}), or export it ({export_command(folder)}: one consolidated HF "
                          "folder) and start a new run from DIR without --resume_from_checkpoint")
    saved_split = meta.get("sequence_parallel", 1)
    if saved_split != sequence_parallel:
        # The data position counts micro-batches of the saved run's groups: another N deals other records to them.
        raise ResumeError(f"{folder} was saved by a run with --sequence_parallel_size {saved_split}, this run has "
                          f"{sequence_parallel}: its data position counts micro-batches of groups of {saved_split} "
                          "ranks, so the resumed run would train other records than the run it continues. Resume with "
                          f"--sequence_parallel_size {saved_split}, or start a new run without --resume_from_checkpoint")
    if saved_stage != zero_stage:
        raise ResumeError(f"{folder} was saved under ZeRO stage {saved_stage}, this run uses stage {zero_stage}: "
                          f"use the checkpoint's preset, or {conversion_hint(folder)}")
    if saved_stage > 0 and saved_world != world_size:
        raise ResumeError(f"{folder} holds ZeRO-{saved_stage} partitions for {saved_world} processes, this run has "
                          f"{world_size}: rerun with {saved_world} processes, or {conversion_hint(folder)}")


def export_command(folder: Path) -> str:
    return f"finetune export --zero_checkpoint {folder} --model_name_or_path MODEL --output_dir DIR"


def _plain(stage: int) -> str:
    return f"ZeRO stage {stage}" if stage else "DDP"


def check_same_model(folder: Path, fingerprint: dict | None) -> None:
    """A checkpoint of a LoRA run resumed by a full run (or the reverse), or of another model: its weights would not
    load (a traceback deep in the load), so it is refused with what to do."""
    theirs = read_meta(folder).get("fingerprint") or {}
    if not fingerprint or not theirs:
        return
    if "adapter" in theirs and theirs["adapter"] != fingerprint.get("adapter"):
        saved, this = ("a LoRA adapter (--use_peft)", "every weight") if theirs["adapter"] else \
            ("every weight", "a LoRA adapter (--use_peft)")
        raise ResumeError(f"{folder} is a checkpoint of a run that trained {saved}; this run trains {this}. Resume "
                          f"it with the flags it was saved with ({'with' if theirs['adapter'] else 'without'} "
                          "--use_peft), or start this run without --resume_from_checkpoint")
    if theirs.get("model") and theirs["model"] != fingerprint.get("model"):
        raise ResumeError(f"{folder} was saved from another model than --model_name_or_path (its config or weights "
                          "differ); resume it with the model it was trained from")


def save_interval(args, max_steps: int, sources=()) -> int:
    """Checkpoint every N optimizer steps (0 = never): --save_strategy steps, or --save_steps given on its own
    (finetune.config turns that into save_strategy steps; `sources` covers a config built another way)."""
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy != "steps" and not ("save_steps" in sources and "save_strategy" not in sources):
        return 0
    steps = args.save_steps
    return math.ceil(max_steps * steps) if steps < 1 else int(steps)


# What DeepSpeed's load_checkpoint leaves out, restored after it: a workaround for DeepSpeed internals.
restore_after_load = compat.restore_after_load


def save_rng(folder: str | Path, rank: int) -> None:
    """This rank's RNG states (Python, NumPy, torch CPU/CUDA), the Trainer's file name and keys."""
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    torch.save(state, Path(folder) / f"rng_state_{rank}.pth")


def load_rng(folder: str | Path, rank: int) -> None:
    import random

    import numpy as np
    import torch

    state = torch.load(Path(folder) / f"rng_state_{rank}.pth", weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])


def end_process_group() -> None:
    """Tear the process group down before exit. Where that drops the last reference to the group its gloo workers are
    joined; a reference left (DeepSpeed's, accelerate's) keeps them, and the exit abort they cause in the interpreter
    shutdown is avoided by skipping that shutdown (finetune.process.end_finished_process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
