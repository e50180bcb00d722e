"""Training a vision-language model on image records: the first step's loss on every path equals the float64 loss
transformers' processor and model give the same records (labels found by the template's turn markers alone); the
vision tower and projector stay frozen by default (full fine-tuning and LoRA), and --freeze_vision_tower false trains
them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from launch import matrix
from vision_data import RECORDS, float64_loss, tiny_gemma3_vlm, write_images, write_jsonl


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from test_families_parity import real_tokenizer

    root = tmp_path_factory.mktemp("vision-train")
    model = tiny_gemma3_vlm(root / "gemma3-vlm", real_tokenizer("gemma3", root / "tok"))
    write_images(root)
    return root, model, write_jsonl(root / "data.jsonl", RECORDS)


def train(job, name: str, *flags: str, path: str = "trainer", steps: int = 1, capfd=None) -> list[float]:
    """One process, `steps` optimizer steps of the 4 records (2 per micro-batch x 2 accumulation: the global
    batch). The Trainer and the loop run in this process; the engine in a process of its own (DeepSpeed keeps its
    process groups across runs in one process)."""
    import sys

    from launch import ENGINE, run

    from finetune.training import loop, trainer

    root, model, data = job
    out = root / name
    argv = ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out), "--dataset_cache_dir",
            str(root / "cache"), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--max_steps", str(steps), "--logging_steps", "1", "--learning_rate", "1e-3", "--seed", "3",
            "--max_seq_length", "256", "--disable_tqdm", "true", *flags]
    if path == "engine":
        result = run([sys.executable, ENGINE, *argv], timeout=600).check()
        if capfd is not None:
            sys.stderr.write(result.output)
    else:
        {"trainer": trainer.main, "loop": loop.main}[path](argv)
    state = json.loads((out / "trainer_state.json").read_text())
    return [e["loss"] for e in state["log_history"] if "loss" in e]


@pytest.fixture(scope="module")
def reference(job):
    root, model, data = job
    return float64_loss(model, RECORDS, root)


FIRST_STEP = [("trainer", ()), ("loop", ()), ("trainer", ("--loss_chunk_size", "0")),
              ("trainer", ("--use_peft", "--lora_dropout", "0"))]


@pytest.mark.slow
@pytest.mark.parametrize("path, flags", matrix(FIRST_STEP, FIRST_STEP[:2]))
def test_first_step_loss_equals_float64(job, reference, isolated, one_thread, path, flags):
    got = train(job, f"first-{path}-{'-'.join(flags) or 'default'}", *flags, path=path)
    print(f"\nfirst-step loss {path} {' '.join(flags)}: {got[0]:.8f}, float64 {reference:.8f}, diff {abs(got[0] - reference):.1e}")
    assert abs(got[0] - reference) < 1e-5


def changed(before: dict, after: dict, prefix: str) -> set[str]:
    return {k for k in before if k.startswith(prefix) and not torch.equal(before[k], after[k])}


@pytest.mark.slow
def test_full_fine_tuning_keeps_the_vision_tower_frozen_unless_asked(job, isolated, one_thread):
    root, model, _ = job
    base = load_file(model / "model.safetensors")
    vision = ("vision_tower.", "multi_modal_projector.")  # as the checkpoint names them
    assert all(any(k.startswith(p) for k in base) for p in vision)
    train(job, "full-frozen")
    frozen = load_file(root / "full-frozen" / "model.safetensors")
    assert not any(changed(base, frozen, p) for p in vision)
    assert changed(base, frozen, "language_model.")
    train(job, "full-unfrozen", "--freeze_vision_tower", "false")
    unfrozen = load_file(root / "full-unfrozen" / "model.safetensors")
    assert all(changed(base, unfrozen, p) for p in vision) and changed(base, unfrozen, "language_model.")


@pytest.mark.slow
def test_lora_targets_the_language_model_unless_asked(job):
    from finetune.config import ModelConfig
    from finetune.models.load import load_model

    _, model, _ = job

    def adapted(**kw) -> set[str]:
        m = load_model(ModelConfig(model_name_or_path=str(model), use_peft=True, lora_r=2, **kw))
        return {n.split(".lora_A")[0] for n, _ in m.named_parameters() if ".lora_A." in n}

    default = adapted()
    assert default and all(".language_model." in n for n in default)
    unfrozen = adapted(freeze_vision_tower=False)
    assert default < unfrozen and any(".vision_tower." in n for n in unfrozen)


def test_freeze_vision_tower_false_is_refused_for_a_text_only_model(tiny_chatml, tmp_path):
    from finetune.config.training import ModelConfig, family_problems

    problems = family_problems(ModelConfig(model_name_or_path=str(tiny_chatml), freeze_vision_tower=False))
    assert problems == [f"freeze_vision_tower: false trains a vision tower, and {tiny_chatml} is a text-only model "
                        "(its config.json has no vision_config); leave the flag out"]


@pytest.mark.slow
# CI: the Trainer and the loop (the engine's data and collator are the loop's; its own resume on text records:
# test_resume.py); the engine too with FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("path", matrix(["trainer", "loop", "engine"], ["trainer", "loop"]))
def test_resume_is_exact(job, isolated, one_thread, path, capfd):
    """Steps 3-4 resumed from step 2's checkpoint (model, optimizer, data position, RNG) equal the uninterrupted
    run's, on image records with the per-batch processor (4 steps of the 4 records each), on each path."""
    root, _, _ = job
    flags = ("--save_steps", "2", "--lr_scheduler_type", "cosine", "--warmup_steps", "1")
    whole = train(job, f"resume-{path}-whole", *flags, steps=4, path=path)
    checkpoint = root / f"resume-{path}-whole" / "checkpoint-2"
    capfd.readouterr()
    resumed = train(job, f"resume-{path}-again", *flags, "--resume_from_checkpoint", str(checkpoint), steps=4, path=path,
                    capfd=capfd)
    assert f"resume: from {checkpoint}" in capfd.readouterr().err  # resumed, not trained again from the start
    print(f"\nresume {path}: uninterrupted {whole}, resumed {resumed}")
    assert len(whole) == 4 and resumed[-2:] == whole[-2:]
