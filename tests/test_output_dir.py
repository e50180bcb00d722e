"""What an --output_dir may already hold, on all three paths (run in this process, one rank: fast; marked slow, as
real processes).

- A finished run re-run with `--resume_from_checkpoint latest` does nothing and says so (exit 0, same bytes);
  before, the Trainer path trained a step past --max_steps (global_step 3 -> 4) and the others retrained their
  last steps and rewrote the model.
- A run into a folder holding ANOTHER run's final model or checkpoints (other model, data or flags: the fingerprint
  in finetune_config.yaml / the checkpoint marker) is refused with what to do, and --overwrite_output_dir replaces
  them; the same run's `latest` still resumes.
- The model folder is never an output folder; finetune_config.yaml is written with the final model, not at start.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from finetune.models import tiny
from finetune.training import checkpoint
from launch import matrix
from test_cli_errors import assert_user_error, in_processes
from test_cli_errors import run as entry  # noqa: F401  (the fixture: in this process, or (slow) a real process)


@pytest.fixture
def run(entry):
    """Several runs in one test: in this process, what an exit leaves behind (a process group, accelerate's
    state) is undone before the next run, as a new process would start."""
    def run_one(how, argv):
        proc = entry(how, argv)
        import torch.distributed as dist
        from accelerate.state import AcceleratorState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        if "deepspeed" in sys.modules:  # DeepSpeed caches the destroyed group objects
            import deepspeed.comm.comm as ds_comm
            from deepspeed.utils import groups

            ds_comm.cdb = None
            for name in dir(groups):
                if name.startswith("_") and name.endswith("_GROUP") and not callable(getattr(groups, name)):
                    setattr(groups, name, None)
        return proc

    return run_one


@pytest.fixture
def run_each(run, request, tmp_path):
    """Runs that are independent of each other and must each leave the output folder as it was (refusals), one after
    another (runs into one folder at once are refused as such: tests/test_runlock.py): in this process, or in real
    processes (slow); `unchanged()` checked after each."""
    def each(how, argvs, unchanged):
        if request.node.callspec.params.get("entry") == "process":
            procs = []
            for argv in argvs:
                procs.extend(in_processes(how, [argv], tmp_path))
                assert unchanged(), argv
            return procs
        procs = []
        for argv in argvs:
            procs.append(run(how, argv))
            assert unchanged(), argv
        return procs

    return each


PATHS = ("cli", "loop", "engine")


def where(process_path: str | None) -> list:
    """(how, entry) cases: every path in this process; in a real process (slow), CI's cover takes one path per test,
    or none (the in-process cases hold the logic; the process adds the real exit and files), every path with
    FINETUNE_FULL_MATRIX=1."""
    every = [(h, "here") for h in PATHS] + [(h, "process") for h in PATHS]
    cover = [(h, "here") for h in PATHS] + ([(process_path, "process")] if process_path else [])
    return [pytest.param(h, m, id=f"{m}-{h}", marks=[pytest.mark.slow] if m == "process" else [])
            for h, m in matrix(every, cover)]


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder`: (sha256, mtime_ns): a rewrite with the same bytes still shows."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def job(tmp_path, tiny_chatml):
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.synthetic_records(8, seed=3))
    other_data = tiny.write_jsonl(tmp_path / "other.jsonl", tiny.synthetic_records(8, seed=4))
    return dict(model=tiny_chatml, data=data, other_data=other_data, out=tmp_path / "out", cache=tmp_path / "cache")


def args(job, *extra, model=None, data=None, out=None) -> list:
    return ["--model_name_or_path", model or job["model"], "--dataset", data or job["data"],
            "--output_dir", out or job["out"], "--dataset_cache_dir", job["cache"], "--max_steps", "3",
            "--save_steps", "1", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--seed", "5",
            "--disable_tqdm", "true", *extra]


def fingerprint_line(folder: Path) -> dict:
    from finetune.training.lifecycle import FINGERPRINT_LINE

    first = (folder / "finetune_config.yaml").read_text().splitlines()[0]
    assert first.startswith(FINGERPRINT_LINE), first
    return json.loads(first[len(FINGERPRINT_LINE):])


def global_step(folder: Path) -> int:
    return json.loads((folder / "trainer_state.json").read_text())["global_step"]


@pytest.mark.parametrize("how, entry", where("engine"), indirect=["entry"])
def test_latest_on_a_finished_run_does_nothing(how, job, run):
    out = job["out"]
    first = run(how, args(job, "--resume_from_checkpoint", "latest"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert global_step(out) == 3
    before = snapshot(out)
    again = run(how, args(job, "--resume_from_checkpoint", "latest"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert global_step(out) == 3
    assert "{'loss'" not in again.stdout
    assert snapshot(out) == before  # not a byte, not a timestamp
    assert "already holds this run's final model (global_step 3); nothing to do" in again.stdout, again.stdout[-3000:]
    assert checkpoint.read_meta(out / "checkpoint-2")["fingerprint"] == fingerprint_line(out)


# CI: in this process only (11 runs in a real process took 54 s of CPU; a refusal's exit 2 in a real process is the
# other tests' here).
@pytest.mark.parametrize("how, entry", where(None), indirect=["entry"])
def test_another_runs_outputs_are_refused(how, job, run, run_each, tmp_path):
    out = job["out"]
    assert run(how, args(job)).returncode == 0
    before = snapshot(out)
    other_model = tiny.build(tmp_path / "other-model", style="chatml", seed=1)
    cases = [
        (dict(data=job["other_data"]), "holds a final model of another run (it was trained on other data)"),
        (dict(model=other_model), "holds a final model of another run (it was trained on another model)"),
        (dict(extra=["--lr_scheduler_type", "cosine"]), "(it was trained on other training flags)"),
    ]
    runs = [(args(job, *change.get("extra", []), *resume, model=change.get("model"), data=change.get("data")), message)
            for change, message in cases for resume in ([], ["--resume_from_checkpoint", "latest"])]
    procs = run_each(how, [argv for argv, _ in runs], lambda: snapshot(out) == before)
    for proc, (_, message) in zip(procs, runs):
        assert_user_error(proc, f"finetune: --output_dir {out} {message}" if "model" in message
                          else message, "Use a new --output_dir, or --overwrite_output_dir")
    # Checkpoints alone (no final model) of another run: refused too.
    only_checkpoints = tmp_path / "only-checkpoints"
    only_checkpoints.mkdir()
    shutil.copytree(out / "checkpoint-2", only_checkpoints / "checkpoint-2")
    proc = run(how, args(job, "--resume_from_checkpoint", "latest", data=job["other_data"], out=only_checkpoints))
    assert_user_error(proc, f"--output_dir {only_checkpoints} holds the checkpoint checkpoint-2 of another run "
                            "(it was trained on other data)")
    # The same run resumes from them (the marker's fingerprint is this run's).
    proc = run(how, args(job, "--resume_from_checkpoint", "latest", out=only_checkpoints))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resume: from {only_checkpoints / 'checkpoint-2'}" in proc.stderr
    assert global_step(only_checkpoints) == 3
    # --overwrite_output_dir: the other run's checkpoints are removed, its model replaced by this run's.
    proc = run(how, args(job, "--overwrite_output_dir", "true", "--resume_from_checkpoint", "latest",
                         data=job["other_data"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: from" not in proc.stderr  # the other run's checkpoint-2 was not resumed
    new = fingerprint_line(out)
    assert new["data"] != fingerprint_line(only_checkpoints)["data"]
    for step in (1, 2):
        assert checkpoint.read_meta(out / f"checkpoint-{step}")["fingerprint"] == new


@pytest.mark.parametrize("how, entry", where("loop"), indirect=["entry"])
def test_the_model_folder_is_never_the_output_folder(how, job, run, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(job["model"], model)
    before = snapshot(model)
    proc = run(how, args(job, model=model, out=model))
    assert_user_error(proc, f"output_dir: {model} is the model folder (--model_name_or_path); the run would write "
                            "over the base weights. Choose another --output_dir")
    assert snapshot(model) == before


def test_finetune_config_is_written_with_the_final_model(job, monkeypatch, isolated, one_thread):
    """A run that stops before its final save leaves the folder's finetune_config.yaml as it was (before, it was
    rewritten at start: the folder then described a run that never finished)."""
    from test_cli_errors import _environ
    import transformers

    from finetune.training import trainer

    for key, value in _environ(job["out"].parent).items():
        monkeypatch.setenv(key, value)
    out = job["out"]
    trainer.main([str(a) for a in args(job)])
    saved = (out / "finetune_config.yaml").read_bytes()

    class Stop(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            raise RuntimeError("stopped on purpose")

    # The same run (same fingerprint) with a flag that changes the recipe text, stopped after one step.
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        trainer.main([str(a) for a in args(job, "--logging_steps", "2")], callbacks=[Stop()])
    assert (out / "finetune_config.yaml").read_bytes() == saved


@pytest.mark.parametrize("how, entry", where("cli"), indirect=["entry"])
def test_resume_after_a_lost_final_save_trains_no_extra_step(how, job, run):
    """The final save did not happen (a crash after the last checkpoint): `latest` finishes the run at --max_steps.
    Before, the Trainer path resumed its checkpoint-3 (global_step = max_steps) and trained a step 4."""
    from launch import losses

    out = job["out"]
    assert run(how, args(job, "--resume_from_checkpoint", "latest")).returncode == 0
    expected = losses(out)
    for name in ("config.json", "model.safetensors", "trainer_state.json", "finetune_config.yaml"):
        (out / name).unlink()
    proc = run(how, args(job, "--resume_from_checkpoint", "latest"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: from" in proc.stderr
    assert global_step(out) == 3
    assert losses(out) == pytest.approx(expected, abs=1e-6)


# Ends as the training ranks do (process.run_rank): gloo's teardown in the interpreter shutdown can abort a rank
# that finished ("terminate called without an active exception"; seen here once, after both ranks printed).
GUARD = """
import datetime, os, sys
import torch.distributed as dist
from finetune import config as C, process
from finetune.training import lifecycle

