"""README.md: every ``--gift-*`` flag the launcher accepts has a row in its flag table, and the
test command the CI hook looks for is still there."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from megatron_gift.arguments import add_gift_args
from megatron_gift.pretrain_gpt import add_launcher_args

README = Path(__file__).resolve().parents[2] / "README.md"


def _flag_table_rows() -> set[str]:
    """The flags named in the first cell of the README's ``## Flags`` table."""
    section = README.read_text().split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--gift-")]
    return {re.match(r"\| `(--gift-[a-z0-9-]+)", row).group(1) for row in rows}


def test_flag_table_has_a_row_for_every_gift_flag():
    parser = add_launcher_args(add_gift_args(argparse.ArgumentParser()))
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--gift-")}
    flags -= {"--no-gift-error-feedback"}  # the BooleanOptionalAction's negative form
    assert flags - _flag_table_rows() == set()


def test_readme_keeps_the_test_command():
    assert "bash scripts/test.sh" in README.read_text()
