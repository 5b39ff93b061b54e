"""The mutation list fits the tree: every mutant's text occurs exactly once and its tests collect.

The full mutation check (``scripts/mutants.sh``) takes tens of minutes and is not part of the suite;
this is its staleness check, so that code moved or renamed without updating ``tests/mutants.txt``
fails here rather than in the next person's mutation run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mutation_list_is_not_stale():
    """A refactor that changed a mutant's target text would silently drop that mutant from the check."""
    res = subprocess.run(
        [sys.executable, "scripts/mutants.py", "--check", "--python", sys.executable],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
