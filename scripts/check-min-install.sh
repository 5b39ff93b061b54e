#!/usr/bin/env bash
# Manual check (not run by CI; minutes, mostly installing torch) that the README's install section
# works in a fresh venv holding only what a Megatron environment has: `pip install --no-deps -e .`
# gives a working runtime without the tools' extras (matplotlib, tokenizers). Builds ${VENV:-/tmp/venv-min}.
#
#   bash scripts/check-min-install.sh
#       torch, megatron-core and what they need at import (the CPU wheels' pins): prints the launcher's
#       --gift-* flags, then trains 3 iterations of the launcher on 2 CPU ranks with Megatron's mock data.
#   MEGATRON_LM_DIR=/path/to/Megatron-LM PYTHON=python3.12 bash scripts/check-min-install.sh
#       Megatron-LM's own pretrain_gpt.py (Python >= 3.12): torch 2.13.0 (on CPython 3.12 PyPI's only
#       Linux x86_64 wheel is the CUDA build, ~4.8 GB in the venv; it runs on the CPU), megatron-core
#       0.19.2, psutil and pybind11; the checkout's branch core_r0.19.0 (a checkout or a bare mirror)
#       cloned to a temporary folder, patched with patches/apply.sh, trained 3 iterations with
#       --gift-mode gift on 2 CPU ranks through `python -m megatron_gift.megatron.cpu_run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
venv=${VENV:-/tmp/venv-min}
if [[ -e $venv && ! -f $venv/pyvenv.cfg ]]; then
  echo "check-min-install: $venv exists and is not a venv; set VENV to a new path" >&2; exit 2
fi
rm -rf "$venv"
"${PYTHON:-python3}" -m venv "$venv"
py=$venv/bin/python
quiet=(-q --disable-pip-version-check)
if [[ -n ${MEGATRON_LM_DIR:-} ]]; then
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
    || { echo "check-min-install: Megatron-LM's pretrain_gpt.py needs Python >= 3.12; set PYTHON" >&2; exit 2; }
  # A Megatron-LM environment: torch (CUDA build from PyPI; brings triton), megatron-core, what the
  # script needs beyond it (psutil for checkpoints, pybind11 for the dataset helpers).
  "$py" -m pip install "${quiet[@]}" torch==2.13.0 numpy packaging megatron-core==0.19.2 psutil pybind11
else
  pip=("$py" -m pip install "${quiet[@]}" -c scripts/requirements-cpu.txt)
  "${pip[@]}" torch numpy packaging triton   # triton: `import megatron.core` needs it (a CUDA torch brings it)
  "${pip[@]}" --ignore-requires-python --no-deps megatron-core   # its metadata asks for Python >= 3.12
fi
"$py" -m pip install "${quiet[@]}" --no-deps -e .   # the README's install section
if "$py" -c "import matplotlib" 2>/dev/null || "$py" -c "import tokenizers" 2>/dev/null; then
  echo "check-min-install: the bench extra is installed in $venv; this check needs it absent" >&2; exit 1
fi
model=(--mock-data --tokenizer-type NullTokenizer --vocab-size 512
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
  --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3 --log-interval 1
  --eval-iters 1 --eval-interval 100 --use-distributed-optimizer --overlap-grad-reduce)
run=(env OMP_NUM_THREADS=1 "$py" -m torch.distributed.run --standalone --nproc-per-node 2)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # import the installed package, not the checkout
if [[ -n ${MEGATRON_LM_DIR:-} ]]; then
  git clone -q --branch core_r0.19.0 "$MEGATRON_LM_DIR" Megatron-LM
  bash "$repo/patches/apply.sh" Megatron-LM
  "${run[@]}" -m megatron_gift.megatron.cpu_run Megatron-LM/pretrain_gpt.py "${model[@]}" --gift-mode gift \
    > train.log 2>&1 || { tail -20 train.log >&2; echo "check-min-install: the patched script failed" >&2; exit 1; }
  want="'gift': 8"
else
  flags=$("$py" -m megatron_gift.pretrain_gpt --help 2>/dev/null | grep -o -- '--gift-[a-z0-9-]*[a-z0-9]' | sort -u)
  echo "$flags"
  [[ $flags == *--gift-mode* ]] || { echo "check-min-install: --help lists no --gift-mode" >&2; exit 1; }
  "${run[@]}" -m megatron_gift.pretrain_gpt --gift-cpu "${model[@]}" --gift-mode euclidean \
    > train.log 2>&1 || { tail -20 train.log >&2; echo "check-min-install: the launcher failed" >&2; exit 1; }
  want="'euclidean': 8"
fi
grep -E "iteration +[0-9]+/|lm loss value" train.log
grep -qE "iteration +3/ +3 " train.log || { echo "check-min-install: no third iteration" >&2; exit 1; }
grep -q "$want" train.log || { echo "check-min-install: the model was not wrapped with $want" >&2; exit 1; }
echo "check-min-install: OK ($("$py" --version), torch $("$py" -c 'import torch; print(torch.__version__)'))"
