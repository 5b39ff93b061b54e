"""``megatron-gift report RUN_DIR``: plots and a Markdown summary of a run's gradient telemetry.

Reads ``RUN_DIR/gift_telemetry.jsonl`` (the schema is in ``megatron_gift.telemetry``) and
writes to the output directory (default: next to the file):

* ``rel_l2_heatmap.png``: layers x steps, log colour (whole decades) of the reduced gradient's RelL2;
* ``mode_timeline.png``: layers x steps, one colour per mode, switches marked;
* ``loss.png``: the loss curve (when lines carry a loss);
* ``report.md``: per layer final/mean RelL2, final mode and switches; every decision with its
  reason; bytes per step; links to the plots.

A step logged twice (a resumed run appends) keeps its last line; an unreadable last line (a
run still writing, or killed mid-line) is skipped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from megatron_gift.telemetry import MODE_CODES as MODES
from megatron_gift.telemetry import TELEMETRY_FILE

MODE_COLORS = ("lightgray", "tab:blue", "tab:orange", "tab:green")


def telemetry_path(run: str | os.PathLike) -> Path:
    """A run directory's telemetry file, or ``run`` itself when it is the file."""
    path = Path(run)
    return path / TELEMETRY_FILE if path.is_dir() else path


def read_telemetry(path: str | os.PathLike) -> list[dict]:
    """The lines of a telemetry file (or of a run directory's), one per step in step order."""
    path = telemetry_path(path)
    text = path.read_text(encoding="utf-8").splitlines()
    by_step = {}
    for i, raw in enumerate(text):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as err:
            if i == len(text) - 1:
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON line ({err})") from None
        by_step[int(line["step"])] = line
    return [by_step[s] for s in sorted(by_step)]


def _tables(lines: list[dict]):
    """``steps [S]``, layer names, ``rel [L, S]`` (NaN: none), ``mode [L, S]`` (-1: none), decisions."""
    steps = np.array([line["step"] for line in lines], dtype=float)
    names = list(dict.fromkeys(name for line in lines for name in line.get("layers") or {}))
    row = {name: i for i, name in enumerate(names)}
    rel = np.full((len(names), len(lines)), np.nan)
    mode = np.full((len(names), len(lines)), -1)
    decisions = []
    for j, line in enumerate(lines):
        for name, layer in (line.get("layers") or {}).items():
            if layer.get("rel_l2") is not None:
                rel[row[name], j] = layer["rel_l2"]
            if layer.get("mode") in MODES:
                mode[row[name], j] = MODES.index(layer["mode"])
        decisions += [{"step": line["step"], **d} for d in line.get("decisions") or []]
    return steps, names, rel, mode, decisions


def _edges(steps: np.ndarray) -> np.ndarray:
    """Cell boundaries half-way between logged steps (steps may be irregular)."""
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])


def _labels(names: list[str]) -> list[str]:
    """Names without their common dotted prefix (``module.decoder.layers.``)."""
    if len(names) < 2:
        return names
    prefix = os.path.commonprefix(names)
    cut = prefix.rfind(".") + 1
    return [n[cut:] for n in names]


def _layer_axes(plt, names: list[str]):
    n = len(names)
    height = min(40.0, 2.2 + 0.24 * n)  # inches; rows get ~70% of the 72 pt per inch left after the margins
    fig, ax = plt.subplots(figsize=(9, height), dpi=110)
    ax.set_yticks(range(n))
    ax.set_yticklabels(_labels(names), fontsize=max(2.0, min(8.0, 0.7 * 72 * (height - 2.2) / n)))
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel("step")
    return fig, ax


def colour_range(values) -> tuple[float, float]:
    """The heat map's log colour range for positive ``values``: whole decades around them, at least
    one, so that the run-to-run noise of a RelL2 (a few percent) stays a shade of one colour instead
    of spanning the whole scale as a min-to-max range would make it."""
    lo, hi = float(np.min(values)), float(np.max(values))
    return 10.0 ** math.floor(math.log10(lo)), 10.0 ** max(math.ceil(math.log10(hi)), math.floor(math.log10(lo)) + 1)