def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    cfg = C.parse(sys.argv[1:] + ["--output_dir", os.environ[f"OUT{rank}"]])
    print(f"rank {rank}: guard returned {lifecycle.guard_output_dir(cfg)}", flush=True)
    dist.destroy_process_group()

process.run_rank(main, own_process=True)
"""


@pytest.mark.slow
def test_ranks_that_see_different_output_folders_take_the_same_way(job, tmp_path):
    """Rank 0 may create --output_dir (eval_split.json) before rank 1 has looked at it: the check must be collective
    on every rank whatever it finds. Before, a rank that found no folder skipped the collective and the other waited
    in it for ever (a ZeRO-3 run hung in the full suite). Here each rank gets its own folder: rank 0's does not exist."""
    from launch import launcher, run

    script = tmp_path / "guard.py"
    script.write_text(GUARD)
    common = [str(a) for a in args(job)[:4]]  # the model and the data
    empty, other, missing = tmp_path / "empty", tmp_path / "other", tmp_path / "missing"
    empty.mkdir()
    other.mkdir()
    (other / "config.json").write_text("{}")  # another run's final model: it records no fingerprint
    for out1, extra, ok, expected in (
            (empty, [], True, "guard returned None"),
            (other, [], False, f"--output_dir {missing} holds"),  # rank 0 reports what rank 1 found; every rank stops
            (other, ["--overwrite_output_dir"], True, "guard returned None")):
        result = run(launcher("torchrun", 2, script=str(script)) + common + extra, timeout=150,
                     OUT0=str(missing), OUT1=str(out1))
        assert (result.returncode == 0) == ok, result.output[-3000:]
        assert expected in result.output, result.output[-3000:]
        if ok:
            assert "rank 0: guard returned None" in result.output and "rank 1: guard returned None" in result.output
