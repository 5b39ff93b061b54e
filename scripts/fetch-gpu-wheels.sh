#!/usr/bin/env bash
# Download the wheels bench/gpu_check.sh installs on the GPU machine (Python 3.12, x86-64, no
# network there) into .cache/wheels/ (ignored by git; the device call carries it: docs/gpu-check.md).
# Only megatron-core: the GPU image already has torch, triton, numpy, packaging and the rest the
# check imports. megatron-core 0.19.2 ships a compiled dataset helper, hence a CPython 3.12
# manylinux wheel (about 2.4 MB, far inside the 64 MiB a call may carry).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=.cache/wheels
mkdir -p "$dest"
rm -f "$dest"/megatron_core-*.whl  # one version only: two would stop the install there
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$dest" megatron-core==0.19.2
ls -l "$dest"
du -sh "$dest"
