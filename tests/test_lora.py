"""LoRA through the same pipeline: equal losses on one process, under ZeRO-3 offload on two, and on the prepare()
loop under ZeRO-2 on two; the saved adapter reloads with PeftModel.from_pretrained to the same logits."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from finetune.models import tiny
from launch import LOOP, TRAIN, launcher, losses, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = tiny.build(root / "model", style="llama3")
    data = tiny.write_jsonl(root / "data.jsonl", tiny.synthetic_records(48, seed=3, fmt="alpaca"))
    outs, jobs = {}, {}
    # The two runs are independent: side by side (the data cache is shared under its lock, as ranks share it).
    with ThreadPoolExecutor(2) as pool:
        for name, kind, config_file, preset, nproc, micro, script in [
            ("single", "python", None, "ddp", 1, 8, TRAIN),
            ("zero3_offload", "accelerate", "accelerate_configs/zero3.yaml", "zero3", 2, 4, TRAIN),
            # LoRA trains no bias or norm: the optimizer's no-decay group is empty, which ZeRO drops (the loop's
            # schedule stepped one group too many until core.parameter_groups left it out).
            ("loop_zero2", "torchrun", None, "zero2", 2, 4, LOOP),
        ]:
            cmd = launcher(kind, nproc, config_file, script=script) + [
                "--config", preset, "--model_name_or_path", str(model), "--dataset", str(data),
                "--output_dir", str(root / name), "--dataset_cache_dir", str(root / "cache"), "--use_peft",
                "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0", "--max_steps", "12",
                "--per_device_train_batch_size", str(micro), "--learning_rate", "1e-2", "--seed", "5",
                "--gradient_checkpointing", "--disable_tqdm", "true", "--weight_decay", "0.1",
            ]
            jobs[name, nproc] = pool.submit(run, cmd, timeout=600)
        done = {key: job.result() for key, job in jobs.items()}
    for (name, nproc), result in done.items():
        out = root / name
        result.check()
        assert f"x {nproc} processes = global batch 8" in result.output
        # The save was checked before commit (under ZeRO-3 against the gathered weights).
        assert f"verified adapter {out / '.staging-final'}" in result.output and "logits max diff" in result.output
        outs[name] = out
    return model, outs


def test_lora_losses_fall_and_match(lora_runs):
    _, outs = lora_runs
    a = losses(outs["single"])
    assert len(a) == 12 and a[-1] < a[0] - 0.1, a
    for other in ("zero3_offload", "loop_zero2"):
        b = losses(outs[other])
        assert len(b) == 12, other
        for step, (x, y) in enumerate(zip(a, b), start=1):
            assert abs(x - y) <= 1e-4 * abs(x), f"{other} step {step}: {x} vs {y}"


def test_adapter_reloads_to_same_logits(lora_runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, outs = lora_runs
    ids = torch.arange(3, 40).unsqueeze(0)
    base_logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids).logits
    logits = {}
    for name, out in outs.items():
        files = {p.name for p in out.iterdir()}
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files, files
        assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, out).eval()
        with torch.no_grad():
            logits[name] = peft_model(ids).logits
        # The adapter is not a no-op: LoRA B started at zero and was trained.
        assert (logits[name] - base_logits).abs().max().item() > 1e-3
    # Two optimizers (torch's AdamW; DeepSpeed's CPU Adam under offload) and two reduction orders: 12 steps at lr 1e-2
    # leave the logits apart by 1e-4-2e-4 on some CPUs, tied to its SIMD width. The bound is relative to what training
    # moved them (0.88 here, 5,000x that); a wrong or unloaded adapter is apart by about the whole move.
    moved = (logits["single"] - base_logits).abs().max().item()
    apart = (logits["single"] - logits["zero3_offload"]).abs().max().item()
    print(f"adapter moved the logits by up to {moved:.3g}; the two paths' adapters are apart by {apart:.3g}")
    assert apart <= 1e-3 * moved, (apart, moved)


def test_target_check_under_registered_zero3(tmp_path):
    # The Trainer registers its ZeRO-3 config before the model loads; the name check builds a meta copy and must not
    # take transformers' partitioned path (it re-initialized meta tensors: "Cannot copy out of meta tensor").
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from finetune.config.training import ModelConfig
    from finetune.models.load import WeightsError, check_lora_targets

    path = tiny.build(tmp_path / "model", style="chatml")
    ds = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    check_lora_targets(ModelConfig(model_name_or_path=str(path), use_peft=True, lora_target_modules=["q_proj", "lm_head"]))
    with pytest.raises(WeightsError, match="'q_prj'; did you mean 'q_proj'"):
        check_lora_targets(ModelConfig(model_name_or_path=str(path), use_peft=True, lora_target_modules=["q_prj"]))
    assert is_deepspeed_zero3_enabled()  # the registration is back for the real load
    del ds
