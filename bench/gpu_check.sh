#!/usr/bin/env bash
# The GPU check: one prepared run on a lent GPU machine (docs/gpu-check.md). Names the machine, runs
# the Triton kernel tests on CUDA, times the codec and fused kernels against copy bandwidth, each
# Llama-600M layer's BF16 fwd+bwd next to the plugin's per-layer work, one profiled steady step per mode
# (gpu_profile: kernels, host work, the plugin's ranges), and a single-GPU Megatron training step per mode
# (codec in loopback) against --gift-mode off, with peak memory; then feeds the step-time model.
# About 9 minutes on an H200.
#
#   bench/gpu_check.sh             on the GPU machine: JSON to $OUT if set, else bench/results/
#   bench/gpu_check.sh --dry-run   on a CPU, tiny shapes, same code path (CI: tests/tools/test_gpu_check.py);
#                                  JSON to $OUT if set, else a fresh temporary folder
#
# megatron-core: used as installed; else installed from the wheel in .cache/wheels/ (made by
# scripts/fetch-gpu-wheels.sh; the device call carries that folder). PYTHON picks the interpreter
# (default python3). Exit status: the first failure's, after running everything.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dry=()
case "${1:-}" in
  --dry-run) dry=(--dry-run) ;;
  "") ;;
  *) echo "usage: bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then out=$OUT; elif ((${#dry[@]})); then out=$(mktemp -d); else out=bench/results; fi
mkdir -p "$out"

main() {
  py=${PYTHON:-python3}
  export NO_VCS_VERSION=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
  # one process, one rank: NCCL (and gloo in the dry run) bootstrap over loopback; no network there
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
  echo "== gpu_check: results to $out"

  if ! "$py" -c "import megatron.core" 2>/dev/null; then
    wheels=(.cache/wheels/megatron_core-*.whl)
    if [ ! -e "${wheels[0]}" ]; then
      echo "== no megatron-core here and no wheel in .cache/wheels/: run scripts/fetch-gpu-wheels.sh on a machine" \
        "with network access and carry .cache/wheels with the call (docs/gpu-check.md)"
      return 2
    fi
    site=$(mktemp -d)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" || return 2
    export PYTHONPATH="$PYTHONPATH:$site"
    echo "== megatron-core installed from ${wheels[*]}"
  fi

  status=0
  step() { echo "== $*"; "$@" || { rc=$?; echo "== failed ($rc): $*"; ((status)) || status=$rc; }; }
  if command -v nvidia-smi >/dev/null; then step nvidia-smi; fi
  step "$py" -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_kernels.py tests/unit/test_fp4_kernels.py --junitxml "$out/kernel-tests.xml"
  # the profile (40 s on an H200) before the long step part: a run stopped by its limit keeps it
  step "$py" -m megatron_gift_tools.bench.gpu_profile --out "$out" "${dry[@]}"
  step "$py" -m megatron_gift_tools.bench.gpu_check --out "$out" "${dry[@]}" --kernel-tests "$out/kernel-tests.xml"
  step "$py" -m megatron_gift_tools model --overhead-json "$out/overhead-gpu.json" --json "$out/model-gpu.json"
  echo "== gpu_check: done (status $status); files in $out"
  return "$status"
}

main 2>&1 | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
