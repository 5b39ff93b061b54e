"""Markdown output of the planner: one table per configuration with a verdict per scheme, a
summary row per configuration, the sensitivity, the byte check and the CPU validation."""

from __future__ import annotations

from megatron_gift_tools.planner import memory
from megatron_gift_tools.planner.plan import BREAK_EVEN_RANGE, MIN_GAIN_PCT
from megatron_gift_tools.planner.schemes import BASE, Scheme
from megatron_gift_tools.planner.workloads import Workload


def label(r: dict) -> str:
    """A row's name: its scheme, the intra-node dtype of two-level exchanges, GIFT's sides unless the input side
    alone, the delta gather if used."""
    name = Scheme(r["mode"]).label + (f" (intra {r['intra_dtype']})" if r["intra_dtype"] else "")
    name += f" (--gift-side {r['gift_side']})" if r.get("gift_side") not in (None, "input") else ""
    return name + (" + delta gather" if r["param_gather"] == "delta" else "")


def break_even_text(r: dict, assumed: float, source: str = "assumed") -> str:
    """The all-to-all NIC efficiency (relative to a ring's) at which a plugin row equals the best BF16 option."""
    if "break_even_a2a_nic_ratio" not in r:
        return "; no all-to-all through a NIC"
    v = r["break_even_a2a_nic_ratio"]
    if v is None:
        return "; slower than BF16 however efficient its all-to-all: no break-even"
    if v <= BREAK_EVEN_RANGE[0]:
        return "; faster than BF16 at any all-to-all efficiency"
    return f"; breaks even at an all-to-all NIC efficiency of {v:.2f}x the ring's ({source}: {assumed:.2f}x)"


def advice(pct: float, gain: float) -> str:
    """The advice for a plugin row ``pct``% against stock BF16 and ``gain``% against the best BF16 option, in words
    that agree with both numbers (a faster row under the threshold is not called "no gain")."""
    if gain <= -MIN_GAIN_PCT:
        return "use it"
    if gain < 0:
        threshold = f"under the {MIN_GAIN_PCT:g}% threshold: keep the best BF16 option"
        return f"{-gain:.1f}% faster than the best BF16 option, {threshold}"
    if pct < 0:
        return "its gain is the delta gather's alone: use BF16 ring + delta gather"
    return "slower than BF16: keep BF16"


def verdict(r: dict, p: dict | None = None, source: str = "assumed") -> str:
    """One line per row: its change against the BF16 baseline, the other plugin schedule's, the break-even and
    the advice; an FP8 row is advised only if it beats the best BF16 option (with this run's gather too)."""
    pct = r["vs_bf16_pct"]
    gain = r.get("vs_best_bf16_pct", pct)
    line = f"{label(r)}: {pct:+.1f}% step time vs BF16"
    if gain != pct:
        line += f" ({gain:+.1f}% vs BF16 ring + delta gather)"
    fp4 = Scheme(r["mode"]).inter_format and gain <= -MIN_GAIN_PCT
    line += ": a gain, but FP4 has not run on a GPU yet" if fp4 else f": {advice(pct, gain)}"
    if p is not None and "other_schedule_vs_bf16_pct" in r:
        line += f" ({p['other_schedule']}: {r['other_schedule_vs_bf16_pct']:+.1f}%"
        line += break_even_text(r, p["a2a_nic_ratio"], source) + ")"
    return line


def _bucket(size: int | None) -> str:
    return "Megatron's default bucket size" if size is None else f"--ddp-bucket-size {size}"


def baseline_line(p: dict) -> str:
    """The two BF16 baselines and which one the verdicts use."""
    return (
        f"BF16 baseline (stock Megatron: BF16 ring, BF16 gather): {1e3 * p['bf16_default_step_s']:.1f} ms at "
        f"{_bucket(p['bf16_bucket_size'])}, {1e3 * p['bf16_tuned_step_s']:.1f} ms at its best, "
        f"{_bucket(p['bf16_tuned_bucket_size'])}; every change below is against the better, "
        f"{1e3 * p['baseline_s']:.1f} ms"
    )


