"""``megatron-gift docs``: the measured numbers of README.md and docs/*.md, rendered from bench/results/*.json.

A rendered block in a markdown file is::

    <!-- rendered: NAME -->
    ...text this module writes...
    <!-- end rendered -->

``NAME`` is a key of ``RENDERERS`` (a function of the results folder returning markdown). ``megatron-gift
docs`` rewrites every block in place; ``--check`` only reports the blocks whose text is not what the
JSONs give (a test runs it, so a number copied by hand or left behind by a new JSON fails the suite).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
FILES = ("README.md", "docs/*.md")
BLOCK = re.compile(r"(<!-- rendered: ([\w-]+) -->\n)(.*?)(<!-- end rendered -->)", re.S)

CLUSTERS = {  # planner JSON prefix -> the cluster as a user knows it
    "model-gh200": "4-GPU GH200 nodes, 200 Gb/s per GPU",
    "model-h100-600m": "8-GPU H100 nodes, 400 Gb/s per GPU",
    "model-h100-100g-600m": "8-GPU nodes, 100 Gb/s per GPU",
}


def _load(results: Path, name: str) -> dict:
    with open(results / name) as f:
        return json.load(f)


def flags_for(mode: str, param_gather: str) -> str:
    """The flags that turn on what the planner's ``mode`` and ``param_gather`` name (``none`` where that is
    stock Megatron's BF16 reduction and gather)."""
    flags = {
        "bf16": [],
        "euclidean-2level": ["--gift-mode euclidean"],
        "gift-2level": ["--gift-mode gift"],
        "euclidean": ["--gift-mode euclidean", "--gift-exchange flat"],
        "gift": ["--gift-mode gift", "--gift-exchange flat"],
    }[mode]
    if param_gather == "delta":
        flags = ["--use-distributed-optimizer", *flags, "--gift-param-gather delta"]
    return " ".join(f"`{f}`" for f in flags) if flags else "none: keep stock Megatron"


def _best(plan: dict, min_gain_pct: float) -> tuple[str, float]:
    """The plan's fastest row among what a user can turn on (not FP32), as (flags, % against BF16); stock
    Megatron where that gains less than the planner's ``min_gain_pct``."""
    rows = [r for r in plan["rows"] if r["mode"] != "fp32" and r["gift_schedule"] == plan["rows"][0]["gift_schedule"]]
    best = min(rows, key=lambda r: r["step_s"])
    if (best["mode"] == "bf16" and best["param_gather"] == "bf16") or best["vs_bf16_pct"] > -min_gain_pct:
        return flags_for("bf16", "bf16"), 0.0
    return flags_for(best["mode"], best["param_gather"]), best["vs_bf16_pct"]


def _fastest(results: Path) -> dict[str, list[tuple[int, float, str, float]]]:
    """Per cluster label: ``(gpus, BF16 step s, flags, % vs BF16)`` of the fastest choice at each GPU count,
    with Megatron's parameter gather or the delta gather."""
    out = {}
    for prefix, label in CLUSTERS.items():
        plain, delta = _load(results, f"{prefix}.json"), _load(results, f"{prefix}-delta.json")
        gain = plain.get("min_gain_pct", 1.0)
        for p, d in zip(plain["plans"], delta["plans"]):
            flags, pct = min(_best(p, gain), _best(d, gain), key=lambda c: c[1])
            out.setdefault(label, []).append((p["gpus"], p["baseline_s"], flags, pct))
    return out


