"""Every measured number in a rendered block of README.md and docs/*.md is what bench/results' JSONs give."""

from __future__ import annotations

import json

import pytest

from megatron_gift_tools import render_docs


def test_rendered_blocks_are_current():
    """A number copied by hand, or left behind when a benchmark's JSON was regenerated, fails here.
    Fix: ``megatron-gift docs`` rewrites the blocks."""
    assert render_docs.stale() == []


def test_renderer_rewrites_a_stale_block_and_refuses_an_unknown_one(tmp_path):
    """A renderer that left a stale block alone (or let a misspelt block name through) would make the test
    above pass on any file."""
    text = "a\n<!-- rendered: fidelity-pretrained -->\nold numbers\n<!-- end rendered -->\nb\n"
    new = render_docs.render(text)
    assert new.startswith("a\n<!-- rendered: fidelity-pretrained -->\n| model |") and new.endswith(
        "<!-- end rendered -->\nb\n"
    )
    assert "old numbers" not in new
    with pytest.raises(ValueError, match="unknown rendered block"):
        render_docs.render("<!-- rendered: nope -->\n<!-- end rendered -->")


def test_planner_block_names_the_fastest_rows_flags(tmp_path):
    """The decision table's flags and gain come from the planner's fastest non-FP32 row: a row chosen by
    the wrong key (the slowest, or FP32) or flags for the wrong mode would mislead a user."""
    rows = [
        dict(mode="fp32", gift_schedule="eager", param_gather="bf16", step_s=0.5, vs_bf16_pct=50.0),
        dict(mode="bf16", gift_schedule="eager", param_gather="bf16", step_s=0.4, vs_bf16_pct=0.0),
        dict(mode="euclidean-2level", gift_schedule="eager", param_gather="bf16", step_s=0.3, vs_bf16_pct=-25.0),
    ]
    delta = [
        dict(r, param_gather="delta", step_s=r["step_s"] + 0.05, vs_bf16_pct=r["vs_bf16_pct"] + 12.5) for r in rows
    ]
    for prefix in render_docs.CLUSTERS:
        for suffix, rs in (("", rows), ("-delta", delta)):
            (tmp_path / f"{prefix}{suffix}.json").write_text(
                json.dumps({"plans": [dict(gpus=64, baseline_s=0.4, rows=rs)]})
            )
    table = render_docs.planner_600m(tmp_path)
    assert table.count("| 64 | 400.0 | `--gift-mode euclidean` | -25.0% |") == 3
