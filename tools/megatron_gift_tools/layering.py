"""The runtime's layers as docs/how-it-works.md lists them (``<!-- import layers -->``), top first: the
import-graph test checks every import against them, ``bench path`` every call of a traced reduction."""

from __future__ import annotations

from pathlib import Path

HOW_IT_WORKS = Path(__file__).resolve().parents[2] / "docs" / "how-it-works.md"


def layers(doc: Path = HOW_IT_WORKS) -> list[tuple[str, ...]]:
    """The module prefixes of each layer, top first, from the fenced block after ``<!-- import layers -->``."""
    block = doc.read_text().split("<!-- import layers -->\n```\n", 1)[1].split("```", 1)[0]
    return [tuple(line.split(":", 1)[0].split()) for line in block.strip().splitlines()]


def layer_of(module: str, table: list[tuple[str, ...]]) -> int:
    """Index of the layer whose longest prefix names ``module`` (a prefix matches itself and its submodules)."""
    best = (-1, None)
    for i, prefixes in enumerate(table):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best[0]:
                best = (len(p), i)
    if best[1] is None:
        raise ValueError(f"{module} is in no layer of docs/how-it-works.md")
    return best[1]
