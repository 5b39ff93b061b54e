#!/usr/bin/env bash
# Run ruff (lint, format check) and the test suite in the pinned CPU environment; arguments go to pytest.
# pytest's exit code is returned as is (5, "no tests collected", counts as failure); the summary
# gives the suite's time and its ten slowest tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-venv.sh
export NO_VCS_VERSION=1
# lint and format first (seconds): a style error fails the run like a test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q --durations=10 "$@"
