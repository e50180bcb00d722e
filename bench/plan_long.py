"""The planner's figures for Llama-3.1-8B at long sequences on 80 GB GPUs (no GPU needed).

    python bench/plan_long.py [--work /tmp/finetune-plan-long] [--no-write]

Llama-3.1-8B's config.json (its published values) is written to a folder and the model built on the meta device:
its parameter count must be the published 8,030,261,248. Then `finetune plan` (full fine-tuning, --bf16, micro-batch
1) for 32k and 128k tokens on 1 and 8 cards of 80 GB, with the long-context options: gradient checkpointing alone,
with --tiled_mlp, and with --offload_activations too. Each cell: the per-device peak of that setting and the plan's
recommendation. The table goes between the `plan-long-table` markers of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PUBLISHED_PARAMETERS = 8_030_261_248
LLAMA_31_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    torch_dtype="bfloat16",
)
OPTIONS = {"checkpointing": ["--gradient_checkpointing"],
           "+ tiled MLP": ["--gradient_checkpointing", "--tiled_mlp"],
           "+ tiled MLP + offload": ["--gradient_checkpointing", "--tiled_mlp", "--offload_activations"]}
CELLS = [(seq, gpus) for seq in (32768, 131072) for gpus in (1, 8)]


def build(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_31_8B)
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert n == PUBLISHED_PARAMETERS, n
    config.save_pretrained(folder)
    return folder


def argv_for(model: Path, seq: int, gpus: int, flags: list[str]) -> list[str]:
    return ["--model_name_or_path", str(model), "--max_seq_length", str(seq), "--per_device_train_batch_size", "1",
            "--bf16", "--device_memory", "80GB", "--host_memory", "2TB", "--devices_per_node", str(gpus),
            "--output_dir", "out", *flags]


def rows(model: Path) -> list[dict]:
    from finetune.plan import planner as plan

    out = []
    for seq, gpus in CELLS:
        for name, flags in OPTIONS.items():
            data = plan.make_plan(argv_for(model, seq, gpus, flags))
            rec = data["recommendation"]
            out.append({"tokens": seq, "gpus": gpus, "options": name, "peak": data["per_device_total"],
                        "activations": data["per_device"]["activations"], "fits": data["fits"],
                        "host_offloaded": data["per_host"].get("offloaded activations", 0),
                        "recommendation": rec["flags"], "recommended_peak": rec["per_device_total"],
                        "command": "finetune plan " + " ".join(argv_for(Path("MODEL"), seq, gpus, flags))})
    return out


def table(found: list[dict]) -> str:
    lines = [f"Llama-3.1-8B ({PUBLISHED_PARAMETERS:,} parameters, counted on the meta device), full fine-tuning, "
             "--bf16, micro-batch 1, one record of N tokens, DDP as asked; `python bench/plan_long.py` runs each "
             f"cell as `{found[0]['command']}` (MODEL: the config folder it writes; 32k/128k and "
             "--devices_per_node 1/8 varied, the option flags added). Planned, not measured.", "",
             "| tokens | 80 GB cards | options | per-device peak (ddp) | of which activations | activations in host memory "
             "| plan's recommendation | its per-device peak |", "|---|---|---|---|---|---|---|---|"]
    for r in found:
        gb = lambda b: f"{b / 1e9:,.1f} GB" if b else "-"  # noqa: E731
        rec = (r["recommendation"] or "nothing fits").replace("--per_device_train_batch_size 1 ", "")
        rec = rec.replace("--gradient_accumulation_steps 1 ", "").replace("--gradient_accumulation_steps 1", "")
        lines.append(f"| {r['tokens'] // 1024}k | {r['gpus']} | {r['options']} | {gb(r['peak'])}"
                     f"{'' if r['fits'] else ' (does not fit)'} | {gb(r['activations'])} | {gb(r['host_offloaded'])} "
                     f"| `{rec.strip()}` | {gb(r['recommended_peak'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/finetune-plan-long")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    model = build(Path(args.work) / "llama-3.1-8b")
    found = rows(model)
    (REPO / "bench" / "results" / "plan_long.json").write_text(json.dumps(found, indent=1))
    print(table(found))
    if not args.no_write:
        import importlib.util

        spec = importlib.util.spec_from_file_location("finetune_bench_memory", REPO / "bench" / "memory.py")
        memory = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(memory)
        memory.write_results([], marker="plan-long-table", title="Long context: the plan for Llama-3.1-8B "
                             "(bench/plan_long.py)", render=lambda _rows: table(found))


if __name__ == "__main__":
    main()
