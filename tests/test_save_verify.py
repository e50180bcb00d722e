"""The training save is verified before it is committed: a save that does not reload to the trained model is an
error (exit 2, nothing committed), not a warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from finetune.training import loop
from finetune.training import trainer as train

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(model, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"one two three {i}"}) + "\n" for i in range(8)))
    return ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(tmp_path / "out"),
            "--dataset_cache_dir", str(tmp_path / "cache"), "--max_steps", "2", "--per_device_train_batch_size", "2"]


CORRUPT = """
import transformers
from safetensors.torch import load_file, save_file

_save = transformers.PreTrainedModel.save_pretrained


def corrupting_save(self, save_directory, *args, **kwargs):
    _save(self, save_directory, *args, **kwargs)
    path = f"{save_directory}/model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3  # a silent bit of damage
    save_file(tensors, path, metadata={"format": "pt"})


transformers.PreTrainedModel.save_pretrained = corrupting_save
"""


@pytest.mark.parametrize("path", [train, loop])
def test_good_save_is_verified(path, tiny_chatml, tmp_path, capsys):
    path.main(_argv(tiny_chatml, tmp_path))
    out = capsys.readouterr().out
    assert f"verified model {tmp_path / 'out' / '.staging-final'}" in out
    assert "logits max diff 0" in out
    assert (tmp_path / "out" / "config.json").is_file()


def _assert_refused(code, err, out):
    assert code == 2
    assert "the final save failed verification and was not committed" in err and "logits differ by up to" in err
    assert not (out / "model.safetensors").exists()
    assert not (out / "config.json").exists()


@pytest.mark.parametrize("path", [train, loop])
def test_corrupted_save_is_an_error_and_not_committed(path, tiny_chatml, tmp_path, monkeypatch, capsys):
    namespace = {}
    exec(CORRUPT.replace("transformers.PreTrainedModel.save_pretrained = corrupting_save", ""), namespace)
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", namespace["corrupting_save"])
    with pytest.raises(SystemExit) as exit_info:
        path.main(_argv(tiny_chatml, tmp_path))
    _assert_refused(exit_info.value.code, capsys.readouterr().err, tmp_path / "out")


@pytest.mark.slow  # a process of its own
def test_corrupted_save_is_an_error_in_the_deepspeed_script(tiny_chatml, tmp_path):
    # scripts/sft.py starts a process group, so it runs in its own process; sitecustomize plants the damage there.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CORRUPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONPATH=f"{hook}{os.pathsep}{REPO}", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "scripts/sft.py", "--config", "zero2", *_argv(tiny_chatml, tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    _assert_refused(proc.returncode, proc.stderr, tmp_path / "out")


@pytest.mark.slow  # 11-12 s each: a whole training run
@pytest.mark.parametrize("script", ["finetune/train.py", "finetune/loop.py"])
def test_bf16_save_is_verified_against_the_weights_dtype(script, tiny_chatml, tmp_path):
    # Under --bf16, accelerate wraps forward in autocast; the reload runs without it, so the reference must too
    # (comparing autocast logits with plain ones failed every CPU --bf16 run at 3e-3).
    # A fresh single process: nothing an in-process test left in os.environ (a MASTER_PORT, a RANK) may reach it.
    dist = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in dist and not k.startswith("ACCELERATE_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, script, *_argv(tiny_chatml, tmp_path), "--bf16"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "logits max diff 0 " in proc.stdout
    assert (tmp_path / "out" / "config.json").is_file()


def test_adapter_held_in_bf16_verifies_against_its_own_weights(tiny_chatml, tmp_path):
    # DeepSpeed's bf16 engine casts every parameter of the module to bf16, LoRA adapters included; peft reloads
    # 16-bit adapter weights as fp32 and runs the LoRA branch in fp32. The saved values are exactly the in-memory
    # ones, but the two forwards differed by bf16 rounding (3.9e-3 on this model: every --config zero1/zero2
    # --use_peft --bf16 run's final save was refused). The reload now holds the adapters in the reference's dtype.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.models.verify import verify_saved

    base = AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}  # peft's own choice
    with torch.no_grad():
        for p in model.parameters():  # what the engine does: parameters only (RoPE's inv_freq buffer stays fp32)
            p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "adapter")
    report = verify_saved(tmp_path / "adapter", model)
    assert report.kind == "adapter" and report.max_logit_diff == 0.0
    # The fp32 adapters peft makes are still compared as fp32.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
    model.save_pretrained(tmp_path / "adapter32")
    assert verify_saved(tmp_path / "adapter32", model).max_logit_diff == 0.0


@pytest.mark.slow  # 15-25 s each: a whole DeepSpeed run
@pytest.mark.parametrize("script", ["finetune/train.py", "scripts/sft.py"])
def test_bf16_lora_save_under_deepspeed_is_verified(script, tiny_chatml, tmp_path):
    # The end-to-end case of the test above: the final save of a ZeRO-2 LoRA --bf16 run was refused at 2.9e-3.
    dist = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in dist and not k.startswith("ACCELERATE_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, script, "--config", "zero2", "--use_peft", *_argv(tiny_chatml, tmp_path),
                           "--bf16", "true"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified adapter" in proc.stdout and "logits max diff 0 " in proc.stdout
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
