"""A flag or recipe mistake comes back before torch, transformers and peft are imported (about 6 s before, 0.2 s
now), with the message and exit status it always had; a valid run still imports them, and still sets DeepSpeed's
accelerator and the extension build guard up before DeepSpeed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.config import hf_fields

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = ("torch", "transformers", "peft", "accelerate", "deepspeed")
BOGUS = """finetune: 3 configuration problem(s):
  - --bogus_flag: unknown key 'bogus_flag'
  - model_name_or_path: required (a local model folder)
  - dataset: required (a local data file or save_to_disk folder)
"""
PLAN_BOGUS = """finetune plan: 2 configuration problem(s):
  - --bogus_flag: unknown key 'bogus_flag'
  - model_name_or_path: required (a folder with config.json)
"""
ENTRY_POINTS = {
    "cli": [sys.executable, "-m", "finetune", "train"],
    "cli loop": [sys.executable, "-m", "finetune", "loop"],
    "cli engine": [sys.executable, "-m", "finetune", "engine"],
    "cli plan": [sys.executable, "-m", "finetune", "plan"],
    "script": [sys.executable, "finetune/train.py"],
    "loop": [sys.executable, "finetune/loop.py"],
    "engine": [sys.executable, "scripts/sft.py"],
}


def run_timed_imports(cmd: list[str], tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run cmd with PYTHONPROFILEIMPORTTIME: (the run with its import lines taken out of stderr, the top-level
    modules it imported)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    environ.update(PYTHONPROFILEIMPORTTIME="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO),
                   FINETUNE_CACHE=str(tmp_path / "cache"), **env)
    proc = subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines(keepends=True)
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines if line.startswith("import time:")}
    proc.stderr = "".join(line for line in lines if not line.startswith("import time:"))
    return proc, imported


@pytest.mark.parametrize("how", list(ENTRY_POINTS))
def test_a_flag_mistake_is_reported_before_torch(how, tmp_path):
    proc, imported = run_timed_imports([*ENTRY_POINTS[how], "--bogus_flag", "1"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    expected = PLAN_BOGUS if how == "cli plan" else BOGUS
    assert proc.stderr == expected and proc.stdout == ""
    assert not imported & set(LIBRARIES), sorted(imported & set(LIBRARIES))


def test_recipe_and_value_mistakes_too(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr_scheduler_type: cosin\nlearning_rat: 1e-4\n")
    proc, imported = run_timed_imports([*ENTRY_POINTS["cli"], "--recipe", str(recipe), "--max_steps", "1.5",
                                        "--optim", "adamw", "--model_name_or_path", str(tmp_path / "none"),
                                        "--dataset", str(tmp_path / "none.jsonl")], tmp_path)
    assert proc.returncode == 2, proc.stderr
    for message in (f"{recipe}:1: lr_scheduler_type: 'cosin' is not one of: linear, cosine,",
                    f"{recipe}:2: unknown key 'learning_rat'; did you mean 'learning_rate'?",
                    "--max_steps: expected an integer, got '1.5'",
                    "--optim: 'adamw' is not one of: adamw_torch,",
                    f"model_name_or_path: {tmp_path / 'none'}: no such folder"):
        assert message in proc.stderr, proc.stderr
    assert not imported & set(LIBRARIES), sorted(imported & set(LIBRARIES))


def test_help_is_fast_and_a_launched_rank_other_than_0_exits_quietly(tmp_path):
    proc, imported = run_timed_imports([*ENTRY_POINTS["cli"], "--help"], tmp_path)
    assert proc.returncode == 0 and "--per_device_train_batch_size" in proc.stdout, proc.stderr
    assert not imported & set(LIBRARIES)
    # Under a launcher every rank finds the mistake and exits 2; rank 0 alone says it.
    proc, imported = run_timed_imports([*ENTRY_POINTS["script"], "--bogus_flag", "1"], tmp_path, RANK="1")
    assert (proc.returncode, proc.stderr) == (2, "")
    assert not imported & set(LIBRARIES)


def test_the_training_arguments_snapshot_is_the_installed_one():
    """The parser reads TrainingArguments' flags from finetune/config/_training_arguments.py; it must describe the
    installed transformers exactly (else `python -m finetune.config.hf_fields` rewrites it)."""
    from transformers import TrainingArguments

    from finetune.config._training_arguments import SNAPSHOT
    from finetune.config.parser import Command

    assert hf_fields.describe(TrainingArguments) == SNAPSHOT, "run: python -m finetune.config.hf_fields"
    stand_in = hf_fields.training_arguments()
    assert stand_in is not TrainingArguments and hf_fields.describe(stand_in) == SNAPSHOT
    real, light = (Command("t", {"training": cls}) for cls in (TrainingArguments, stand_in))
    assert light.help() == real.help()
    for argv in (["--lr_scheduler_type", "cosine_with_min_lr", "--report_to", "none", "--debug", "underflow_overflow",
                  "--max_steps", "3", "--bf16", "--eval_strategy", "steps", "--optim_args", "a=1"],
                 ["--optim", "nope", "--learning_rate", "x", "--parallelism_config", "y", "--save_strategy", "best"]):
        assert light.collect(argv) == real.collect(argv)


def test_an_older_or_newer_transformers_reads_the_real_class(monkeypatch):
    monkeypatch.setattr(hf_fields, "installed_versions", lambda: {"transformers": "0.0", "accelerate": "0.0"})
    hf_fields._stand_in.cache_clear()
    try:
        from transformers import TrainingArguments

        assert hf_fields.training_arguments() is TrainingArguments
    finally:
        hf_fields._stand_in.cache_clear()


GUARDS = """
import os, sys
from finetune.training import core
core.start_run()
assert "torch" not in sys.modules
import deepspeed, torch.utils.cpp_extension as ext
print(getattr(ext.load, "_finetune_guarded", False), os.environ.get("TORCH_EXTENSIONS_DIR") is not None)
"""


def test_deepspeed_still_finds_the_build_guard_set_up(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    proc = subprocess.run([sys.executable, "-c", GUARDS], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], proc.stderr[-3000:]


def test_importing_the_config_imports_no_library():
    code = ("import sys; from finetune import config; from finetune.config import hf_fields; "
            "hf_fields.training_arguments(); config.command().help(); "
            f"print(sorted(m for m in {LIBRARIES!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-3000:]
