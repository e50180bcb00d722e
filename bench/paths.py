"""The three training paths side by side: per-step losses and wall time of the same job.

    .venv/bin/python bench/paths.py [--steps 20] [--write bench/RESULTS.md]

One 20-step job (tiny random Llama, fixed seed, global batch 8, variable-length records) run as one process
(the reference), then on 2 CPU processes under ZeRO-2 and ZeRO-3 (CPU offload) by each path: the HF Trainer
(`accelerate launch finetune/train.py`), the DeepSpeed engine (`deepspeed scripts/sft.py`) and the prepare()
loop (`accelerate launch finetune/loop.py`). Prints the loss table and the largest relative difference from
the reference; with --write, replaces the "Three training paths" section of that file. The tests
(tests/test_parity.py, tests/test_engine.py) hold the same agreement to 1e-4; this records the numbers.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout, before any installed copy

from finetune.testing import LOOP, TRAIN, deepspeed_launcher, launcher, losses, run, tiny_job  # noqa: E402

SECTION = "## Three training paths"
# name -> (launch line, --config, per-device batch)
RUNS = {
    "single": (lambda: launcher("python", script=TRAIN), "ddp", 8),
    "trainer_zero2": (lambda: launcher("accelerate", 2, script=TRAIN), "zero2", 4),
    "engine_zero2": (lambda: deepspeed_launcher(2), "zero2", 4),
    "loop_zero2": (lambda: launcher("accelerate", 2, script=LOOP), "zero2", 4),
    "trainer_zero3": (lambda: launcher("accelerate", 2, script=TRAIN), "zero3", 4),
    "engine_zero3": (lambda: deepspeed_launcher(2), "zero3", 4),
    "loop_zero3": (lambda: launcher("accelerate", 2, script=LOOP), "zero3", 4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--write", type=Path, default=None, help="markdown file whose section to replace")
    args = parser.parse_args()

    root, model, data = tiny_job(Path(tempfile.mkdtemp(prefix="finetune-paths-")), records=72, seed=7)
    curves, walls = {}, {}
    for name, (launch_line, preset, micro) in RUNS.items():
        out = root / name
        cmd = launch_line() + [
            "--config", preset, "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
            "--dataset_cache_dir", str(root / "cache"), "--max_steps", str(args.steps), "--learning_rate", "2e-3",
            "--warmup_steps", "2", "--seed", "1234", "--max_seq_length", "128", "--disable_tqdm", "true",
            "--per_device_train_batch_size", str(micro),
        ]
        start = time.time()
        run(cmd, timeout=600).check()
        walls[name] = time.time() - start
        curves[name] = losses(out)
        print(f"{name}: {walls[name]:.1f} s", file=sys.stderr)

    ref = curves["single"]
    names = list(RUNS)
    rel = {n: max(abs(a - b) / abs(a) for a, b in zip(ref, curves[n])) for n in names}
    lines = [
        SECTION, "",
        f"Written by `bench/paths.py` (`.venv/bin/python bench/paths.py --write bench/RESULTS.md`). "
        f"{platform.processor() or platform.machine()}, {_cores()} cores; tiny random Llama, {args.steps} steps, global "
        "batch 8 (1 process x 8, or 2 processes x 4), fp32, `OMP_NUM_THREADS=1`. zero3 = ZeRO-3 with CPU offload "
        "(DeepSpeedCPUAdam).", "",
        "| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
    ]
    for i in range(args.steps):
        lines.append(f"| {i + 1} | " + " | ".join(f"{curves[n][i]:.6f}" for n in names) + " |")
    lines.append("| max rel. diff vs single | " + " | ".join(f"{rel[n]:.1e}" for n in names) + " |")
    lines.append("| wall s | " + " | ".join(f"{walls[n]:.1f}" for n in names) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write:
        text = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
        start = text.find(SECTION)
        if start >= 0:
            end = text.find("\n## ", start + len(SECTION))
            text = text[:start] + table + ("" if end < 0 else text[end:])
        else:
            text = text.rstrip("\n") + "\n\n" + table
        args.write.write_text(text)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