def format_model(w: Workload) -> str:
    """The model and its parameter count (every TP shard and pipeline stage)."""
    heads = f"{w.heads} heads" + (f" in {w.kv_heads} key-value groups" if w.kv_heads != w.heads else "")
    return (
        f"{w.name}: {w.total_parameters() / 1e9:.2f}B parameters ({w.layers} layers, hidden {w.hidden}, {heads}, "
        f"FFN {w.ffn}, vocabulary {w.vocab}, sequence {w.seq}; {'untied' if w.untied else 'tied'} embeddings)\n"
    )


def format_costs(costs, opts) -> str:
    """Where each stage's cost comes from: the kernel costs, the meter's JSON (and its date) every GPU stage's
    launches and moved bytes come from, the delta gather's stream."""
    k = opts.delta_kernels
    delta = (
        f"; delta gather: decode on the {k.stream.value} stream, {k.decode_bytes:g} B per element essential"
        if opts.param_gather.value == "delta"
        else ""
    )
    counts = (
        "launches and moved/essential bytes of every GPU stage (reduction and delta gather) from the meter: "
        f"{costs.meter.describe()} (per stage: first_bucket_gpu_stages in --json)"
        if costs.meter is not None
        else "one launch and the essential bytes per GPU stage (no meter)"
    )
    grads = (
        "; gradient buffers of the plugin's rows BF16 (--grad-reduce-in-bf16, as the BF16 ring's): a BF16 "
        "reduce-scatter inside the node where summed first, GPU stages priced from the meter's FP32 buckets (an "
        "upper bound)"
        if opts.grad_reduce_in_bf16
        else ""
    )
    return f"stage costs: {counts}; priced at {costs.source}{delta}{grads}\n"


def _is_reference(r: dict) -> bool:
    return r["mode"] == "bf16" and r["param_gather"] == "bf16"


def config_line(p: dict, w: Workload) -> str:
    r = p["rows"][0]
    return (
        f"{w.name} (tp {w.tp}, pp {w.pp}, micro-batch {w.micro_batch}, seq {w.seq}, global batch {w.global_batch}) "
        f"on {p['gpus']} GPUs of {p['cluster']}: {r['dp']} data-parallel ranks = {r['ranks_per_node']} per node x "
        f"{r['nodes']} nodes, {r['micro_batches']} micro-batch{'es' if r['micro_batches'] > 1 else ''}, "
        f"{r['schedule']} schedule, --gift-schedule {r['gift_schedule']}, parameter gather {r['param_gather']}"
    )


