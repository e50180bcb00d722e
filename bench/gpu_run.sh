#!/usr/bin/env bash
# The one command for a GPU machine without network (torch with CUDA already installed there):
#
#   bash bench/gpu_run.sh [bench/gpu.py flags]      # writes $OUT/gpu.json, gpu.md, log, versions.txt, logs/
#
# 1. installs the wheels carried in .whl/ (git-ignored, built by `bash bench/gpu_prepare.sh`: the exact versions this
#    checkout's venv uses of transformers, tokenizers, peft, datasets, TRL and their small dependencies, liger-kernel,
#    and bitsandbytes slimmed to CUDA 13; about 25 MiB) into /tmp/site, never into the machine's own site-packages;
#    huggingface_hub from .whl/fallback/ only where the machine's is older than the 1.31 that transformers 5.24 and
#    datasets 5.2 need; pyarrow and pandas are the machine's (checked: not carried, pyarrow's wheel is 55 MB);
# 2. prints the versions that will run and the GPU's name;
# 3. runs bench/gpu.py --write "$OUT" (on a GPU: the long section, checkpointing with --offload_activations and
#    --tiled_mlp at one 32k-token record, at most 90 s; then the rows section, ours against TRL; its --budget,
#    default 510 s, bounds the run), output also in $OUT/log; $OUT/results/gpu.json is bench/results/gpu.json.
#
# Afterwards, on a machine with this checkout: python bench/gpu.py --record OUT/gpu.json   (bench/RESULTS.md)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/finetune-gpu-out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
echo "gpu_run: $(date -u '+%Y-%m-%d %H:%M:%S UTC') in $PWD; OUT=$OUT"

pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"; }
if ! pip_target .whl/*.whl; then
  echo "gpu_run: installing .whl/*.whl into $SITE failed (was .whl carried to this machine?)" >&2
  exit 3
fi
# The machine's own huggingface_hub (PYTHONPATH not set yet): kept if new enough.
if ! python3 -c "
import importlib.metadata as md, sys
from packaging.version import Version
try:
    v = md.version('huggingface_hub')
except md.PackageNotFoundError:
    sys.exit(1)
print('gpu_run: huggingface_hub', v, 'on this machine')
sys.exit(0 if Version(v) >= Version('1.31') else 1)
"; then
  echo "gpu_run: huggingface_hub missing or older than 1.31: installing .whl/fallback/"
  pip_target .whl/fallback/*.whl || echo "gpu_run: the fallback huggingface_hub did not install" >&2
fi

for module in pyarrow pandas; do  # datasets' and TRL's compiled dependencies: the machine's own
  if ! python3 -c "import $module" 2>/dev/null; then
    echo "gpu_run: $module does not import on this machine and is not carried (bench/gpu_prepare.sh says why)" >&2
    exit 3
  fi
done

export PYTHONPATH="$SITE:$PWD"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTORCH_NVML_BASED_CUDA_CHECK=1
export FINETUNE_GPU_COMMAND="bash bench/gpu_run.sh $* (python3 bench/gpu.py --write \$OUT $*)"

python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as md
import platform

print("python", platform.python_version())
for dist in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "liger-kernel", "triton",
             "flash-attn", "huggingface_hub", "tokenizers", "safetensors", "pyarrow", "pandas", "fsspec", "dill",
             "multiprocess"):
    try:
        print(f"{dist:16s} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist:16s} not installed")
import transformers

print("transformers from", transformers.__file__)
for module in ("datasets", "trl", "peft", "accelerate"):  # a version clash shows here, before the run
    try:
        print(f"import {module}: ok ({__import__(module).__file__})")
    except Exception as e:  # noqa: BLE001
        print(f"import {module}: FAILED: {type(e).__name__}: {e}")
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"GPU {i}: {torch.cuda.get_device_name(i)}")
EOF

python3 bench/gpu.py --write "$OUT" "$@" 2>&1 | tee "$OUT/log"
code=${PIPESTATUS[0]}
echo "gpu_run: bench/gpu.py exited $code; results in $OUT (gpu.md, gpu.json, log, logs/)"
exit "$code"