def decision(results: Path) -> str:
    """One line per cluster: the flags to add and what they give (Llama-600M, 64-512 GPUs)."""
    lines = []
    for label, rows in _fastest(results).items():
        by_flags = {}
        for gpus, _, flags, pct in rows:
            by_flags.setdefault(flags, []).append((gpus, pct))
        parts = []
        for flags, cells in by_flags.items():
            where = ", ".join(str(g) for g, _ in cells)
            if flags.startswith("none"):
                parts.append(f"keep stock Megatron at {where} GPUs (nothing here is faster)")
            else:
                gains = ", ".join(f"{p:+.1f}%" for _, p in cells)
                parts.append(f"{flags} at {where} GPUs ({gains} step time)")
        lines.append(f"- **{label}**: " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


def planner_600m(results: Path) -> str:
    """Per cluster and GPU count (Llama-600M): the fastest configuration the planner finds, with or without
    the delta parameter gather, as flags, against Megatron's BF16 at its better bucket size."""
    lines = [
        "| cluster | GPUs | BF16 step (ms) | fastest: add these flags | step time vs BF16 |",
        "|---|---|---|---|---|",
    ]
    for label, rows in _fastest(results).items():
        for gpus, baseline_s, flags, pct in rows:
            shown = "0 (stock)" if flags.startswith("none") else f"{pct:+.1f}%"
            lines.append(f"| {label} | {gpus} | {1e3 * baseline_s:.1f} | {flags} | {shown} |")
    return "\n".join(lines) + "\n"


SUMMARIES = {  # docs/planner.md's per-cluster tables: block name -> the planner JSONs, one per model
    "gh200": ("model-gh200", "model-gh200-1.3b", "model-gh200-7b"),
    "h100": ("model-h100-600m", "model-h100-1.3b", "model-h100-7b", "model-h100-8b"),
    "h100-100g": ("model-h100-100g-600m", "model-h100-100g-1.3b", "model-h100-100g-7b"),
}


def _size(elements: int | None) -> str:
    return "default" if elements is None else f"{elements / 1e6:g}M"


def planner_summary(results: Path, cluster: str, delta: bool) -> str:
    """One row per model and GPU count of a cluster (``SUMMARIES``), Megatron's BF16 or the delta parameter
    gather: the BF16 baseline at Megatron's default and best bucket size, every scheme of the runtime against
    the better one (the plugin's eager / lagged), and the recommendation."""
    from megatron_gift_tools.planner.output import label, recommended_row
    from megatron_gift_tools.planner.schemes import BASE

    plans = [
        p for name in SUMMARIES[cluster] for p in _load(results, name + ("-delta" if delta else "") + ".json")["plans"]
    ]
    names = [s for s in BASE if s.value != "bf16" or delta]
    suffix = " + delta" if delta else ""
    lines = [
        "| model | GPUs | TP | DP per node x nodes | BF16 ms, default bucket | BF16 ms, best bucket | "
        + " | ".join(s.label + suffix for s in names)
        + " | recommended |",
        "|---|---|---|---|---|---|" + "---|" * (len(names) + 1),
    ]
    for p in plans:
        by = {r["mode"]: r for r in p["rows"]}
        cells = []
        for s in names:
            r = by[s.value]
            lagged = f" / {r['other_schedule_vs_bf16_pct']:+.1f}%" if "other_schedule_vs_bf16_pct" in r else ""
            cells.append(f"{r['vs_bf16_pct']:+.1f}%{lagged}")
        rec = recommended_row(p)
        if rec is None:
            size = p["recommended_bucket_size"]
            shown = "BF16 ring" + ("" if size is None else f" ({_size(size)} bucket)")
        else:
            size = "" if rec["bucket_size"] is None else f" ({_size(rec['bucket_size'])})"
            shown = f"{label(rec)}{size} ({rec['vs_bf16_pct']:+.1f}%)"
        bf16 = by["bf16"]
        lines.append(
            f"| {p['model']} | {p['gpus']} | {p['tp']} | {bf16['ranks_per_node']} x {bf16['nodes']} | "
            f"{1e3 * p['bf16_default_step_s']:.1f} | {1e3 * p['bf16_tuned_step_s']:.1f} "
            f"({_size(p['bf16_tuned_bucket_size'])}) | " + " | ".join(cells) + f" | {shown} |"
        )
    return "\n".join(lines) + "\n"


def fidelity_pretrained(results: Path) -> str:
    """What GIFT sends (``gift-chosen``, after the cold start) per pretrained model and layer type: its
    gradient error over the best plain FP8's (geometric mean over layers and steps)."""
    doc = _load(results, "pretrained-quick-cpu.json")
    rows = {}
    for r in doc["summary"]["per_type"]:
        if r["scheme"] == "gift-chosen" and r["after_cold_start"]:
            rows.setdefault(r["model"], {})[r["layer_type"]] = r["ratio"]
    types = ("qkv", "proj", "fc1", "fc2")
    lines = ["| model | " + " | ".join(types) + " |", "|---" * (len(types) + 1) + "|"]
    for model, ratios in sorted(rows.items()):
        lines.append(f"| {model} | " + " | ".join(f"{ratios[t]:.2f}" for t in types) + " |")
    return "\n".join(lines) + "\n"


def training_fp4(results: Path) -> str:
    """``bench training``: per mode the final held-out validation loss, its paired gap to Megatron's BF16
    with the seed spread, and the bytes; then whether each gap is within two seed sd of zero. The coded
    bytes of a flat exchange (error feedback) include the peer on the same node."""
    doc = _load(results, "training-cpu.json")
    bf16 = doc["modes"]["bf16"]
    lines = [
        f"{doc['iters']} iterations, seeds {', '.join(map(str, doc['seeds']))}, {doc['ranks']} gloo ranks as "
        f"{doc['ranks'] // doc['ranks_per_node']} nodes x {doc['ranks_per_node']} ({doc['machine']['cpu_model']}, "
        f"{doc['machine']['cpu_count']} cores)",
        "",
        "| mode | final validation loss (mean ± sd) | gap to bf16, an FP32 reduction here (mean ± sd, paired by "
        "seed) | within 2 sd of 0 | bytes per step per rank | between nodes |",
        "|---|---|---|---|---|---|",
    ]
    for m, v in doc["modes"].items():
        within = doc["targets"].get(m, {}).get("within_2sd_of_zero")
        gap = "-" if m == "bf16" else f"{v['gap_to_bf16']:+.4f} ± {v['gap_sd']:.4f}"
        coded = f"{v['coded_bytes_per_step']:,.0f}" if v["coded_bytes_per_step"] else "(one flat ring)"
        if "--gift-error-feedback" in v["flags"]:  # error feedback keeps the flat exchange
            peers = doc["ranks"] - 1
            coded += f" (flat: to all {peers} peers, {doc['ranks'] - doc['ranks_per_node']} on the other node)"
        lines.append(
            f"| {m} | {v['final_val_mean']:.4f} ± {v['final_val_sd']:.4f} | {gap} | "
            f"{'-' if within is None else ('yes' if within else '**no**')} | "
            f"{v['bytes_per_step']:,.0f} ({v['bytes_per_step'] / bf16['bytes_per_step']:.2f}x BF16) | {coded} |"
        )
    return "\n".join(lines) + "\n"


def fp4_schemes(results: Path) -> str:
    """Per model, FP4 format and scheme: the gradient error over the same format's Euclidean per layer type
    (geometric means; ``bench pretrained`` after the cold start, ``bench fidelity`` on the scratch Llama)."""
    rows = {}  # (model, format, scheme) -> {layer type: ratio}
    for r in _load(results, "pretrained-quick-fp4-cpu.json")["summary"]["per_type"]:
        fmt, _, scheme = r["scheme"].partition(" ")
        if r["after_cold_start"] and fmt in ("nvfp4", "mxfp4") and "@" not in scheme:
            rows.setdefault((r["model"], fmt, scheme), {})[r["layer_type"]] = r["ratio"]
    fid = _load(results, "fidelity-quick-fp4-cpu.json")
    model = f"scratch llama (hidden {fid['config']['model']['hidden']})"
    for r in fid["summary"]["fp4"]:
        rows.setdefault((model, r["format"], r["scheme"]), {})[r["layer_type"]] = r["ratio"]
    types = ("qkv", "proj", "fc1", "fc2")
    # "/wire-damping": T chosen on the four-bit wire's own errors, as the runtime's refresh chooses it; "chosen":
    # --gift-rotation auto's, the rotation on or off per layer by the refresh's errors
    order = ("hadamard", "gift", "gift/wire-damping", "gift+hadamard", "gift+hadamard/wire-damping", "chosen")
    lines = ["| model | format | scheme | " + " | ".join(types) + " |", "|---" * (len(types) + 3) + "|"]
    shown = sorted((m, fmt, order.index(scheme)) for m, fmt, scheme in rows if scheme in order)  # Euclidean: 1
    for m, fmt, k in shown:
        ratios = rows[(m, fmt, order[k])]
        cells = " | ".join(f"{ratios[t]:.2f}" if t in ratios else "-" for t in types)
        lines.append(f"| {m} | {fmt} | {order[k]} | {cells} |")
    return "\n".join(lines) + "\n"


FLAG_ADVICE = {  # docs/flags.md's last column: when to change each flag
    "--gift-mode": "to turn the plugin on: `euclidean`, the recommended mode",
    "--gift-layers": "to restrict FP8 to some layers, or to try `auto`",
    "--gift-euclidean-layers": "to shrink the remaining FP32 traffic (`'.*'`: everything)",
    "--gift-fp8-format": "rarely: E5M2 doubled the error in [benchmarks](benchmarks.md)",
    "--gift-scaling": "to reproduce the paper (`tensor`)",
    "--gift-block-size": "rarely; each block adds a 4-byte FP32 scale ([codec](codec.md))",
    "--gift-error-feedback": "an experiment (extra memory: [memory](memory.md))",
    "--gift-rank": "`gift` only; must not exceed a GIFT layer's input size",
    "--gift-sketch": "`gift` only; >= `--gift-rank`",
    "--gift-refresh-interval": "`gift` only; larger costs less traffic, a staler factor ([fidelity](fidelity.md))",
    "--gift-ema": "`gift` only",
    "--gift-damping": "`gift` only; a number fixes it for every layer",
    "--gift-side": (
        "`gift` only; `both` lowers the error per layer for more refresh bytes and, with the distributed "
        "optimizer, an FP32 all-reduce per bucket and step "
        "([costs](fidelity.md#what-two-sided-whitening-costs))"
    ),
    "--gift-profile-steps": "`auto` only",
    "--gift-profile-interval": "`auto` only; larger costs less ([telemetry](telemetry.md))",
    "--gift-policy-margin": "`auto` only",
    "--gift-policy-hysteresis": "`auto` only",
    "--gift-bf16-bound": "`auto` only",
    "--gift-log-interval": "to watch fidelity during a run ([telemetry](telemetry.md))",
    "--gift-telemetry-dir": "with `--gift-log-interval` and no `--save`",
    "--gift-exchange": "`flat` only to compare; error feedback keeps the flat exchange",
    "--gift-intra-node": "`fp8` only if NVLink is the bottleneck (quantizes twice: +36-38% RelL2 in `bench comm`); "
    "`bf16` to keep each rank's `G T` on the wire with four bits between nodes, where `auto` sums first (the "
    "planner's `-2level-rs-` rows: faster than the BF16 intra-node stage in every run of "
    "`bench/results/model-*-nvfp4.json`; training alike within ten seeds' noise; no GPU has run it)",
    "--gift-inter-node-format": "an experiment: about 5x FP8's error, which GIFT reduces (issue 36)",
    "--gift-rotation": (
        "an experiment: issue 36 measured 0.61x of Euclidean NVFP4's error for GIFT then Hadamard, 0.76x for GIFT alone"
    ),
    "--gift-ranks-per-node": "to simulate nodes on one machine",
    "--gift-schedule": "rarely; the same on every rank (refused otherwise)",
    "--gift-inflight-mb": "to fit memory: one bucket's buffers at a time at the least ([memory](memory.md))",
    "--gift-loopback": (
        "only to measure the plugin's on-GPU cost on one GPU ([gpu check](gpu-check.md)); without it a "
        "group of one keeps Megatron's gradient bit for bit"
    ),
    "--gift-param-gather": "where the parameter all-gather is exposed; needs `--use-distributed-optimizer`",
    "--gift-param-gather-full-every": "rarely: to put the weights back on `bf16(main)` periodically",
    "--gift-allow-untested-megatron": (
        "at your own risk after an upgrade: the plugin re-implements some Megatron methods ([support "
        "matrix](support-matrix.md))"
    ),
}

FLAGS_THAT_MATTER = {  # README.md's short table: flag -> what it does, in a few words
    "--gift-mode": "the linear layers' gradients: Megatron's own, BF16, plain FP8, whitened FP8",
    "--gift-param-gather": "with `--use-distributed-optimizer`: send each shard's change in 1 + 1/32 B per element",
    "--gift-exchange": "two-level exchange (intra-node, then FP8 between nodes) where a node holds several DP ranks",
    "--gift-layers": "which parameters use `--gift-mode`; `auto` picks per layer by measurement",
    "--gift-side": "GIFT: whiten the input side, or both sides of each gradient",
    "--gift-log-interval": "per-layer error, modes and bytes in the log and `gift_telemetry.jsonl`",
}


def _flag_cells(action) -> tuple[str, str, str]:
    """A ``--gift-*`` flag as the tables show it: its spelling with choices or metavar, its default, its help."""
    flag = action.option_strings[0]
    if action.choices:
        spelled = f"{flag} {{{','.join(map(str, action.choices))}}}"
    elif action.nargs == 0:
        spelled = flag
    else:
        spelled = f"{flag} {action.metavar or 'N'}" + ("..." if action.nargs == "+" else "")
    default = action.default
    if isinstance(default, list):
        default = " ".join(default) if default else "none"
    elif default is None or default is False:
        default = "off" if action.nargs == 0 else "none"
    helped = action.help % {"default": default} if action.help else ""
    return spelled.replace("|", "\\|"), str(default).replace("|", "\\|"), helped.replace("|", "\\|")


def flag_tables(results: Path) -> str:
    """docs/flags.md: every ``--gift-*`` flag, one table per concern of ``GiftConfig`` (the argument
    groups of ``add_gift_args``), with its default and help from the parser and when to change it."""
    from megatron_gift.arguments import CONCERNS, concern_groups

    out = []
    for concern, group in concern_groups():
        title, description = CONCERNS[concern]
        out += [f"### {title}", "", f"{description}.", "", "| flag | default | what it does | change it when |"]
        out.append("|---|---|---|---|")
        for action in group._group_actions:
            spelled, default, helped = _flag_cells(action)
            out.append(f"| `{spelled}` | `{default}` | {helped} | {FLAG_ADVICE[action.option_strings[0]]} |")
        out.append("")
    return "\n".join(out)


def flags_that_matter(results: Path) -> str:
    """README.md's short table: the flags a first run needs, spelled and defaulted as the parser has them."""
    from megatron_gift.arguments import concern_groups

    actions = {a.option_strings[0]: a for _, g in concern_groups() for a in g._group_actions}
    out = ["| flag | default | what it does |", "|---|---|---|"]
    for flag, what in FLAGS_THAT_MATTER.items():
        spelled, default, _ = _flag_cells(actions[flag])
        out.append(f"| `{spelled}` | `{default}` | {what} |")
    return "\n".join(out) + "\n"


def path_counts(results: Path) -> str:
    """docs/how-it-works.md: how far one bucket's steady reduction travels (``bench path``)."""
    doc = _load(results, "path-cpu.json")
    rows = [
        f"- {r['reduction']}: {r['functions']} functions in {r['files']} files ({r['calls']} calls, "
        f"{r['file_switches']} file switches), {len(r['types'])} plugin types, "
        f"{len(r['upward_calls'])} calls up a layer"
        for r in doc["rows"]
    ]
    return "\n".join(rows) + "\n"


def memory_table(results: Path, name: str = "memory-cpu.json") -> str:
    """docs/memory.md: ``bench memory``'s table (peak = held, of which the arena, + transient; steady)."""
    from megatron_gift_tools.bench.memory import format_table

    return format_table(_load(results, name)["results"]) + "\n"


def memory_fused(results: Path) -> str:
    """docs/memory.md: the same on the fused kernels' path (Triton's interpreter), ``bench memory --configs``."""
    return memory_table(results, "memory-fused-cpu.json")


def memory_fused_nvfp4(results: Path) -> str:
    """docs/memory.md: the fused path with NVFP4 between nodes, measured on its own (``--configs``)."""
    return memory_table(results, "memory-fused-nvfp4-cpu.json")


def memory_fused_error_feedback(results: Path) -> str:
    """docs/memory.md: the fused path with error feedback, measured on its own (``--configs``)."""
    return memory_table(results, "memory-fused-ef-cpu.json")


def memory_at_scale(results: Path) -> str:
    """docs/memory.md: ``bench memory --at-scale``, the message buffers of a 512M-element bucket at DP 512."""
    doc = _load(results, "memory-at-scale-cpu.json")
    n, stated = doc["spec"]["buckets"], doc["spec"]["stated_mib"]
    out = [
        f"| reduction | collective | B/element | GiB per bucket | {n} buckets in flight, GiB | default arena, GiB | "
        f"`--gift-inflight-mb {stated}`: sub-buckets (largest, GiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        out.append(
            f"| {r['reduction']} | {r['collective']} | {r['footprint_B_per_element']:.3f} | {r['footprint_GiB']:.2f} | "
            f"{r['all_buckets_GiB']:.2f} | {r['arena_GiB']:.2f} | {r['sub_buckets']} ({r['sub_bucket_GiB']:.2f}) |"
        )
    return "\n".join(out) + "\n"


def fp4_meter(results: Path) -> str:
    """docs/two-level-exchange.md: the launch meter's NVFP4 exchange next to the FP8 one (reduce-scatter, 10M
    elements, DP 64, fused path): launches and bytes moved over one fused pass's, per stage."""
    doc = _load(results, "launches-cpu.json")
    recs = {
        (r["path"], r["bucket"]): {s["stage"]: s for s in r["stages"]}
        for r in doc["records"]
        if r["kind"] == "reduction" and r["kernels"] == "fused" and r.get("size") == "10M" and r["dp"] == 64
    }
    out = [
        "| exchange | bucket | stage | FP8: launches, moved / essential | NVFP4: launches, moved / essential |",
        "|---|---|---|---|---|",
    ]

    def cell(s: dict | None) -> str:
        return f"{s['launches']}, {s['ratio'] or '-'}" if s else "-"

    pairs = (
        ("flat-rs", "flat-nvfp4-rs"),
        ("two-level/bf16-rs", "two-level/bf16-nvfp4-rs"),
        (None, "two-level/reduce-scatter-nvfp4-rs"),  # FP4 only (``comm.sum_first``)
    )
    for fp8, fp4 in pairs:
        name = (fp8 or fp4.replace("-nvfp4", "")).removesuffix("-rs")
        for bucket in ("euclidean", "gift"):
            a, b = recs[(fp8, bucket)] if fp8 else {}, recs[(fp4, bucket)]
            for stage in b:
                out.append(f"| {name} | {bucket} | {stage} | {cell(a.get(stage))} | {cell(b[stage])} |")
    return "\n".join(out) + f"\n\n(`{doc['command']}`, {doc['date']})\n"


RENDERERS = {
    **{
        f"planner-summary-{cluster}{'-delta' if delta else ''}": (
            lambda results, cluster=cluster, delta=delta: planner_summary(results, cluster, delta)
        )
        for cluster in SUMMARIES
        for delta in (False, True)
    },
    "fp4-meter": fp4_meter,
    "memory-table": memory_table,
    "memory-at-scale": memory_at_scale,
    "memory-fused": memory_fused,
    "memory-fused-nvfp4": memory_fused_nvfp4,
    "memory-fused-ef": memory_fused_error_feedback,
    "fp4-schemes": fp4_schemes,
    "decision": decision,
    "planner-600m": planner_600m,
    "fidelity-pretrained": fidelity_pretrained,
    "training-fp4": training_fp4,
    "flag-tables": flag_tables,
    "flags-that-matter": flags_that_matter,
    "path-counts": path_counts,
}


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every rendered block rewritten; an unknown block name is an error."""

    def one(m: re.Match) -> str:
        name = m.group(2)
        if name not in RENDERERS:
            raise ValueError(f"unknown rendered block {name!r} (known: {', '.join(RENDERERS)})")
        return m.group(1) + RENDERERS[name](results) + m.group(4)

    return BLOCK.sub(one, text)


def files(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in FILES for p in root.glob(pattern)})


def stale(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """The files whose rendered blocks differ from what the JSONs give."""
    return [str(p.relative_to(root)) for p in files(root) if render(p.read_text(), results) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-gift docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only list the files whose rendered blocks are stale")
    args = parser.parse_args(argv)
    if args.check:
        out = stale()
        print("\n".join(out) if out else "every rendered block is current")
        return 1 if out else 0
    for p in files():
        text = p.read_text()
        new = render(text)
        if new != text:
            p.write_text(new)
            print(f"rendered {p.relative_to(ROOT)}")
    return 0
