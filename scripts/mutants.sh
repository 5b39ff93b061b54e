#!/usr/bin/env bash
# Mutation check (docs/testing.md, "Mutation check"): each single-point mutation of tests/mutants.txt
# applied to a copy of the working tree in turn, its named tests run there; reports the survivors and
# the time each mutant took. Exit 0: every mutant killed; 1: one survived; 2: the list is stale.
# Arguments go to scripts/mutants.py (--only ID..., --check, --baseline, --logs DIR).
# MUTANTS_PYTHON: an interpreter to use instead of the repository's .venv (set up here if missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${MUTANTS_PYTHON:-}
if [ -z "$python" ]; then
  bash scripts/setup-venv.sh
  python=$PWD/.venv/bin/python
fi
exec "$python" scripts/mutants.py --python "$python" "$@"
