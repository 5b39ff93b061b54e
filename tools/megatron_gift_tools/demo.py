"""``megatron-gift demo``: train one small Llama-style Megatron GPTModel four times, once per
gradient-communication mode, and compare loss and bytes on the wire.

Each run is the real launcher (``python -m torch.distributed.run --standalone --nproc-per-node 2
-m megatron_gift.pretrain_gpt --gift-cpu ...``): 2 gloo ranks, distributed optimizer,
``--overlap-grad-reduce``, RMSNorm, SwiGLU, RoPE, no biases, untied embeddings, on the real
corpus written as a Megatron indexed dataset (cached). Data, seeds and every other flag are
identical across the modes:

* ``fp32``: ``--gift-mode off`` (Megatron's own DDP, FP32 ring reduce-scatter);
* ``bf16``: ``--gift-mode bf16 --gift-layers '.*'`` (every gradient in BF16);
* ``euclidean-e4m3``: ``--gift-mode euclidean --gift-euclidean-layers '.*'`` (every gradient plain FP8 E4M3);
* ``gift-e4m3``: ``--gift-mode gift --gift-euclidean-layers '.*'`` (linear weights whitened FP8,
  embeddings, output layer and norms plain FP8), so all three compressed modes send every
  parameter's gradient through the plugin and their bytes compare with FP32's.

Bytes per step: the mean of rank 0's ``megatron-gift: iteration N: gradient reduction sent B
bytes`` lines (``--gift-log-interval 1``; they include GIFT's statistics all-reduce on refresh
steps). Megatron's own reduction prints nothing, so for ``fp32`` the bytes are computed from its
log with the model of :func:`megatron_gift_tools.bench.comm.megatron_ring_bytes`: a ring reduce-scatter
of each gradient bucket sends ``(R-1)/R × 4 bytes × padded bucket elements`` from each rank
(bucket sizes from Megatron's ``Params for bucket k (n elements, m padded size ...)`` lines).

Writes ``metrics.json``, ``report.md``, ``loss_curves.png``, ``bytes_per_step.png`` and the
launcher logs (``logs/<mode>.log``) to the output directory.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megatron_gift.testing import launch

RANKS = 2
MODES = {
    "fp32": ["--gift-mode", "off"],
    "bf16": ["--gift-mode", "bf16", "--gift-layers", ".*"],
    "euclidean-e4m3": ["--gift-mode", "euclidean", "--gift-euclidean-layers", ".*"],
    "gift-e4m3": ["--gift-mode", "gift", "--gift-euclidean-layers", ".*"],
    "gift-auto": ["--gift-mode", "gift", "--gift-layers", "auto", "--gift-euclidean-layers", ".*"],
}
LABELS = {
    "fp32": "FP32",
    "bf16": "BF16",
    "euclidean-e4m3": "Euclidean-E4M3",
    "gift-e4m3": "GIFT-E4M3",
    "gift-auto": "auto (GIFT/Euclidean/BF16 per layer)",
}
FIXED = ("bf16", "euclidean-e4m3", "gift-e4m3")  # the fixed choices gift-auto is compared with, per layer

PRESETS = {
    "quick": dict(
        vocab=2048, layers=2, hidden=64, heads=4, ffn=176, seq=64, micro_batch=2, global_batch=4, iters=20, lr=3e-3
    ),
    "default": dict(
        vocab=2048, layers=4, hidden=128, heads=4, ffn=352, seq=128, micro_batch=4, global_batch=8, iters=100, lr=3e-3
    ),
}

LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([-+0-9.eE]+|nan|inf)")
BYTES_RE = re.compile(r"megatron-gift: iteration (\d+): gradient reduction sent (\d+) bytes from this rank \((.*)\)")
BUCKET_RE = re.compile(r"Params for bucket (\d+) \((\d+) elements, (\d+) padded size")


def model_args(p: dict, seed: int) -> list[str]:
    """Megatron flags of the model and schedule shared by every mode."""
    return [
        "--num-layers",
        str(p["layers"]),
        "--hidden-size",
        str(p["hidden"]),
        "--num-attention-heads",
        str(p["heads"]),
        "--ffn-hidden-size",
        str(p["ffn"]),
        "--seq-length",
        str(p["seq"]),
        "--max-position-embeddings",
        str(p["seq"]),
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--micro-batch-size",
        str(p["micro_batch"]),
        "--global-batch-size",
        str(p["global_batch"]),
        "--train-iters",
        str(p["iters"]),
        "--lr",
        str(p["lr"]),
        "--min-lr",
        str(p["lr"] / 10),
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        str(max(1, p["iters"] // 10)),
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--eval-interval",
        "100000",
        "--split",
        "98,2,0",
        "--seed",
        str(seed),
    ]


def launcher_command(
    p: dict, mode: str, data_args: list[str], cache: Path, seed: int, telemetry: Path | None = None
) -> list[str]:
    """The launcher command of one mode. With ``telemetry`` (the demo) the plugin prints its bytes and writes
    telemetry to that directory every iteration (``--gift-log-interval 1``); without it (step timing, as
    :func:`megatron_gift_tools.planner.validation.validate_cpu`) it does neither."""
    logging = ["--gift-log-interval", "1", "--gift-telemetry-dir", str(telemetry)] if telemetry else []
    return launch.launcher_command(
        RANKS, *model_args(p, seed), *data_args, "--data-cache-path", str(cache), *logging, *MODES[mode]
    )


def per_layer_rel_l2(lines: list[dict], skip: int) -> dict[str, float]:
    """Mean over the logged iterations after the first ``skip`` of each layer's reduced-gradient
    RelL2 (against the FP32 sum), from a run's telemetry lines."""
    sums: dict[str, list[float]] = {}
    for line in lines:
        if line["step"] <= skip:
            continue
        for name, layer in line.get("layers", {}).items():
            if layer.get("rel_l2") is not None:
                sums.setdefault(name, []).append(layer["rel_l2"])
    return {name: sum(v) / len(v) for name, v in sums.items()}


