"""What every command of the tools shares: the dependency check and argument types (imported by
``cli`` and ``planner.cli``, so neither imports the other)."""

from __future__ import annotations

import argparse
import importlib.util

PLOTS, CORPUS = ("matplotlib",), ("tokenizers",)  # pyproject.toml's [project.optional-dependencies] bench


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it, or a broken installation
        return False


def require_bench_extra(command: str, modules: tuple[str, ...]) -> None:
    """Stop with the install line when one of ``modules`` (of the ``bench`` extra) is missing."""
    missing = [m for m in modules if not _importable(m)]
    if missing:
        raise SystemExit(
            f"{command} needs {', '.join(missing)} (a dependency of the tools): "
            "pip install -e tools  (in the megatron-gift checkout)"
        )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
