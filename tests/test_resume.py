"""Exact resume after a crash, in all three training paths, and ZeRO-Infinity (zero3_nvme) in all three.

The fast tests pin the checkpoint rules (finetune/training/checkpoint.py): a checkpoint cut off mid-write is never
`latest`; a ZeRO checkpoint for another world size or stage is refused with the conversion command.

The slow tests, per path (Trainer: finetune/train.py under accelerate launch; the prepare() loop:
finetune/loop.py under accelerate launch; the DeepSpeed engine: scripts/sft.py under the deepspeed
launcher), on 2 processes:
  1. an uninterrupted zero3 run (ZeRO-3, CPU Adam offload), 8 steps, checkpoints every 3 steps;
  2. the same job under zero3_nvme (ZeRO-Infinity: parameters and optimizer states swapped to disk),
     `kill -9` of rank 1 once checkpoint-3 is complete, at the end of step 4 (mid-epoch: 5 steps per epoch);
     the launcher must exit non-zero within a bound, with no rank left running;
  3. the same command with `--resume_from_checkpoint latest` (DeepSpeed 0.19.8's own load under NVMe offload
     loses the unswapped partitions, the Adam moments, step counts and learning rate: checkpoint.restore_after_load
     restores them; both a partition swapped to disk and one kept in memory are run).
The resumed run's per-step losses must equal the uninterrupted run's within 1e-6 over all 8 steps: that
holds only if weights, ZeRO partitions, optimizer (CPU Adam's own step state included), schedule, data
position (mid-epoch and across the epoch boundary) and RNG states all came back, and only if zero3_nvme
computes what zero3 computes (its first 3 steps, before the kill, are held to zero3's as well).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune import compat
from finetune.training import checkpoint
from finetune.models import tiny
from launch import LOOP, TRAIN, deepspeed_launcher, launcher, losses, matrix, run, run_and_kill_rank

# ----------------------------------------------------------------------------------------------
# Fast: completion marker, `latest`, compatibility.


def fake_checkpoint(out: Path, step: int, *, complete: bool = True, world_size: int = 2, zero_stage: int = 3,
                    path: str = "trainer") -> Path:
    folder = checkpoint.folder_for(out, step)
    (folder / "global_step").mkdir(parents=True)
    for rank in range(world_size):
        (folder / "global_step" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x" * (100 + rank))
    (folder / "trainer_state.json").write_text("{}")
    if complete:
        checkpoint.mark_complete(folder, path=path, world_size=world_size, zero_stage=zero_stage, global_step=step)
    return folder


def test_latest_skips_cut_off_checkpoints(tmp_path, capsys):
    out = tmp_path / "out"
    good = fake_checkpoint(out, 3)
    assert checkpoint.latest(out) == good
    # A newer save that was killed before its marker: skipped.
    fake_checkpoint(out, 6, complete=False)
    # A newer one whose marker exists but one partition file was cut short afterwards (or copied in part).
    cut = fake_checkpoint(out, 9)
    partition = cut / "global_step" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    partition.write_bytes(partition.read_bytes()[:50])
    # And one whose partition file disappeared.
    gone = fake_checkpoint(out, 12)
    (gone / "global_step" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    (out / "checkpoint-x").mkdir()  # not a step folder: ignored
    assert checkpoint.latest(out) == good
    err = capsys.readouterr().err
    assert "skipping" in err and "checkpoint-6: incomplete checkpoint (no finetune_checkpoint.json" in err
    assert "checkpoint-9: incomplete checkpoint (global_step/zero_pp_rank_1_mp_rank_00_optim_states.pt has 50 bytes, the save wrote 101)" in err
    assert "checkpoint-12: incomplete checkpoint (global_step/zero_pp_rank_0_mp_rank_00_optim_states.pt is missing)" in err
    # Numeric order, not text order: checkpoint-10 is newer than checkpoint-9.
    newest = fake_checkpoint(out, 10)
    assert checkpoint.latest(out) == newest


def test_resolve(tmp_path, capsys):
    out = tmp_path / "out"
    kw = dict(path="trainer", world_size=2, zero_stage=3)
    assert checkpoint.resolve(None, out, **kw) is None
    assert checkpoint.resolve("latest", out, **kw) is None  # nothing saved yet: the same command starts the job
    assert "no complete checkpoint" in capsys.readouterr().err
    good = fake_checkpoint(out, 3)
    cut = fake_checkpoint(out, 6, complete=False)
    assert checkpoint.resolve("latest", out, **kw) == good
    assert checkpoint.resolve(str(good), out, **kw) == good
    with pytest.raises(checkpoint.ResumeError, match="incomplete checkpoint .no finetune_checkpoint.json"):
        checkpoint.resolve(str(cut), out, **kw)
    with pytest.raises(checkpoint.ResumeError, match="no such folder"):
        checkpoint.resolve(str(out / "checkpoint-99"), out, **kw)
    # NVMe-offloaded partitions live in offloaded_tensors/, outside the ZeRO files: no switching at resume.
    with pytest.raises(checkpoint.ResumeError, match="saved without NVMe offload and this run is with it"):
        checkpoint.resolve("latest", out, **kw, nvme=True)
    (good / "global_step" / "offloaded_tensors" / "rank00").mkdir(parents=True)
    with pytest.raises(checkpoint.ResumeError, match="saved with NVMe offload and this run is without it.*--config zero3_nvme"):
        checkpoint.resolve("latest", out, **kw)
    assert checkpoint.resolve("latest", out, **kw, nvme=True) == good


@pytest.mark.parametrize("change, message", [
    (dict(world_size=1), "holds ZeRO-3 partitions for 2 processes, this run has 1: rerun with 2 processes, or convert"),
    (dict(world_size=4), "holds ZeRO-3 partitions for 2 processes, this run has 4"),
    (dict(zero_stage=2), "was saved under ZeRO stage 3, this run uses stage 2"),
    (dict(path="engine"), "was written by the trainer path; resume it with that path"),
])
def test_incompatible_checkpoint_is_refused_with_the_conversion(tmp_path, change, message):
    folder = fake_checkpoint(tmp_path, 3)
    kw = {**dict(path="trainer", world_size=2, zero_stage=3), **change}
    with pytest.raises(checkpoint.ResumeError) as e:
        checkpoint.resolve("latest", tmp_path, **kw)
    assert message in str(e.value)
    if "path" not in change:
        assert (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {folder / 'global_step'} "
                f"--output_folder {folder / 'global_step'}_universal") in str(e.value)
        assert '"load_universal": true' in str(e.value)


def test_a_checkpoint_of_the_engine_path_under_its_former_name_still_resumes(tmp_path):
    """Markers written before the DeepSpeed engine path was named "engine" say "sft": the engine path resumes them,
    and another path refuses them naming the engine path."""
    folder = fake_checkpoint(tmp_path, 3, path="sft")
    kw = dict(world_size=2, zero_stage=3)
    assert checkpoint.resolve("latest", tmp_path, path="engine", **kw) == folder
    with pytest.raises(checkpoint.ResumeError) as e:
        checkpoint.resolve("latest", tmp_path, path="loop", **kw)
    assert "was written by the engine path; resume it with that path (this is the loop path" in str(e.value)


def test_ddp_checkpoint_resumes_on_another_world_size(tmp_path):
    # Without ZeRO every rank holds the whole optimizer state: nothing is tied to the world size.
    folder = fake_checkpoint(tmp_path, 3, zero_stage=0)
    assert checkpoint.resolve("latest", tmp_path, path="trainer", world_size=4, zero_stage=0) == folder


def test_the_conversion_command_exists():
    """The module the message names is the installed DeepSpeed's, with the flags it names."""
    import deepspeed.checkpoint.ds_to_universal as module
    import inspect

    source = inspect.getsource(module)
    assert "'--input_folder'" in source and "'--output_folder'" in source
    from deepspeed.runtime.constants import LOAD_UNIVERSAL_CHECKPOINT

    assert LOAD_UNIVERSAL_CHECKPOINT == "load_universal"