def parse_log(text: str) -> dict:
    """Losses, plugin byte lines and Megatron's bucket sizes from a launcher log."""
    losses = {int(i): float(v) for i, _, v in LOSS_RE.findall(text)}
    sent = {int(i): int(n) for i, n, _ in BYTES_RE.findall(text)}
    details = {int(i): d for i, _, d in BYTES_RE.findall(text)}
    buckets = {int(k): int(padded) for k, _, padded in BUCKET_RE.findall(text)}
    return dict(
        loss_curve=[losses[i] for i in sorted(losses)],
        bytes_lines=[sent[i] for i in sorted(sent)],
        bytes_detail=details[max(details)] if details else None,
        bucket_padded_elements=[buckets[k] for k in sorted(buckets)],
    )


def ring_reduce_scatter_bytes(padded_elements: list[int], ranks: int = RANKS, element_size: int = 4) -> int:
    """Bytes one rank sends in Megatron's ring reduce-scatter of every bucket (as
    ``bench.comm.megatron_ring_bytes``)."""
    return sum((ranks - 1) * n * element_size // ranks for n in padded_elements)


def run_mode(mode: str, cmd: list[str], log_path: Path, iters: int, timeout: float) -> str:
    """Run one launcher command, its output to ``log_path`` and its losses to stderr; return the log."""
    env = {**os.environ, **launch.ENV, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=launch.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        try:
            for line in proc.stdout:
                log.write(line)
                lines.append(line)
                m = LOSS_RE.search(line)
                if m:
                    print(
                        f"[demo] {mode:15s} iteration {int(m.group(1)):4d}/{iters}  loss {float(m.group(3)):.4f}"
                        f"  ({time.time() - t0:.0f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
                if time.time() - t0 > timeout:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    text = "".join(lines)
    if rc != 0:
        raise RuntimeError(f"{mode}: launcher exited with {rc}; last lines of {log_path}:\n{text[-4000:]}")
    return text


def train_mode(mode: str, p: dict, data_args: list[str], out: Path, seed: int, timeout: float) -> tuple[dict, str]:
    """Train one mode through the launcher; return its metrics record and the command it ran."""
    from megatron_gift_tools.report import read_telemetry

    telemetry = out / "telemetry" / mode
    shutil.rmtree(telemetry, ignore_errors=True)  # telemetry appends: start each run afresh
    cmd = launcher_command(p, mode, data_args, out / "index-cache", seed, telemetry)
    command = shlex.join(["OMP_NUM_THREADS=1", *cmd])
    print(f"[demo] {mode}: training {p['iters']} iterations on {RANKS} gloo ranks ...", file=sys.stderr, flush=True)
    t0 = time.time()
    parsed = parse_log(run_mode(mode, cmd, out / "logs" / f"{mode}.log", p["iters"], timeout))
    curve = parsed["loss_curve"]
    if len(curve) != p["iters"]:
        raise RuntimeError(f"{mode}: found {len(curve)} loss lines, expected {p['iters']} (see {out}/logs/{mode}.log)")
    if mode == "fp32":
        if parsed["bytes_lines"]:
            raise RuntimeError("fp32 (--gift-mode off) printed plugin byte lines: GIFT's DDP was used")
        if not parsed["bucket_padded_elements"]:
            raise RuntimeError("fp32: no 'Params for bucket' lines in Megatron's log to count the bytes from")
        bytes_per_step = float(ring_reduce_scatter_bytes(parsed["bucket_padded_elements"]))
        source = "analytic: Megatron ring reduce-scatter, (R-1)/R x 4 B x padded grad-buffer elements"
    else:
        if not parsed["bytes_lines"]:
            raise RuntimeError(f"{mode}: no 'gradient reduction sent' lines in the log")
        bytes_per_step = sum(parsed["bytes_lines"]) / len(parsed["bytes_lines"])
        source = f"measured: mean of {len(parsed['bytes_lines'])} per-iteration plugin lines (rank 0)"
    record = dict(
        label=LABELS[mode],
        flags=MODES[mode],
        final_loss=curve[-1],
        loss_curve=curve,
        bytes_per_step=bytes_per_step,
        bytes_source=source,
        bytes_detail_last=parsed["bytes_detail"],
        grad_buffer_padded_elements=sum(parsed["bucket_padded_elements"]) or None,
        wall_seconds=round(time.time() - t0, 1),
    )
    if mode != "fp32":
        lines = read_telemetry(telemetry)
        record["per_layer_rel_l2"] = per_layer_rel_l2(lines, skip=p["iters"] // 2)
        record["final_layer_modes"] = {k: v["mode"] for k, v in lines[-1]["layers"].items()}
    return record, command


def run(
    quick: bool = False,
    out: str | os.PathLike = "runs/demo",
    preset: dict | None = None,
    seed: int = 1234,
    command: str | None = None,
    timeout: float = 1800,
) -> dict:
    """Train every mode, write the metrics, report and plots to ``out``; return the metrics document."""
    from megatron_gift_tools.bench.corpus import build_token_corpus
    from megatron_gift_tools.bench.indexed_data import megatron_data_args
    from megatron_gift_tools.report import render

    name = "quick" if quick else "default"
    p = dict(PRESETS[name], **(preset or {}))
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    print(f"[demo] building the indexed dataset (vocabulary {p['vocab']}, cached) ...", file=sys.stderr, flush=True)
    data_args = megatron_data_args(build_token_corpus(vocab_size=p["vocab"]))
    modes = {}
    commands = {}
    for mode in MODES:
        modes[mode], commands[mode] = train_mode(mode, p, data_args, out, seed, timeout)
    fp32 = modes["fp32"]
    for m in modes.values():
        m["loss_gap_to_fp32"] = m["final_loss"] - fp32["final_loss"]
        m["bytes_ratio_to_fp32"] = m["bytes_per_step"] / fp32["bytes_per_step"]
    import torch

    doc = dict(
        demo=name,
        command=command or ("megatron-gift demo" + (" --quick" if quick else "") + f" --out {out}"),
        ranks=RANKS,
        seed=seed,
        preset=p,
        launcher_commands=commands,
        machine=dict(
            platform=platform.platform(),
            processor=platform.processor() or platform.machine(),
            cpus=os.cpu_count(),
            python=platform.python_version(),
            torch=torch.__version__,
        ),
        bytes_model="FP8/BF16 modes: rank 0's per-iteration 'gradient reduction sent' lines (everything the plugin "
        "sends, statistics all-reduces on GIFT refresh steps included), averaged; the last iteration is not "
        "reported (iteration k's line is printed when k+1 starts). FP32 (--gift-mode off): Megatron's ring "
        "reduce-scatter of each bucket, (R-1)/R x 4 bytes x padded bucket elements, as bench.comm.megatron_ring_bytes.",
        per_layer_rel_l2_note=f"mean over iterations {p['iters'] // 2 + 1}-{p['iters'] - 1} of each layer's reduced "
        "gradient RelL2 against the FP32 sum of the same local gradients (telemetry, --gift-log-interval 1; "
        "the last iteration is still open when training ends)",
        auto=auto_summary(modes),
        wall_seconds=round(time.time() - t_start, 1),
        modes=modes,
    )
    doc["auto_report"] = {
        k: str(v.relative_to(out)) for k, v in render(out / "telemetry" / "gift-auto", out / "auto").items()
    }
    (out / "metrics.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_plots(doc, out)
    (out / "report.md").write_text(format_report(doc))
    print(f"[demo] done in {doc['wall_seconds']:.0f}s; wrote {out}/report.md, metrics.json, *.png", file=sys.stderr)
    return doc


def auto_summary(modes: dict) -> dict:
    """Per candidate layer of ``gift-auto``: its RelL2 against the best fixed choice's, and its final mode."""
    auto = modes["gift-auto"]["per_layer_rel_l2"]
    layers = {}
    for name in sorted(modes["gift-e4m3"]["per_layer_rel_l2"]):
        if not name.endswith(".weight") or name not in auto or "linear_" not in name:
            continue
        fixed = {m: modes[m]["per_layer_rel_l2"].get(name) for m in FIXED}
        best = min((m for m in FIXED if m != "bf16" and fixed[m] is not None), key=lambda m: fixed[m])
        layers[name] = dict(
            auto=auto[name],
            **fixed,
            best_fp8=best,
            ratio_to_best_fp8=auto[name] / fixed[best],
            auto_mode=modes["gift-auto"]["final_layer_modes"][name],
        )
    within = sum(v["ratio_to_best_fp8"] <= 1.05 for v in layers.values())
    return dict(layers=layers, within_5_percent=within, candidates=len(layers))


def write_plots(doc: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = doc["modes"]
    p = doc["preset"]
    colors = {
        "fp32": "black",
        "bf16": "tab:blue",
        "euclidean-e4m3": "tab:orange",
        "gift-e4m3": "tab:green",
        "gift-auto": "tab:red",
    }
    styles = {"fp32": "-", "bf16": "--", "euclidean-e4m3": "-.", "gift-e4m3": ":", "gift-auto": (0, (1, 1))}
    paths = []

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), dpi=110, sharex=True, gridspec_kw=dict(height_ratios=[3, 1.4]))
    base = modes["fp32"]["loss_curve"]
    for name, m in modes.items():
        its = range(1, len(m["loss_curve"]) + 1)
        ax.plot(
            its,
            m["loss_curve"],
            linestyle=styles[name],
            color=colors[name],
            lw=1.6,
            label=f"{m['label']} ({m['final_loss']:.3f})",
        )
        dx.plot(its, [a - b for a, b in zip(m["loss_curve"], base)], linestyle=styles[name], color=colors[name], lw=1.4)
    ax.set_ylabel("training loss (lm loss)")
    ax.set_title(
        f"Loss: {p['layers']}-layer Llama, hidden {p['hidden']}, seq {p['seq']}, {doc['ranks']} ranks "
        f"(final in legend)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    dx.set_xlabel("iteration")
    dx.set_ylabel("loss - FP32 loss")
    dx.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "loss_curves.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    names = list(modes)
    kib = [modes[n]["bytes_per_step"] / 1024 for n in names]
    # wrapped labels: the long ones ("auto (GIFT/Euclidean/BF16 per layer)") overlapped their neighbours
    labels = [textwrap.fill(modes[n]["label"], 16, break_long_words=False) for n in names]
    bars = ax.bar(labels, kib, color=[colors[n] for n in names])
    ax.tick_params(axis="x", labelsize=8)
    for bar, n in zip(bars, names):
        ax.annotate(
            f"{kib[names.index(n)]:,.0f} KiB\n{modes[n]['bytes_ratio_to_fp32']:.3f}x",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_ylabel("KiB sent per step per rank")
    ax.set_ylim(0, max(kib) * 1.2)
    ax.set_title("Gradient-reduction bytes per step per rank (ratio to FP32)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out / "bytes_per_step.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    layers = doc["auto"]["layers"]
    names = list(layers)
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(names) + 1.6), dpi=110)
    shown = ("bf16", "euclidean-e4m3", "gift-e4m3", "gift-auto")
    height = 0.8 / len(shown)
    for k, m in enumerate(shown):
        values = [layers[n]["auto" if m == "gift-auto" else m] for n in names]
        ax.barh(
            [i + (k - 1.5) * height for i in range(len(names))],
            values,
            height,
            color=colors[m],
            label=modes[m]["label"],
        )
    ax.set_yticks(
        range(len(names)), [n.replace("decoder.layers.", "").replace(".weight", "") for n in names], fontsize=8
    )
    ax.invert_yaxis()
    ax.set_xscale("log")
    # a decade below the smallest value: on a log axis bars start at the left limit, and BF16's (an order
    # of magnitude under FP8's) looked like zero against it
    smallest = min(layers[n]["auto" if m == "gift-auto" else m] for n in names for m in shown)
    ax.set_xlim(left=smallest / 10)
    ax.set_xlabel("reduced-gradient RelL2 vs FP32 sum (mean over the second half; log scale)")
    ax.set_title("Per-layer fidelity of the gradient reduction", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # outside: it hid bars
    fig.tight_layout()
    paths.append(out / "per_layer_rel_l2.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


def format_table(doc: dict) -> str:
    head = "| mode | final loss | gap to FP32 | bytes/step/rank | vs FP32 |\n|---|---|---|---|---|"
    rows = [
        f"| {m['label']} | {m['final_loss']:.4f} | {m['loss_gap_to_fp32']:+.4f} | {m['bytes_per_step']:,.0f} | "
        f"{m['bytes_ratio_to_fp32']:.3f} |"
        for m in doc["modes"].values()
    ]
    return "\n".join([head, *rows]) + "\n"


def format_layer_table(doc: dict) -> str:
    head = "| layer | BF16 | Euclidean | GIFT | auto | auto's mode | auto / best FP8 |\n|---|---|---|---|---|---|---|"
    rows = [
        f"| {name} | {v['bf16']:.4f} | {v['euclidean-e4m3']:.4f} | {v['gift-e4m3']:.4f} | {v['auto']:.4f} | "
        f"{v['auto_mode']} | {v['ratio_to_best_fp8']:.3f} |"
        for name, v in doc["auto"]["layers"].items()
    ]
    return "\n".join([head, *rows]) + "\n"


def format_report(doc: dict) -> str:
    p = doc["preset"]
    mach = doc["machine"]
    lines = [
        f"# megatron-gift demo ({doc['demo']})",
        "",
        f"`{doc['command']}` on {mach['platform']} ({mach['cpus']} CPUs, torch {mach['torch']}), "
        f"{doc['wall_seconds']:.0f} s in all.",
        "",
        f"Megatron-Core GPTModel, Llama-style (RMSNorm, SwiGLU, RoPE, no biases, untied embeddings): "
        f"{p['layers']} layers, hidden {p['hidden']}, {p['heads']} heads, FFN {p['ffn']}, sequence {p['seq']}, "
        f"vocabulary {p['vocab']}; {p['iters']} iterations, global batch {p['global_batch']} "
        f"(micro-batch {p['micro_batch']}), {doc['ranks']} gloo ranks, distributed optimizer, "
        f"`--overlap-grad-reduce`, seed {doc['seed']}, the same data in every mode.",
        "",
        format_table(doc),
        "Modes: FP32 = `--gift-mode off` (Megatron's own DDP); BF16 = `--gift-mode bf16 --gift-layers '.*'`; "
        "Euclidean-E4M3 = `--gift-mode euclidean --gift-euclidean-layers '.*'`; GIFT-E4M3 = `--gift-mode gift "
        "--gift-euclidean-layers '.*'` (linear weights whitened, embeddings/output layer/norms plain FP8); auto = "
        "`--gift-mode gift --gift-layers auto --gift-euclidean-layers '.*'` (each linear weight GIFT, Euclidean or "
        "BF16 as its profiles decide). Every gradient goes through the plugin in the compressed modes, so their "
        "bytes compare with FP32's.",
        "",
        "Bytes: " + doc["bytes_model"],
        "",
        "Per-layer RelL2 of the reduced gradients: " + doc["per_layer_rel_l2_note"] + ". `auto` "
        "(`--gift-layers auto`) against the better fixed FP8 choice for each layer: "
        f"{doc['auto']['within_5_percent']} of {doc['auto']['candidates']} layers within 5%.",
        "",
        format_layer_table(doc),
        "![per-layer RelL2](per_layer_rel_l2.png)",
        "",
        "`--gift-layers auto`'s decisions: [auto/report.md](auto/report.md) (from `megatron-gift report "
        "telemetry/gift-auto --out auto`).",
        "",
        "![mode timeline](auto/mode_timeline.png)",
        "",
        "Last iteration's byte breakdown per mode:",
        "",
        *[f"- {m['label']}: {m['bytes_detail_last'] or m['bytes_source']}" for m in doc["modes"].values()],
        "",
        "![loss curves](loss_curves.png)",
        "",
        "![bytes per step](bytes_per_step.png)",
        "",
        "Launcher logs: `logs/<mode>.log`; full numbers and command lines: `metrics.json`.",
        "",
    ]
    return "\n".join(lines)