def format_plan(p: dict, w: Workload, source: str = "assumed") -> str:
    """Markdown table of one configuration's rows, then the verdict lines."""
    other = p["other_schedule"]
    lines = [
        config_line(p, w),
        baseline_line(p),
        "",
        f"| mode | bucket (count) | step ms | vs BF16 | vs FP32 | {other} vs BF16 | compute ms | "
        "grad reduce exposed ms | param gather exposed ms | plugin GPU ms | GIFT refresh ms | "
        "NVLink MB/rank | NIC MB/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in p["rows"]:
        lag = f"{r['other_schedule_vs_bf16_pct']:+.1f}%" if "other_schedule_vs_bf16_pct" in r else "="
        size = "default" if r["bucket_size"] is None else f"{r['bucket_size'] / 1e6:.0f}M"
        lines.append(
            f"| {label(r)} | {size} ({r['buckets']}) | {1e3 * r['step_s']:.1f} | {r['vs_bf16_pct']:+.1f}% | "
            f"{r['vs_fp32_pct']:+.1f}% | {lag} | {1e3 * r['compute_s']:.1f} | {1e3 * r['grad_exposed_s']:.1f} | "
            f"{1e3 * r['param_gather_exposed_s']:.1f} | {1e3 * r['plugin_s']:.1f} | {1e3 * r['refresh_s']:.1f} | "
            f"{r['nvlink_bytes_per_rank'] / 1e6:.0f} | {r['nic_bytes_per_rank'] / 1e6:.0f} |"
        )
    warn = memory.warning(p["memory"], p["rows"][0]["schedule"] == "overlap") if "memory" in p else None
    lines += [
        "",
        *(verdict(r, p, source) for r in p["rows"] if not _is_reference(r)),
        f"recommended: {recommended_line(p)}",
        *([warn] if warn else []),
        "",
    ]
    return "\n".join(lines) + "\n"


def recommended_row(p: dict) -> dict | None:
    """The recommended row (None: stock Megatron, BF16 ring and BF16 gather)."""
    if p["recommended"] == "bf16" and p["recommended_param_gather"] == "bf16":
        return None
    return next(r for r in p["rows"] if r["mode"] == p["recommended"])


def recommended(p: dict) -> str:
    r = recommended_row(p)
    if r is not None:
        return label(r)
    size = p["recommended_bucket_size"]
    return "BF16 ring (Megatron as it is" + ("" if size is None else f", --ddp-bucket-size {size}") + ")"


def launcher_flags(p: dict) -> list[str]:
    """The flags that turn stock Megatron (BF16 ring, BF16 gather, its default bucket size) into the recommended
    row: Megatron's (distributed optimizer and overlap for the overlap schedule, BF16 gradient reduction, bucket
    size) and the plugin's (``megatron_gift.arguments``); empty: nothing to change."""
    r, size = recommended_row(p), p["recommended_bucket_size"]
    bucket = [] if size is None else ["--ddp-bucket-size", str(size)]
    if r is None:
        return bucket
    flags = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    flags = flags if r["schedule"] == "overlap" else []
    scheme = Scheme(r["mode"])
    if scheme is Scheme.BF16:
        flags.append("--grad-reduce-in-bf16")
    else:
        flags += ["--gift-mode", scheme.mode.value, "--gift-exchange", "auto" if scheme.two_level else "flat"]
        flags += ["--gift-intra-node", r["intra_dtype"]] if r["intra_dtype"] not in (None, "bf16") else []
        flags += ["--gift-side", r["gift_side"]] if r.get("gift_side") not in (None, "input") else []
        flags += ["--gift-schedule", r["gift_schedule"]]
        flags += ["--grad-reduce-in-bf16"] if r.get("grad_reduce_in_bf16") else []
    if r["param_gather"] == "delta":
        flags += ["--gift-param-gather", "delta"]
    return flags + bucket


def recommended_line(p: dict) -> str:
    """The ``recommended:`` line: the row, its change against stock BF16 and the flags to add."""
    flags = " ".join(launcher_flags(p))
    r = recommended_row(p)
    if r is None:
        return "none: keep stock Megatron" + (f" with {flags}" if flags else "")
    return f"{label(r)} ({r['vs_bf16_pct']:+.1f}%): add {flags}"


def format_summary(plans: list[dict]) -> str:
    """One row per configuration: each scheme against stock BF16 and the recommendation (never slower)."""
    delta = any(r["param_gather"] == "delta" for r in plans[0]["rows"])
    names = [Scheme(r["mode"]) for r in plans[0]["rows"] if r["mode"] != "bf16" or delta]  # BF16 + delta: a row
    lines = [
        "| model | GPUs | TP | DP per node x nodes | BF16 ms (default bucket) | BF16 ms (best bucket) | "
        + " | ".join(s.label + (" summed first" if s.sum_first else "") + (" + delta" if delta else "") for s in names)
        + " | recommended |",
        "|---|---|---|---|---|---|" + "---|" * (len(names) + 1),
    ]
    for p in plans:
        by = {r["mode"]: r for r in p["rows"]}
        rec = recommended_row(p)
        gain = "" if rec is None else f" ({rec['vs_bf16_pct']:+.1f}%)"
        lines.append(
            f"| {p['model']} | {p['gpus']} | {p['tp']} | {by['bf16']['ranks_per_node']} x {by['bf16']['nodes']} | "
            f"{1e3 * p['bf16_default_step_s']:.1f} | {1e3 * p['bf16_tuned_step_s']:.1f} | "
            + " | ".join(f"{by[s.value]['vs_bf16_pct']:+.1f}%" for s in names)
            + f" | {recommended(p)}{gain} |"
        )
    return "\n".join(lines) + "\n"


def format_sensitivity(rows: list[dict], gpus: int) -> str:
    delta = any(r["bf16_vs_bf16_pct"] for r in rows)  # BF16 with the delta gather is a row of its own
    names = [s for s in BASE if s is not Scheme.BF16 or delta]
    lines = [
        f"Sensitivity at {gpus} GPUs (change vs the BF16 baseline; one parameter moved from the defaults)\n",
        "| parameter | BF16 step ms | " + " | ".join(s.label for s in names) + " | recommended |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    for r in rows:
        name = "defaults" if r["value"] is None else f"{r['field']}={r['value']:g}"
        rec = Scheme(r["recommended"]).label + (" + delta gather" if r["recommended_param_gather"] == "delta" else "")
        lines.append(
            f"| {name} | {1e3 * r['bf16_step_s']:.1f} | "
            + " | ".join(f"{r[f'{s.value}_vs_bf16_pct']:+.1f}%" for s in names)
            + f" | {rec} |"
        )
    return "\n".join(lines) + "\n"


def format_bytes_check(rows: list[dict], links: list[dict]) -> str:
    lines = [
        "Gradient bytes per step per rank, model vs `bench comm` (measured); a refresh's statistics all-reduce (the "
        "records' all-gather, sent as the step closes, is after bench comm's ledger read)\n",
        "| ranks | dist. opt. | mode | measured | model | model/measured | refresh statistics model/measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        refresh = f"{r['refresh_ratio']:.3f}" if r["refresh_ratio"] is not None else "-"
        lines.append(
            f"| {r['ranks']} | {'on' if r['distributed_optimizer'] else 'off'} | {r['mode']} | {r['measured']:,} | "
            f"{r['predicted']:,} | {r['ratio']:.4f} | {refresh} |"
        )
    if links:
        lines += [
            "",
            "Gradient bytes per rank by link on simulated nodes, model / `bench comm` ledger\n",
            "| nodes x ranks | dist. opt. | mode | intra dtype | NVLink (intra) | NIC (inter) |",
            "|---|---|---|---|---|---|",
        ]
        for r in links:
            intra = "-" if r["intra_ratio"] is None else f"{r['intra_ratio']:.4f}"
            lines.append(
                f"| {r['nodes']}x{r['ranks_per_node']} | {'on' if r['distributed_optimizer'] else 'off'} | "
                f"{r['mode']} | {r['intra_node'] or '-'} | {intra} | {r['inter_ratio']:.4f}"
                f"{' (ring vs direct sends)' if r['ring_vs_direct'] else ''} |"
            )
    return "\n".join(lines) + "\n"


def format_validation(v: dict) -> str:
    fits = v["gloo"]["fits"]
    lines = [
        f"CPU step time, model vs measured (demo model, {v['preset']['iters']} iterations, 2 gloo ranks; gloo ring "
        f"α {1e3 * fits['ring']['alpha_s']:.2f} ms, {fits['ring']['bandwidth'] / 1e9:.2f} GB/s; all-to-all "
        f"α {1e3 * fits['all_to_all']['alpha_s']:.2f} ms, {fits['all_to_all']['bandwidth'] / 1e9:.2f} GB/s; "
        f"compute calibrated on FP32: {1e3 * v['compute_s_calibrated']:.1f} ms)\n",
        "| mode | measured ms | model ms | error | model: comm exposed ms | plugin ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in v["rows"]:
        p = r["prediction"]
        lines.append(
            f"| {r['mode']} | {1e3 * r['measured_s']:.1f} | {1e3 * r['predicted_s']:.1f} | {r['error_pct']:+.1f}% | "
            f"{1e3 * (p['grad_exposed_s'] + p['param_gather_exposed_s']):.1f} | {1e3 * p['plugin_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"
