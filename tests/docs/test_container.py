"""The NGC image's build context (``.dockerignore``) keeps out what the image never copies and keeps
in what it does: without it, ``docker build .`` sent the repository's virtualenv (2.2 GB) to the daemon."""

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for these patterns: a pattern matches the path or one of its parent folders
    (``**/`` matches any depth)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/")) for pat in patterns for p in prefixes
    )


def test_dockerignore_keeps_the_copied_paths_and_drops_the_virtualenv():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = [
        src
        for line in re.findall(r"^COPY (.+)$", (ROOT / "examples/ngc/Dockerfile").read_text(), re.M)
        for src in line.split()[:-1]
    ]
    assert copied and not [src for src in copied if _ignored(src, patterns)], copied
    for path in (
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        ".git/HEAD",
        "megatron_gift/__pycache__/x.pyc",
        ".cache/wheels/a.whl",
    ):
        assert _ignored(path, patterns), path
    assert not _ignored("megatron_gift/megatron/ddp.py", patterns)
