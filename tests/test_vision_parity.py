"""Vision-language training on 2 processes equals 1 at every step (within 1e-4, relative): image records through
the processor, text records beside them, on the Trainer, the prepare() loop and the DeepSpeed engine paths with DDP,
ZeRO-2, ZeRO-3 and ZeRO-3 with CPU offload, the vision tower trained (frozen under ZeRO-2). CI runs a cover (COVER:
each path and each preset but ZeRO-3 offload once); FINETUNE_FULL_MATRIX=1 runs every family x path x preset."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from launch import ENGINE, LOOP, TRAIN, deepspeed_launcher, launcher, losses, matrix, run, unexpected_warnings
from vision_data import RECORDS, write_images, write_jsonl

from finetune.models import tiny

pytestmark = pytest.mark.slow

STEPS = 4
PRESETS = {"ddp": "ddp", "zero2": "zero2", "zero3": "ds_configs/zero3_no_offload.json",
           "zero3-offload": "ds_configs/zero3_offload.json"}  # name -> --config
PATHS = {"trainer": lambda: launcher("accelerate", 2, script=TRAIN),
         "loop": lambda: launcher("accelerate", 2, script=LOOP),
         "engine": lambda: deepspeed_launcher(2, script=ENGINE)}
FLAGS = ["--max_steps", str(STEPS), "--learning_rate", "2e-3", "--warmup_steps", "1", "--seed", "1234",
         "--max_seq_length", "1024", "--disable_tqdm", "true", "--logging_steps", "1", "--loss_chunk_size", "64"]
# Every family x path x preset (the engine is DeepSpeed's: no DDP there): 6 x 11 cells.
EVERY = [(fam, path, preset) for fam in tiny.VLMS for path in PATHS for preset in PRESETS
         if not (path == "engine" and preset == "ddp")]
# CI: each path once, on the mechanisms that differ most: Qwen2.5-VL's mrope and image grids under ZeRO-3 (text-only
# micro-batches beside image ones: the blank image's gathers), LLaVA 1.5 (EOS appended to its last turn; a tower
# layer its features skip) under DDP with its tower trained, Gemma-3's token types and bidirectional image attention
# on the engine under ZeRO-2. ZeRO-3 with CPU offload is CI's in test_parity.py; the other families' mechanics are
# their first-step losses (test_vision_families.py).
COVER = [("qwen2_5_vl", "trainer", "zero3"), ("llava", "loop", "ddp"), ("gemma3", "engine", "zero2")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-parity")
    write_images(root)
    # 16 records: the four, each with its images rotated, so every step sees other images.
    records = []
    for k in range(4):
        for r in RECORDS:
            n = len(r.get("images", []))
            records.append(dict(r, images=[f"img/{(k + j) % 4}.png" for j in range(n)]) if n else r)
    write_jsonl(root / "data.jsonl", records)
    # The data order (DistributedSampler's, seed 1234) gives some micro-step an image-less record on one rank only:
    # the case where ZeRO-3's gathers would part without the blank image.
    from finetune.data.sampler import rank_indices

    text = {i for i, r in enumerate(records) if not r.get("images")}
    ranks = [rank_indices(len(records), 2, r, True, 1234, False, 0) for r in range(2)]
    assert any((a in text) != (b in text) for a, b in zip(*ranks)), ranks
    return root


_runs: dict[tuple, list[float]] = {}


def tower(preset: str) -> list[str]:
    """Under DDP and ZeRO-3 the tower trains too (ZeRO-2 keeps it frozen, the default): ZeRO-3's backward gathers
    and gradient reductions run on every rank, the blank image's (zero) gradients included; DDP reduces every
    trained parameter's gradient, so none may go without one (LLaVA's layers after its feature layer stay frozen)."""
    return [] if preset == "zero2" else ["--freeze_vision_tower", "false"]


def train(root: Path, fam: str, path: str, preset: str, flags: tuple = ()) -> list[float]:
    """Per-step losses of FAM on PATH with PRESET on 2 processes (1 per micro-batch x 2 accumulation), or on one
    process (path "single": 2 per micro-batch x 2 accumulation, the same global batch of 4)."""
    if (fam, path, preset, flags) not in _runs:
        folder = tiny.tiny_vlm(fam, root / fam)
        if path == "single":
            cmd, micro = [sys.executable, TRAIN], 2
        else:
            cmd, micro = PATHS[path](), 1
        out = root / f"{fam}-{path}-{preset}{'-tower' if flags else ''}"
        result = run(cmd + ["--config", PRESETS[preset], "--model_name_or_path", str(folder), "--dataset",
                            str(root / "data.jsonl"), "--output_dir", str(out), "--dataset_cache_dir",
                            str(root / f"cache-{fam}"), "--per_device_train_batch_size", str(micro),
                            "--gradient_accumulation_steps", "2", *FLAGS, *flags], timeout=900).check()
        assert not unexpected_warnings(result.output), f"{fam} {path} {preset}: {unexpected_warnings(result.output)}"
        _runs[(fam, path, preset, flags)] = losses(out)
        shutil.rmtree(out, ignore_errors=True)
    return _runs[(fam, path, preset, flags)]


@pytest.mark.parametrize("fam, path, preset", matrix(EVERY, COVER))
def test_two_processes_equal_one(root, fam, path, preset):
    """Text records beside image records on every preset: under ZeRO-3 a rank whose micro-batch has no image runs
    the tower on a blank image times zero (finetune.models.freeze.run_tower_on_every_batch), so the ranks' gathers
    match; a hang would end at run()'s bound."""
    flags = tuple(tower(preset))
    ref, got = train(root, fam, "single", "ddp", flags), train(root, fam, path, preset, flags)
    assert len(ref) == len(got) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    print(f"\n{fam} {path}/{preset}{' (tower trained)' if flags else ''}: per-step losses vs one process: largest "
          f"relative difference {worst:.2e} (loss {ref[0]:.4f} -> {ref[-1]:.4f})")
    assert ref[-1] < ref[0]  # it trains
    assert worst <= 1e-4, (ref, got)
