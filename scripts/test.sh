#!/usr/bin/env bash
# Run the test suite in the pinned CPU environment; arguments go to pytest.
# pytest's exit code is returned as is (5, "no tests collected", counts as failure); the summary
# gives the suite's time and its ten slowest tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-venv.sh
export NO_VCS_VERSION=1
exec .venv/bin/python -m pytest -q --durations=10 "$@"
