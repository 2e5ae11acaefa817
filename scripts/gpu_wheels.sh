#!/usr/bin/env bash
# Download the wheels bench/gpu_proof.py's peers need on a GPU machine without a network (Python 3.12,
# manylinux x86_64) into .gpu_wheels/ (git-ignored; carry it with the device command). The GPU image already has
# torch, Triton, transformers, peft and accelerate. Fails when the folder would exceed the carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_wheels}
LIMIT_MIB=${EFFPASS_WHEELS_LIMIT_MIB:-56}   # the device carry is 64 MiB with the working tree (~7 MiB)
mkdir -p "$DEST"
PIP="${PYTHON:-.venv/bin/python} -m pip"
for spec in liger-kernel cut-cross-entropy trl "torchao==0.18.0" "bitsandbytes==0.50.2"; do
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any -d "$DEST" "$spec" 2>&1 | grep -v "^WARNING: Location" || true
done
size=$(du -sm "$DEST" | cut -f1)
ls -la "$DEST"
echo "gpu_wheels: $size MiB in $DEST (limit $LIMIT_MIB)"
[ "$size" -le "$LIMIT_MIB" ] || { echo "gpu_wheels: over the carry limit; drop a peer" >&2; exit 1; }
