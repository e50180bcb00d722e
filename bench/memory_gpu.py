"""Predicted (`finetune plan`) against measured peak GPU memory, on one CUDA device.

    python bench/memory_gpu.py --work W [--cells NAME ...]     # measures, prints the table, writes W/rows.json

Each cell is one process of bench/memory.py's worker (the project's config -> load_model -> HF Trainer, fixed-length
random-token records, a few steps) on a random Llama with Llama-3.2-1B's shape (the weights do not change the
memory; nothing is downloaded). Measured: torch.cuda.max_memory_allocated over the run. Predicted: the planner's
device total for the same flags (planner.workload_from_config, accelerator gpu) less its allowance for the CUDA context
and workspaces (GPU_DEVICE_OVERHEAD), which the allocator does not see.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
MICRO, SEQ = 4, 1024
COMMON = ["--config", "ddp", "--per_device_train_batch_size", str(MICRO), "--max_seq_length", str(SEQ), "--seed", "0"]
CELLS = {  # name -> flags
    "full-bf16": ["--torch_dtype", "bfloat16"],
    "full-bf16-ckpt": ["--torch_dtype", "bfloat16", "--gradient_checkpointing", "true"],
    "full-bf16-unchunked": ["--torch_dtype", "bfloat16", "--loss_chunk_size", "0"],
    "full-fp32-autocast": ["--torch_dtype", "float32", "--bf16", "true"],
    "lora-bf16": ["--torch_dtype", "bfloat16", "--use_peft"],
    "lora-bf16-no-dropout": ["--torch_dtype", "bfloat16", "--use_peft", "--lora_dropout", "0"],
    # DPO (finetune.methods.dpo): 2 pairs a micro-batch, so 4 rows of 1,024 tokens as the SFT cells; log-probabilities
    # from the logits (never chunked); LoRA's reference is the policy with its adapters off, full's a frozen copy.
    "dpo-lora-bf16": ["--torch_dtype", "bfloat16", "--use_peft", "--method", "dpo",
                      "--per_device_train_batch_size", str(MICRO // 2)],
    "dpo-full-bf16": ["--torch_dtype", "bfloat16", "--method", "dpo", "--per_device_train_batch_size", str(MICRO // 2)],
}


def build_model(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).to(torch.bfloat16).save_pretrained(folder)
    return folder


def predict(model: Path, flags: list[str]) -> dict:
    from finetune import config as C
    from finetune.plan import planner

    cfg = C.parse(["--model_name_or_path", str(model), *flags], check_paths=False)
    job = planner.workload_from_config(cfg, world_size=1, devices_per_node=1, accelerator="gpu").replace(padding_mask=False)
    pred = planner.predict(job)
    return {"device": pred.device_total - planner.GPU_DEVICE_OVERHEAD, "moment": pred.peak_moment,
            "breakdown": {k: v for k, v in pred.device.items() if k != "framework overhead"},
            "saved_planned": pred.act.saved, "precision": planner.precision_of(job).name}


def measure(model: Path, name: str, flags: list[str], work: Path, timeout: float, env: dict | None = None) -> dict:
    """One cell in a fresh process (bench/memory.py's worker). env: extra environment variables for it (e.g.
    FINETUNE_BENCH_NO_LIGER=1: liger-kernel hidden, so the chunked loss runs the planner's own chunk loop)."""
    import os

    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    if "dpo" in flags:  # DPO's pairs are cached under the data settings (the worker makes its own random pairs)
        flags = [*flags, "--dataset", str(out / "unused.jsonl"), "--dataset_cache_dir", str(out / "cache")]
    cmd = [sys.executable, str(REPO / "bench" / "memory.py"), "worker", str(result), "--steps", "3", "--",
           "--model_name_or_path", str(model), "--output_dir", str(out / "out"), *flags]
    start = time.time()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                         env={**os.environ, **(env or {})})
    if run.returncode != 0 or not Path(f"{result}.0").is_file():
        return {"error": f"exit {run.returncode}: {run.stderr[-3000:]}"}
    rank = json.loads(Path(f"{result}.0").read_text())
    return {"cuda": rank.get("cuda_max_memory_allocated"), "saved_measured": rank.get("saved_for_backward"),
            "seconds": round(time.time() - start, 1)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS))
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work / "model")
    rows = []
    for name in args.cells:
        flags = COMMON + CELLS[name]
        row = {"cell": name, **predict(model, flags), **measure(model, name, flags, args.work, args.timeout)}
        rows.append(row)
        if row.get("cuda") is None and "error" not in row:
            row["error"] = "no CUDA device: the worker recorded no torch.cuda.max_memory_allocated"
        if "error" in row:
            print(f"{name}: {row['error']}", flush=True)
            continue
        err = (row["device"] - row["cuda"]) / row["cuda"]
        print(f"{name:22} measured {row['cuda'] / 2**30:6.2f} GiB  planned {row['device'] / 2**30:6.2f} GiB "
              f"({err:+.1%}, {row['moment']}, {row['precision']})  saved for backward measured "
              f"{(row['saved_measured'] or 0) / 2**20:,.0f} MiB planned {row['saved_planned'] / 2**20:,.0f} MiB"
              f"  [{row['seconds']} s]", flush=True)
    (args.work / "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
