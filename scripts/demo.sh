#!/usr/bin/env bash
# Run the quick gradient-fidelity benchmark on CPU; writes runs/fidelity.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-venv.sh
export NO_VCS_VERSION=1
mkdir -p runs
exec .venv/bin/megatron-gift bench fidelity --quick --json runs/fidelity.json "$@"
