#!/usr/bin/env bash
# Builds .whl/ (git-ignored), the wheels bench/gpu_run.sh installs on a GPU machine without network, whose image has
# torch 2.11 (CUDA 13.0), transformers 5.17, accelerate 1.15 and peft, but not datasets, TRL, liger-kernel or
# bitsandbytes:
#
#   bash bench/gpu_prepare.sh          # then carry .whl with the checkout; at most 64 MiB in all (checked here)
#
# - the exact versions this checkout's virtualenv runs of transformers (5.17's Trainer lacks what
#   finetune/training/hf_trainer.py overrides) with tokenizers, peft, TRL, datasets and the dependencies of theirs
#   that are small (dill, multiprocess, xxhash); huggingface_hub in .whl/fallback/ (installed there only where the
#   machine's is older than transformers needs);
# - liger-kernel (pure Python, Triton kernels; the machine's torch brings Triton);
# - bitsandbytes for the QLoRA row, slimmed to its CPU library and the one for the machine's CUDA (its wheel carries
#   one per CUDA, ROCm and XPU version: 41 MiB; libbitsandbytes_cuda130.so alone is 3.9 MB), RECORD rewritten to match.
# Not carried (too large, and on the image beside torch): pyarrow (55 MB) and pandas; gpu_run.sh checks they import.
# Wheels are for CPython $TARGET_PY (3.12 on the GPU image) on manylinux x86_64; pip download fetches them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET_PY=${TARGET_PY:-3.12}
CUDA=${CUDA:-130}  # torch.version.cuda "13.0" -> libbitsandbytes_cuda130.so
LIMIT_MIB=64
OUT=.whl
rm -rf "$OUT"
mkdir -p "$OUT/fallback" "$OUT/.download"

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
fetch() {  # fetch DIR DIST==VERSION
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "$2"
}

for dist in transformers tokenizers peft trl datasets dill multiprocess xxhash; do
  fetch "$OUT" "$dist==$(version "$dist")"
done
fetch "$OUT/fallback" "huggingface_hub==$(version huggingface_hub)"
fetch "$OUT" "liger-kernel==${LIGER_VERSION:-0.8.5}"  # not in the CPU virtualenv (it needs CUDA); the last one run on an H100
fetch "$OUT/.download" "bitsandbytes==$(version bitsandbytes)"

# bitsandbytes: keep the CPU library and the one for this CUDA; drop the others from the archive and its RECORD.
"$PY" - "$OUT" "$CUDA" <<'EOF'
import sys
import zipfile
from pathlib import Path

out, cuda = Path(sys.argv[1]), sys.argv[2]
(src,) = (out / ".download").glob("bitsandbytes-*.whl")
keep = f"libbitsandbytes_cuda{cuda}.so"
drop = lambda name: "/libbitsandbytes_" in name and not name.endswith((keep, "libbitsandbytes_cpu.so"))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out / src.name, "w", zipfile.ZIP_DEFLATED) as zout:
    names = zin.namelist()
    if not any(n.endswith(keep) for n in names):
        raise SystemExit(f"{src.name} has no {keep}: set CUDA= to one of "
                         + ", ".join(sorted(n.rsplit("cuda", 1)[1][:-3] for n in names if "libbitsandbytes_cuda" in n)))
    for info in zin.infolist():
        if drop(info.filename):
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(line + "\n" for line in data.decode().splitlines() if line and not drop(line.split(",")[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"bitsandbytes: {src.stat().st_size / 2**20:.1f} MiB -> {(out / src.name).stat().st_size / 2**20:.1f} MiB "
      f"(kept {keep})")
EOF
rm -rf "$OUT/.download"

ls -l "$OUT"/*.whl "$OUT"/fallback/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -cb "$OUT"/*.whl "$OUT"/fallback/*.whl | tail -1 | cut -f1)
echo "total $(awk "BEGIN {printf \"%.2f\", $total / 1048576}") MiB of $LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_prepare: over $LIMIT_MIB MiB" >&2
  exit 1
fi
