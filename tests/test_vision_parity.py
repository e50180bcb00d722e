"""Vision-language training on 2 processes equals 1 at every step (within 1e-4, relative): image records through
the processor, the vision tower frozen, on the Trainer, the prepare() loop and the DeepSpeed engine paths with DDP,
ZeRO-2, ZeRO-3 and ZeRO-3 with CPU offload. CI runs Qwen2.5-VL (mrope positions, image grids) on the Trainer under
ZeRO-3 and Gemma-3 (token types, the image's bidirectional attention) on the loop under DDP; FINETUNE_FULL_MATRIX=1
runs every family x path x preset."""

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
RUNS = {  # name -> (path, --config): 2 processes, 1 per micro-batch x 2 accumulation = global batch 4
    "trainer-ddp": ("trainer", "ddp"),
    "trainer-zero2": ("trainer", "zero2"),
    "trainer-zero3": ("trainer", "ds_configs/zero3_no_offload.json"),
    "trainer-zero3-offload": ("trainer", "ds_configs/zero3_offload.json"),
    "loop-ddp": ("loop", "ddp"),
    "loop-zero3": ("loop", "ds_configs/zero3_no_offload.json"),
    "engine-zero2": ("engine", "zero2"),
    "engine-zero3": ("engine", "ds_configs/zero3_no_offload.json"),
}
PATHS = {"trainer": lambda: launcher("accelerate", 2, script=TRAIN),
         "loop": lambda: launcher("accelerate", 2, script=LOOP),
         "engine": lambda: deepspeed_launcher(2, script=ENGINE)}
FLAGS = ["--max_steps", str(STEPS), "--learning_rate", "2e-3", "--warmup_steps", "1", "--seed", "1234",
         "--max_seq_length", "1024", "--disable_tqdm", "true", "--logging_steps", "1", "--loss_chunk_size", "64"]
EVERY = [(fam, name) for fam in tiny.VLMS for name in RUNS]
COVER = [("qwen2_5_vl", "trainer-zero3"), ("gemma3", "loop-ddp")]


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
    # Under ZeRO-3 every record needs an image (finetune.training.examples.check_images_under_zero3).
    write_jsonl(root / "images.jsonl", [r for r in records if r.get("images")])
    return root


_runs: dict[tuple[str, str], list[float]] = {}
ZERO3 = ("-zero3", "-zero3-offload", "-zero3-single")


def train(root: Path, fam: str, name: str) -> list[float]:
    if (fam, name) not in _runs:
        folder = tiny.tiny_vlm(fam, root / fam)
        if name.startswith("single"):
            cmd, micro, accum, preset = [sys.executable, TRAIN], 2, 2, "ddp"
        else:
            path, preset = RUNS[name]
            cmd, micro, accum = PATHS[path](), 1, 2
        out = root / f"{fam}-{name}"
        data = root / ("images.jsonl" if name.endswith(ZERO3) else "data.jsonl")
        result = run(cmd + ["--config", preset, "--model_name_or_path", str(folder), "--dataset", str(data),
                            "--output_dir", str(out), "--dataset_cache_dir", str(root / f"cache-{fam}"),
                            "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(accum),
                            *FLAGS], timeout=900).check()
        assert not unexpected_warnings(result.output), f"{fam} {name}: {unexpected_warnings(result.output)}"
        _runs[(fam, name)] = losses(out)
        shutil.rmtree(out, ignore_errors=True)
    return _runs[(fam, name)]


@pytest.mark.parametrize("fam, name", matrix(EVERY, COVER))
def test_two_processes_equal_one(root, fam, name):
    ref, got = train(root, fam, "single-zero3-single" if "zero3" in name else "single"), train(root, fam, name)
    assert len(ref) == len(got) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    print(f"\n{fam} {name}: per-step losses vs one process: largest relative difference {worst:.2e} "
          f"(loss {ref[0]:.4f} -> {ref[-1]:.4f})")
    assert ref[-1] < ref[0]  # it trains
    assert worst <= 1e-4, (ref, got)


def test_text_records_beside_images_are_refused_under_zero3(root):
    """Under ZeRO-3 a rank whose micro-batch has no image would skip the vision tower's gathers: refused before
    training, by number, with the presets that take such data."""
    folder = tiny.tiny_vlm("gemma3", root / "gemma3")
    result = run(PATHS["trainer"]() + ["--config", "ds_configs/zero3_no_offload.json", "--model_name_or_path",
                                       str(folder), "--dataset", str(root / "data.jsonl"), "--output_dir",
                                       str(root / "refused"), "--dataset_cache_dir", str(root / "cache-gemma3"),
                                       *FLAGS], timeout=600)
    assert result.returncode != 0 and "exitcode: 2" in result.output, result.output[-3000:]  # the ranks' exit 2
    assert ("--config ds_configs/zero3_no_offload.json: 4 of the 16 examples of --dataset have no image; under ZeRO-3 "
            "every rank runs the vision tower together") in result.output
