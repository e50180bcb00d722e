"""Saves keep tied embeddings tied on every preset: a ZeRO save writes the same tensors, and a file of the same size,
as the DDP save (lm_head.weight is not written as a tensor of its own) and reloads with the tie in place."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from launch import TRAIN, launcher, matrix, run, tiny_job

pytestmark = pytest.mark.slow

PRESETS = ["ddp", "zero1", "zero2", "zero3", "zero3_no_offload", "zero3_nvme"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return tiny_job(tmp_path_factory.mktemp("tied"), records=16, seed=3, tied=True)


def header(file: Path) -> dict:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def saves(job):
    root, model, data = job
    done = {}

    def get(preset: str) -> Path:
        if preset not in done:
            out = root / preset
            extra = ["--nvme_path", str(root / "nvme")] if preset == "zero3_nvme" else []
            run(launcher("python", 1, None, TRAIN) + [
                "--config", preset, "--model_name_or_path", str(model), "--dataset", str(data),
                "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"), "--max_steps", "2",
                "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--max_seq_length", "64",
                "--disable_tqdm", "true", *extra], timeout=600).check()
            done[preset] = out
        return done[preset]

    return get


# CI: one preset per way a save is gathered (ZeRO-2: the module's own weights; ZeRO-3 with parameters swapped to disk:
# the partitions gathered), every preset with FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("preset", matrix(PRESETS[1:], ["zero2", "zero3_nvme"]))
def test_saved_model_keeps_the_tie(preset, saves):
    from transformers import AutoModelForCausalLM

    ref, got = saves("ddp") / "model.safetensors", saves(preset) / "model.safetensors"
    names = header(got)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert {k: v["shape"] for k, v in names.items()} == {k: v["shape"] for k, v in header(ref).items()}
    assert got.stat().st_size == ref.stat().st_size
    model = AutoModelForCausalLM.from_pretrained(saves(preset), dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
