#!/usr/bin/env bash
# The project's demo on CPU: train a small Llama-style Megatron GPTModel on 2 gloo ranks with FP32,
# BF16, Euclidean-E4M3 and GIFT-E4M3 gradient communication (megatron-gift demo --quick, a few
# minutes); writes runs/demo/{report.md,metrics.json,*.png}. Extra arguments go to megatron-gift demo
# (e.g. --out DIR; drop --quick by running .venv/bin/megatron-gift demo yourself).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-venv.sh
export NO_VCS_VERSION=1
exec .venv/bin/megatron-gift demo --quick "$@"
