#!/usr/bin/env bash
# Llama-300M recipe: VARIANT=fp32|bf16|euclidean|gift|auto DATA_PATH=... bash examples/llama_300m.sh [--dry-run] [extra flags]
# (all settings: examples/pretrain_llama.sh)
MODEL=300m exec bash "$(dirname "${BASH_SOURCE[0]}")/pretrain_llama.sh" "$@"
