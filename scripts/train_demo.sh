#!/usr/bin/env bash
# The demo job: fine-tune a small randomly initialised Llama (built locally, no download) on the
# bundled data/demo.jsonl, on 2 CPU processes or on every local GPU. PRESET=zero2|zero3|... picks the
# parallelism; extra flags go to finetune/train.py (e.g. --max_steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=${DS_ACCELERATOR:-}
[ -n "$DS_ACCELERATOR" ] || unset DS_ACCELERATOR
MODEL=.cache/demo-llama
OUT=${OUT:-outputs/demo}
[ -f "$MODEL/config.json" ] || .venv/bin/finetune tiny "$MODEL" --hidden 128 --layers 4 >/dev/null
NPROC=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
if [ "$NPROC" -eq 0 ]; then
  NPROC=2
  # Ranks share the cores; more threads than cores per rank only oversubscribes.
  export OMP_NUM_THREADS=$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))
fi
.venv/bin/accelerate launch --multi_gpu --num_processes "$NPROC" --num_machines 1 --mixed_precision no \
  --dynamo_backend no finetune/train.py --config "${PRESET:-ddp}" \
  --model_name_or_path "$MODEL" --dataset data/demo.jsonl --output_dir "$OUT" \
  --max_steps 150 --per_device_train_batch_size 8 --learning_rate 3e-3 --warmup_steps 10 \
  --logging_steps 10 --disable_tqdm true "$@"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
log = [e for e in json.load(open(f"{sys.argv[1]}/trainer_state.json"))["log_history"] if "loss" in e]
print(f"demo: loss {log[0]['loss']:.3f} at step {log[0]['step']} -> {log[-1]['loss']:.3f} at step {log[-1]['step']}; model in {sys.argv[1]}")
PY
