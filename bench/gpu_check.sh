#!/usr/bin/env bash
# The GPU check, for when a GPU machine is lent: nvidia-smi, the Triton kernel tests on CUDA, the
# overhead benchmark on the GPU (-> bench/results/overhead-h200.json) and the step-time model fed with
# it (-> bench/results/model-h200.json). Runs as is in an NGC PyTorch container with this repository
# installed (`pip install -e . --no-deps`) or just checked out; a few minutes. Exit status: the first
# failure's, after running everything.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NO_VCS_VERSION=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() { echo "== $*"; "$@" || { rc=$?; echo "== failed ($rc): $*"; ((status)) || status=$rc; }; }
step nvidia-smi
step python -m pytest -q -m gpu tests/test_kernels.py
step python -m megatron_gift bench overhead --json bench/results/overhead-h200.json
step python -m megatron_gift model --overhead-json bench/results/overhead-h200.json --json bench/results/model-h200.json
exit "$status"