def render(run: str | os.PathLike, out: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write the plots and ``report.md`` for ``run`` (a run directory or the JSONL file itself);
    returns ``{"report": ..., "rel_l2_heatmap": ..., "mode_timeline": ..., "loss": ...}`` for the
    files written (a plot without data is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, ListedColormap, LogNorm
    from matplotlib.patches import Patch

    path = telemetry_path(run)
    lines = read_telemetry(path)
    if not lines:
        raise ValueError(f"{path}: no telemetry lines")
    out = Path(out) if out is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    steps, names, rel, mode, decisions = _tables(lines)
    edges, y_edges = _edges(steps), np.arange(len(names) + 1) - 0.5
    written: dict[str, Path] = {}

    positive = np.isfinite(rel) & (rel > 0)
    if positive.any():
        fig, ax = _layer_axes(plt, names)
        lo, hi = colour_range(rel[positive])
        mesh = ax.pcolormesh(
            edges, y_edges, np.ma.masked_where(~positive, rel), cmap="viridis", norm=LogNorm(vmin=lo, vmax=hi)
        )
        fig.colorbar(mesh, ax=ax, label="RelL2 vs FP32 sum")
        ax.set_title("Reduced-gradient RelL2 per layer (blank: not measured)", fontsize=10)
        fig.tight_layout()
        written["rel_l2_heatmap"] = out / "rel_l2_heatmap.png"
        fig.savefig(written["rel_l2_heatmap"], bbox_inches="tight")
        plt.close(fig)

    if (mode >= 0).any():
        fig, ax = _layer_axes(plt, names)
        ax.pcolormesh(
            edges,
            y_edges,
            np.ma.masked_where(mode < 0, mode),
            cmap=ListedColormap(MODE_COLORS),
            norm=BoundaryNorm(np.arange(len(MODES) + 1) - 0.5, len(MODES)),
        )
        row = {name: i for i, name in enumerate(names)}
        marked = [d for d in decisions if d.get("param") in row]
        if marked:
            ax.scatter(
                [d["step"] for d in marked],
                [row[d["param"]] for d in marked],
                marker="v",
                s=36,
                color="black",
                zorder=3,
                label="switch",
            )
        present = sorted(set(mode[mode >= 0].tolist()))
        handles = [Patch(color=MODE_COLORS[m], label=MODES[m]) for m in present]
        ax.legend(
            handles=handles + ax.get_legend_handles_labels()[0],
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=8,
        )
        ax.set_title("Communication mode per layer (▼: policy switch)", fontsize=10)
        fig.tight_layout()
        written["mode_timeline"] = out / "mode_timeline.png"
        fig.savefig(written["mode_timeline"])
        plt.close(fig)

    loss = [(line["step"], line["loss"]) for line in lines if line.get("loss") is not None]
    if loss:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        ax.plot(*zip(*loss), lw=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written["loss"] = out / "loss.png"
        fig.savefig(written["loss"])
        plt.close(fig)

    written["report"] = out / "report.md"
    written["report"].write_text(format_report(path, lines, names, rel, mode, decisions, written), encoding="utf-8")
    return written


def _g(x: float) -> str:
    return "-" if not np.isfinite(x) else f"{x:.3g}"


def format_report(path: Path, lines, names, rel, mode, decisions, written) -> str:
    steps = [line["step"] for line in lines]
    md = [
        "# Gradient communication telemetry",
        "",
        f"`{path}`: {len(lines)} logged steps ({steps[0]}–{steps[-1]}), {len(names)} parameters, "
        f"{len(decisions)} policy switches.",
        "",
        "## Parameters",
        "",
        "| parameter | final mode | final RelL2 | mean RelL2 | switches |",
        "|---|---|---|---|---|",
    ]
    for i, name in enumerate(names):
        seen = rel[i][np.isfinite(rel[i])]
        modes = mode[i][mode[i] >= 0]
        final_mode = MODES[modes[-1]] if len(modes) else "-"
        n_switch = sum(1 for d in decisions if d.get("param") == name)
        md.append(
            f"| `{name}` | {final_mode} | {_g(seen[-1]) if len(seen) else '-'} | "
            f"{_g(seen.mean()) if len(seen) else '-'} | {n_switch} |"
        )
    md += ["", "## Decisions", ""]
    md += [
        f"- step {d['step']}: `{d.get('param')}` {d.get('from')} → {d.get('to')}: {d.get('reason', '')}"
        for d in decisions
    ] or ["No switches."]
    byte_keys = list(dict.fromkeys(k for line in lines for k in line.get("bytes") or {}))
    if byte_keys:
        md += ["", "## Bytes per step (mean over the lines that report them)", ""]
        md += ["| collective/dtype | bytes |", "|---|---|"]
        for k in byte_keys:
            vals = [line["bytes"][k] for line in lines if k in (line.get("bytes") or {})]
            md.append(f"| {k} | {sum(vals) / len(vals):,.0f} |")
    titles = {"rel_l2_heatmap": "RelL2 per layer and step", "mode_timeline": "mode per layer and step", "loss": "loss"}
    plots = [f"![{titles[k]}]({p.name})" for k, p in written.items() if k in titles]
    if plots:
        md += ["", "## Plots", "", *plots]
    return "\n".join(md) + "\n"
