#!/usr/bin/env bash
# Manual check (not run by CI; minutes, mostly installing torch): megatron-gift installed with `pip install --no-deps -e .`
# into a fresh venv that has only torch, megatron-core and what they need at import gives a working
# launcher, without the bench extra (matplotlib, tokenizers). Builds ${VENV:-/tmp/venv-min}, prints
# the launcher's --gift-* flags, then trains 3 iterations on 2 CPU ranks with Megatron's mock data.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${VENV:-/tmp/venv-min}
if [[ -e $venv && ! -f $venv/pyvenv.cfg ]]; then
  echo "check-min-install: $venv exists and is not a venv; set VENV to a new path" >&2; exit 2
fi
rm -rf "$venv"
"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c scripts/requirements-cpu.txt)
"${pip[@]}" torch numpy packaging triton   # triton: `import megatron.core` needs it (a CUDA torch brings it)
"${pip[@]}" --ignore-requires-python --no-deps megatron-core   # its metadata asks for Python >= 3.12
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
if "$venv/bin/python" -c "import matplotlib" 2>/dev/null || "$venv/bin/python" -c "import tokenizers" 2>/dev/null; then
  echo "check-min-install: the bench extra is installed in $venv; this check needs it absent" >&2; exit 1
fi
cd /tmp  # import the installed package, not the checkout
flags=$("$venv/bin/python" -m megatron_gift.pretrain_gpt --help 2>/dev/null | grep -o -- '--gift-[a-z0-9-]*[a-z0-9]' | sort -u)
echo "$flags"
[[ $flags == *--gift-mode* ]] || { echo "check-min-install: --help lists no --gift-mode" >&2; exit 1; }
OMP_NUM_THREADS=1 "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 \
  -m megatron_gift.pretrain_gpt --gift-cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 512 \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3 --log-interval 1 \
  --eval-iters 1 --eval-interval 100 --use-distributed-optimizer --overlap-grad-reduce \
  --gift-mode euclidean 2>&1 | grep -E "iteration +[0-9]+/|megatron-gift: model wrapped"
echo "check-min-install: OK"
