#!/usr/bin/env bash
# Check that Megatron-LM's patched pretrain_gpt.py trains exactly like megatron_gift.pretrain_gpt.
#
#   patches/compare_with_launcher.sh MEGATRON_LM_DIR [extra Megatron/--gift-* flags...]
#
# MEGATRON_LM_DIR: a Megatron-LM checkout on core_r0.19.0 (patched here with apply.sh if it is
# not yet). Both programs run on CPU (gloo, 2 ranks, a 2-layer model, mock data, 3 iterations)
# with the same flags and the same `megatron` package (the checkout's, via PYTHONPATH); the
# patched script runs under the CPU harness through python -m megatron_gift.megatron.cpu_run. The script
# prints both runs' "iteration N | ... lm loss" values and exits 1 unless they are identical
# and both runs report a GiftDistributedDataParallel wrapper (the patched script does not print
# the launcher's "model wrapped in" line, so the GIFT byte-count log lines are compared instead).
#
# Needs: this package installed, a CPU-only torch (the CPU harness refuses CUDA; on a GPU
# machine run it with CUDA_VISIBLE_DEVICES= ), and the checkout's dataset helpers buildable
# (make + pybind11) or already built. Not run in CI (it needs a Megatron-LM checkout).
#
# Environment: PYTHON (default python3), NPROC (2), ITERS (3), KEEP_LOGS=1 keeps the logs' folder.
set -euo pipefail

[[ $# -ge 1 ]] || { echo "usage: $0 MEGATRON_LM_DIR [extra flags...]" >&2; exit 2; }
mlm=$(cd "$1" && pwd)
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
nproc=${NPROC:-2}
iters=${ITERS:-3}

bash "$here/apply.sh" "$mlm"

work=$(mktemp -d)
[[ ${KEEP_LOGS:-0} == 1 ]] && echo "logs in $work" || trap 'rm -rf "$work"' EXIT


flags=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 176
    --seq-length 64 --max-position-embeddings 64
    --position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear
    --untie-embeddings-and-output-weights
    --micro-batch-size 2 --global-batch-size 8 --train-iters "$iters"
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --seed 1234
    --use-distributed-optimizer --overlap-grad-reduce
    --log-interval 1 --eval-iters 0 --eval-interval 1000 --split 98,2,0
    --mock-data --tokenizer-type NullTokenizer --vocab-size 2048
    --data-cache-path "$work/index-cache"
    --gift-mode gift --gift-rank 8 --gift-sketch 16 --gift-refresh-interval 1 --gift-log-interval 1
    --gift-telemetry-dir "$work/telemetry"
    "$@"
)

# The checkout's dataset-helper Makefile runs `python3` from PATH: make it this Python.
py_dir=$(dirname "$(command -v "$py")")
[[ -x $py_dir/python3 ]] && export PATH="$py_dir:$PATH"
export PYTHONPATH="$mlm${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
# Build the checkout's dataset helpers for this Python (the Makefile's own python3/python3-config
# may be another interpreter); both programs then skip Megatron's `make` at start-up.
if ! "$py" -c 'import megatron.core.datasets.helpers_cpp' 2>/dev/null; then
    make -s -C "$mlm/megatron/core/datasets" \
        CPPFLAGS="$("$py" -m pybind11 --includes)" \
        LIBEXT="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
fi
run() {  # run NAME ARGS...: torchrun on this machine, output in $work/NAME.log
    local name=$1
    shift
    echo "== $name: torchrun --nproc-per-node $nproc $*" | cut -c1-200
    if ! "$py" -m torch.distributed.run --standalone --nproc-per-node "$nproc" "$@" "${flags[@]}" \
        >"$work/$name.log" 2>&1; then
        tail -n 60 "$work/$name.log" >&2
        echo "compare_with_launcher.sh: $name failed (log above)" >&2
        exit 1
    fi
}
run launcher -m megatron_gift.pretrain_gpt --gift-cpu
run patched -m megatron_gift.megatron.cpu_run "$mlm/pretrain_gpt.py"  # the script's CPU route

losses() { sed -n 's/.*iteration *\([0-9]*\)\/ *[0-9]* |.*lm loss: \([-+0-9.eE]*\).*/\1 \2/p' "$1"; }
losses "$work/launcher.log" >"$work/launcher.loss"
losses "$work/patched.log" >"$work/patched.loss"
gift_lines() { grep -c 'megatron-gift: iteration [0-9]*: gradient reduction sent' "$1" || true; }

echo "== lm loss (iteration, launcher | patched Megatron-LM script)"
paste "$work/launcher.loss" "$work/patched.loss"
status=0
if [[ $(wc -l <"$work/launcher.loss") -ne $iters ]]; then
    echo "compare_with_launcher.sh: expected $iters loss lines from the launcher" >&2
    status=1
fi
if ! diff -u "$work/launcher.loss" "$work/patched.loss"; then
    echo "compare_with_launcher.sh: the losses differ" >&2
    status=1
fi
for name in launcher patched; do
    if [[ $(gift_lines "$work/$name.log") -eq 0 ]]; then
        echo "compare_with_launcher.sh: $name printed no megatron-gift gradient-reduction lines" \
            "(GIFT's DDP not used? the check needs a --gift-mode other than off)" >&2
        status=1
    fi
done
diff <(grep -o 'gradient reduction sent.*' "$work/launcher.log") \
    <(grep -o 'gradient reduction sent.*' "$work/patched.log") >/dev/null ||
    { echo "compare_with_launcher.sh: the bytes sent differ" >&2; status=1; }
[[ $status -eq 0 ]] && echo "compare_with_launcher.sh: identical losses and GIFT traffic over $iters iterations"
exit $status
