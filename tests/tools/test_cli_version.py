"""``megatron-gift --version``: the line a bug report quotes."""

import subprocess
import sys

import megatron_gift


def test_version_names_the_runtime_and_the_tools():
    """Issue 37 item 5: ``megatron-gift --version`` was an unknown flag (argparse's error, exit 2). The
    command prints the runtime's version (its package's ``__version__``) and the tools' and exits 0."""
    res = subprocess.run(
        [sys.executable, "-m", "megatron_gift_tools", "--version"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith(f"megatron-gift {megatron_gift.__version__} (tools "), line
    assert "not installed" not in line, line