def test_save_steps_alone_enables_step_checkpoints(tmp_path, tiny_chatml):
    from finetune import config as C

    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.synthetic_records(4))
    common = ["--model_name_or_path", str(tiny_chatml), "--dataset", str(data), "--output_dir", str(tmp_path / "o")]
    assert C.parse(common + ["--save_steps", "7"]).training.save_strategy.value == "steps"
    assert C.parse(common + ["--save_steps", "7", "--save_strategy", "no"]).training.save_strategy.value == "no"
    assert C.parse(common).training.save_strategy.value == "no"
    cfg = C.parse(common + ["--save_steps", "7", "--resume_from_checkpoint", "latest"])
    assert checkpoint.save_interval(cfg.training, 20) == 7 and cfg.training.resume_from_checkpoint == "latest"


def test_cpu_adam_replay_is_bit_exact(one_thread):
    """A DeepSpeedCPUAdam rebuilt from a saved state and replayed continues exactly like the original;
    without the replay it does not (the kernel's bias correction is computed differently)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def make(seed=0):
        torch.manual_seed(seed)
        p = torch.nn.Parameter(torch.randn(4096))
        return p, DeepSpeedCPUAdam([p], lr=1e-2, weight_decay=0.01)

    def steps(p, opt, start, stop):
        for t in range(start, stop):
            g = torch.Generator().manual_seed(t)
            p.grad = torch.randn(p.shape, generator=g)
            opt.step()

    p, opt = make()
    steps(p, opt, 0, 30)
    saved_p, saved_state = p.detach().clone(), copy.deepcopy(opt.state_dict())
    steps(p, opt, 30, 40)
    reference = p.detach().clone()

    def resumed(replay: bool):
        q, opt2 = make(seed=1)
        with torch.no_grad():
            q.copy_(saved_p)
        opt2.load_state_dict(saved_state)
        if replay:
            assert compat.replay_cpu_adam(SimpleNamespace(optimizer=opt2)) == 30
        steps(q, opt2, 30, 40)
        return q.detach()

    assert torch.equal(resumed(replay=True), reference)
    assert not torch.equal(resumed(replay=False), reference)


# ----------------------------------------------------------------------------------------------
# Slow: kill -9 of one rank, resume, same losses; zero3_nvme agrees with zero3. One set of runs per case.

STEPS, SAVE, KILL_AFTER = 8, 3, 3
PATHS = {
    "trainer": lambda: launcher("accelerate", 2, script=TRAIN),
    "loop": lambda: launcher("accelerate", 2, script=LOOP),
    "engine": lambda: deepspeed_launcher(2),
}
# DeepSpeed swaps an optimizer sub-group to disk only from 1 MiB up: hidden 192 puts each rank's partition
# (~430k fp32 values) on disk, hidden 64 (~69k) stays in memory under zero3_nvme. Both must resume exactly.
HIDDEN = {"swapped": 192, "unswapped": 64}
# CI: the Trainer with the optimizer swapped to disk (the swap is the engine's, whichever launcher started it); the
# engine's and the loop's resumes in CI are the later-epoch ones below; every cell with FINETUNE_FULL_MATRIX=1.
CASES = matrix([("trainer", "swapped"), ("loop", "swapped"), ("engine", "swapped"), ("engine", "unswapped")],
               [("trainer", "swapped")])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    models = {size: tiny.build(root / f"model-{size}", style="chatml", hidden=hidden) for size, hidden in HIDDEN.items()}
    # 40 records, global batch 8: 5 steps per epoch, so step 3 is mid-epoch and steps 6-8 are in epoch 2.
    data = tiny.write_jsonl(root / "data.jsonl", tiny.synthetic_records(40, seed=7))
    return root, models, data


def command(setup, path: str, out: Path, preset: str, *extra: str, size: str = "swapped") -> list[str]:
    root, models, data = setup
    nvme = ["--nvme_path", str(out.parent / f"{out.name}-swap")] if preset == "zero3_nvme" else []
    return PATHS[path]() + [
        "--config", preset, *nvme, "--model_name_or_path", str(models[size]), "--dataset", str(data),
        "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"), "--max_steps", str(STEPS),
        "--per_device_train_batch_size", "4", "--learning_rate", "2e-3", "--warmup_steps", "2", "--seed", "1234",
        "--max_seq_length", "128", "--disable_tqdm", "true", "--save_steps", str(SAVE), *extra,
    ]


@pytest.fixture(scope="module")
def report() -> dict[str, dict]:
    """Timings and loss differences per case, written to FINETUNE_RESUME_REPORT (when set) as they come."""
    return {}


@pytest.fixture(scope="module")
def runs(setup, report):
    """(path, size) -> (uninterrupted zero3 output, killed zero3_nvme Killed, output folder, resumed Result)."""
    cache: dict[tuple, tuple] = {}

    def get(path: str, size: str):
        if (path, size) in cache:
            return cache[path, size]
        root = setup[0]
        ref = root / f"{path}-{size}-zero3"
        out = root / f"{path}-{size}-nvme"
        cmd = command(setup, path, out, "zero3_nvme", "--resume_from_checkpoint", "latest", size=size)

        def timed(fn, *args, **kw):
            start = time.time()
            return fn(*args, **kw), time.time() - start

        # The uninterrupted run and the killed one do not depend on each other: side by side (each its own port,
        # folder and left-behind check; the data cache is shared under its lock, as ranks share it).
        with ThreadPoolExecutor(2) as pool:
            reference = pool.submit(timed, run, command(setup, path, ref, "zero3", size=size), timeout=600)
            # Rank 1 stops itself at the end of the step after checkpoint-3 (mid-epoch) and is killed there: on a
            # loaded machine a harness that only watched for checkpoint-3 came too late for this 2 s run.
            killing = pool.submit(timed, run_and_kill_rank, cmd, out / f"checkpoint-{KILL_AFTER}" / checkpoint.MARKER,
                                  rank=1, timeout=600, stop_at=(KILL_AFTER + 1, 0.0))
            (reference_result, ref_s), (killed, killed_s) = reference.result(), killing.result()
        reference_result.check()
        start = time.time()
        resumed = run(cmd, timeout=600).check()
        report[f"{path}-{size}"] = {"reference_s": ref_s, "killed_s": killed_s, "resumed_s": time.time() - start,
                                     "exit_after_kill_s": killed.exit_seconds}
        cache[path, size] = (ref, killed, out, resumed)
        return cache[path, size]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("path, size", CASES)
def test_kill_one_rank_then_resume_gives_the_same_losses(path, size, runs, report):
    ref, killed, out, resumed = runs(path, size)
    # The dead rank stopped the job: a non-zero exit, promptly, no rank left behind.
    assert killed.returncode != 0, killed.output[-3000:]
    assert killed.exit_seconds < 90 and not killed.survivors, (killed.exit_seconds, killed.survivors)
    # The resumed run started from the marked checkpoint, not from scratch.
    assert f"resume: from {out / f'checkpoint-{KILL_AFTER}'}" in resumed.output, resumed.output[-3000:]
    expected, got = losses(ref), losses(out)
    assert len(expected) == len(got) == STEPS, (expected, got)
    assert expected[-1] < expected[0] - 0.3, expected  # it really trains
    diff = max(abs(a - b) for a, b in zip(expected, got))
    report[f"{path}-{size}"]["max_loss_diff"] = diff
    assert diff <= 1e-6, f"{path} ({size}): zero3_nvme killed and resumed vs uninterrupted zero3: max |diff| {diff}\n{expected}\n{got}"
    # What ZeRO-Infinity put on disk: the checkpoint carries each rank's swap files (fp32 weights and both Adam
    # moments) when the partition was swapped, and none when it stayed in memory.
    [offloaded] = (out / f"checkpoint-{KILL_AFTER}").rglob("offloaded_tensors")  # the engine's tag folder, per path
    for rank in (0, 1):
        names = sorted(p.name for p in (offloaded / f"rank0{rank}").iterdir())
        kinds = sorted(n.split("-")[0] if "-" in n else "weights" for n in names)
        assert kinds == (["exp_avg", "exp_avg_sq", "weights"] if size == "swapped" else []), names
    write_report(report)


@pytest.mark.slow
def test_world_size_change_is_refused(setup, runs):
    """A 2-process ZeRO-3 checkpoint resumed by 1 process: exit 2 and the conversion command, before training."""
    _, _, out, _ = runs("trainer", "swapped")
    # The checkpoint named: `latest` on this finished run would do nothing (exit 0) before any checkpoint is read.
    cmd = command(setup, "trainer", out, "zero3_nvme", "--resume_from_checkpoint", str(out / f"checkpoint-{KILL_AFTER}"))
    script = cmd.index(TRAIN)
    result = run([sys.executable, *cmd[script:]], timeout=300)
    assert result.returncode == 2, result.output[-3000:]
    assert "holds ZeRO-3 partitions for 2 processes, this run has 1" in result.output
    assert "python -m deepspeed.checkpoint.ds_to_universal --input_folder" in result.output
    assert "{'loss'" not in result.output  # stopped before any step


def write_report(report: dict[str, dict]) -> None:
    target = os.environ.get("FINETUNE_RESUME_REPORT")
    if target:
        Path(target).write_text(json.dumps(report, indent=1))


# ----------------------------------------------------------------------------------------------
# Slow: a mid-epoch resume in a later epoch, kill-free (the uninterrupted run's own checkpoint, resumed in a new
# folder). Before: the Trainer path replayed epoch 0's data order after resuming in epoch 1 (accelerate's
# skip_first_batches hid the batch order from set_epoch). Then the finished job re-run: nothing to do.


@pytest.fixture(scope="module")
def epoch_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("later-epoch")
    model = tiny.build(root / "model", style="chatml")
    # 12 records, 2 ranks x 2 per device: 3 steps per epoch, so checkpoint-4 is one step into the second epoch and
    # steps 7-8 are in the third.
    data = tiny.write_jsonl(root / "data.jsonl", tiny.synthetic_records(12, seed=7))
    return root, model, data


def epoch_command(path: str, epoch_job, out: Path) -> list[str]:
    root, model, data = epoch_job
    return PATHS[path]() + [
        "--config", "ddp", "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
        "--dataset_cache_dir", str(root / "cache"), "--max_steps", "8", "--save_steps", "4",
        "--per_device_train_batch_size", "2", "--learning_rate", "2e-3", "--warmup_steps", "2", "--seed", "1234",
        "--max_seq_length", "128", "--disable_tqdm", "true", "--resume_from_checkpoint", "latest",
    ]


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
# CI: the loop (the Trainer and the engine resume after a kill -9 above; the engine's later-epoch resume is also
# test_an_engine_checkpoint_whose_marker_says_sft_resumes); every path with FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("path", matrix(list(PATHS), ["loop"]))
def test_mid_epoch_resume_in_a_later_epoch_gives_the_same_losses(path, epoch_job):
    import shutil

    root, model, data = epoch_job

    def command_for(out: Path) -> list[str]:
        return epoch_command(path, epoch_job, out)

    full, resumed = root / f"{path}-full", root / f"{path}-resumed"
    run(command_for(full), timeout=600).check()
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-4", resumed / "checkpoint-4")
    before = _files(full)
    # Then two jobs side by side (most of a 2-rank job on 2 cores is start-up and waiting): the resume from the
    # copied checkpoint, and the finished job re-run as it was started; then another run's data into the finished
    # job's folder (not beside the re-run: the run lock would refuse whichever came second as "in use").
    other = tiny.write_jsonl(root / "other.jsonl", tiny.synthetic_records(12, seed=8))
    refused_cmd = command_for(full)
    refused_cmd[refused_cmd.index("--dataset") + 1] = str(other)
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run, cmd, timeout=600) for cmd in (command_for(resumed), command_for(full))]
        result, again = (job.result() for job in jobs)
    refused = run(refused_cmd, timeout=300)
    result.check()
    assert f"resume: from {resumed / 'checkpoint-4'}" in result.output, result.output[-3000:]
    expected, got = losses(full), losses(resumed)
    assert len(expected) == len(got) == 8, (expected, got)
    diff = max(abs(a - b) for a, b in zip(expected, got))
    assert diff <= 1e-6, f"{path}: resumed at step 4 (epoch 1) vs uninterrupted: max |diff| {diff}\n{expected}\n{got}"
    # The finished job, re-run as it was started: nothing to do, on every rank, not a byte rewritten.
    again.check()
    assert "already holds this run's final model (global_step 8); nothing to do" in again.output, again.output[-3000:]
    assert _files(full) == before
    # Another run's data into that folder: refused on every rank before training (one message, exit 2, no rank left).
    assert refused.returncode != 0, refused.output[-3000:]  # each rank exits 2; the launcher reports a failure
    assert refused.output.count(f"--output_dir {full} holds a final model of another run (it was trained on other "
                                "data)") == 1, refused.output[-3000:]
    assert "{'loss'" not in refused.output and _files(full) == before



@pytest.mark.slow
def test_an_engine_checkpoint_whose_marker_says_sft_resumes(epoch_job):
    """A checkpoint written before the engine path was named "engine" (its marker says "sft") resumes on it, to the
    uninterrupted run's losses. Reuses the mid-epoch test's engine run where it ran in this session."""
    import shutil

    root = epoch_job[0]
    full, resumed = root / "engine-full", root / "engine-former-name"
    if not (full / "trainer_state.json").exists():
        run(epoch_command("engine", epoch_job, full), timeout=600).check()
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-4", resumed / "checkpoint-4")
    marker = resumed / "checkpoint-4" / checkpoint.MARKER
    meta = json.loads(marker.read_text())
    assert meta["path"] == "engine"
    marker.write_text(json.dumps({**meta, "path": "sft"}, indent=1))
    result = run(epoch_command("engine", epoch_job, resumed), timeout=600)
    result.check()
    assert f"resume: from {resumed / 'checkpoint-4'}" in result.output, result.output[-3000:]
    expected, got = losses(full), losses(resumed)
    assert len(expected) == len(got) == 8 and max(abs(a - b) for a, b in zip(expected, got)) <= 1e-6, (expected, got)