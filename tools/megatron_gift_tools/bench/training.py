"""``megatron-gift bench training``: does a four-bit inter-node exchange train like BF16?

The demo's small Llama (its quick preset, FFN 192 so every linear row is whole 64-element Hadamard
blocks) trained through the real launcher (``python -m megatron_gift.pretrain_gpt --gift-cpu``) on 4
gloo ranks as 2 simulated nodes x 2 (``--gift-ranks-per-node 2``: the two-level exchange, BF16 inside
a node, or a plain reduce-scatter there for ``-sum-first``, the chosen format between nodes), distributed
optimizer, ``--overlap-grad-reduce``, once per gradient-communication mode and seed. Every run gets the
same flags, data and padding (``--ddp-pad-buckets-for-high-nccl-busbw``: shards on whole four-bit blocks);
only the mode's flags differ. The baseline is Megatron's own reduce-scatter with its BF16 flag (``--gift-mode off
--grad-reduce-in-bf16``); the demo's parameters are FP32, whose gradient buffers Megatron keeps in FP32 whatever
that flag says, so these runs reduce in FP32 there, at least as accurately as a BF16 ring (its bytes are a BF16
ring's, what it would send with BF16 parameters).

Quality: the validation loss on held-out text (Megatron's ``--split 98,2,0`` validation documents) at
the end of training; per mode its gap to the baseline on the same seed (same data, same initialisation), the
mean and the standard deviation of that paired gap over seeds. Bytes: rank 0's
``gradient reduction sent`` lines (per link class); BF16's from Megatron's bucket sizes, as the demo.

Writes ``--json`` (``iters``, ``seeds``, per mode ``final_val_loss``, ``gap_to_bf16``, ``gap_sd``,
bytes, curves), a loss-curve plot next to it, and each run's log and record under ``--out``
(a record already there is reused, not rerun: an interrupted run resumes). ``--reuse JSON`` takes the
runs of an earlier JSON of this benchmark (same iterations, seeds and mode flags) for every mode not
named by ``--rerun``; the JSON written names them under ``reused``, with the command and machine that ran them.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from megatron_gift_tools import demo

RANKS, PER_NODE = 4, 2
EUCLID = ["--gift-mode", "euclidean", "--gift-euclidean-layers", ".*"]
GIFT = ["--gift-mode", "gift", "--gift-euclidean-layers", ".*"]
FOUR = ["--gift-inter-node-format", "nvfp4"]
NVFP4 = FOUR + ["--gift-intra-node", "bf16"]  # the per-rank path, BF16 in the node (auto sums first there)
HADAMARD = ["--gift-rotation", "hadamard"]
# name (format-scheme) -> flags; the linear weights are GIFT's layers, every other parameter Euclidean.
# ``-sum-first``: the node's gradients summed by a plain reduce-scatter, ``T``, ``H`` and FP4 on the sums;
# ``-fp32-intra``: each rank's ``G T`` summed in FP32 inside the node, the same sums to FP32 rounding (the
# control that tells the sum-first path's numerics from the BF16 intra-node wire's).
# Error feedback (on Euclidean NVFP4, the scheme with the largest error) keeps one flat exchange: its
# residual is per rank and bucket, so that mode's FP4 messages cross all four ranks.
MODES = {
    "bf16": ["--gift-mode", "off", "--grad-reduce-in-bf16"],
    "fp8-euclidean": EUCLID,
    "fp8-gift": GIFT,
    "nvfp4-euclidean": EUCLID + NVFP4,
    "nvfp4-hadamard": EUCLID + NVFP4 + HADAMARD,
    "nvfp4-gift": GIFT + NVFP4,
    "nvfp4-gift+hadamard": GIFT + NVFP4 + HADAMARD,
    "nvfp4-gift+hadamard-sum-first": GIFT + FOUR + HADAMARD + ["--gift-intra-node", "reduce-scatter"],
    "nvfp4-gift+hadamard-fp32-intra": GIFT + FOUR + HADAMARD + ["--gift-intra-node", "fp32"],
    "nvfp4-euclidean+ef": EUCLID + FOUR + ["--gift-error-feedback"],
}
PRESET = dict(demo.PRESETS["quick"], ffn=192, global_batch=8, iters=1000)
QUICK = dict(iters=10, seeds=[1234])
VAL_RE = re.compile(
    r"validation loss at (?:iteration\s+(\d+)|the end of training for val data)\s*\|"
    r"\s*lm loss value: ([-+0-9.eE]+|nan|inf)"
)


def flags(p: dict, seed: int, mode: str, telemetry: Path) -> list[str]:
    """Megatron and plugin flags of one run (everything but the data paths); the plugin's modes log
    their bytes ten times a run, their telemetry to ``telemetry``."""
    args = demo.model_args(p, seed)
    at = args.index("--eval-iters")
    evals = max(1, p["iters"] // 5)
    args[at : at + 4] = ["--eval-iters", str(p["eval_iters"]), "--eval-interval", str(evals)]
    log = max(1, p["iters"] // 10)
    plugin = [
        "--gift-ranks-per-node",
        str(PER_NODE),
        "--gift-log-interval",
        str(log),
        "--gift-telemetry-dir",
        str(telemetry),
    ]
    return [
        *args,
        "--ddp-pad-buckets-for-high-nccl-busbw",
        *(plugin if mode != "bf16" else []),
        *MODES[mode],
    ]


def parse(text: str, mode: str, iters: int) -> dict:
    """Train and validation losses and bytes per step of one run's log."""
    parsed = demo.parse_log(text)
    val = [(int(i) if i else iters + 1, float(v)) for i, v in VAL_RE.findall(text)]
    if len(parsed["loss_curve"]) != iters or not val:
        raise RuntimeError(f"{mode}: {len(parsed['loss_curve'])} of {iters} loss lines, {len(val)} validation lines")
    if mode == "bf16":
        sent = demo.ring_reduce_scatter_bytes(parsed["bucket_padded_elements"], RANKS, element_size=2)
        detail = {"ring": sent}
    else:
        sent = statistics.fmean(parsed["bytes_lines"])
        detail = dict(kv.rsplit(" ", 1) for kv in parsed["bytes_detail"].split(", "))
        detail = {k: int(v) for k, v in detail.items()}
    return dict(
        train_loss=parsed["loss_curve"], val_curve=val, final_val_loss=val[-1][1], bytes_per_step=sent, bytes=detail
    )


def train(mode: str, seed: int, p: dict, data_args: list[str], out: Path, timeout: float) -> dict:
    """One launcher run (or its record from an earlier run under ``out``, refused if it names another CPU
    model: ``reuse``)."""
    from megatron_gift_tools.bench.fidelity import machine

    record_path, here = out / f"{mode}-s{seed}.json", machine()["cpu_model"]
    if record_path.exists():
        rec = json.loads(record_path.read_text())
        if rec.get("cpu_model", here) != here:
            raise SystemExit(f"bench training: {record_path} ran on {rec['cpu_model']!r}, this CPU is {here!r}")
        return rec
    from megatron_gift.testing import launch

    cmd = launch.launcher_command(
        RANKS,
        *flags(p, seed, mode, out / "telemetry" / f"{mode}-s{seed}"),
        *data_args,
        "--data-cache-path",
        str(out / "cache"),
    )
    t0 = time.time()
    text = demo.run_mode(f"{mode} s{seed}", cmd, out / "logs" / f"{mode}-s{seed}.log", p["iters"], timeout)
    rec = dict(mode=mode, seed=seed, command=shlex.join(["OMP_NUM_THREADS=1", *cmd]), **parse(text, mode, p["iters"]))
    rec["wall_seconds"], rec["cpu_model"] = round(time.time() - t0, 1), here
    record_path.write_text(json.dumps(rec) + "\n")
    return rec


def reuse(path: str, rerun: list[str], p: dict, seeds: list[int], modes: list[str], out: Path) -> dict:
    """Seed ``out`` with the per-seed records of ``path`` (an earlier JSON of this benchmark) for each of
    ``modes`` it holds with the same flags, not in ``rerun``; refuses another preset, other seeds, or runs made
    on another CPU model (FP32 rounding differs between them: a seed's runs would not pair).
    Per seed it keeps the losses, curves and wall time; bytes per step are the earlier mean (bytes
    do not depend on the seed). Returns ``{mode: where it came from}``."""
    from megatron_gift_tools.bench.fidelity import machine

    doc = json.loads(Path(path).read_text())
    if doc["iters"] != p["iters"] or doc["seeds"] != seeds or doc["preset"] != p:
        raise SystemExit(f"bench training: {path} ran another preset or seeds; its runs cannot be reused")
    ran = {m.get("cpu_model") for m in [doc["machine"], *(r["machine"] for r in (doc.get("reused") or {}).values())]}
    here = machine()["cpu_model"]
    if ran != {here}:  # a seed pairs the modes' runs only where they round alike
        raise SystemExit(
            f"bench training: {path}'s runs ran on {sorted(map(str, ran))}, this CPU is {here!r}: FP32 rounding "
            "differs between CPU models, so runs of one seed would not pair; rerun them here (--rerun) or reuse there"
        )
    taken = {}
    for m in modes:
        v = doc["modes"].get(m)
        if m in rerun or v is None or v["flags"] != MODES[m]:
            continue
        for i, s in enumerate(seeds):
            record = dict(
                mode=m,
                seed=s,
                command=f"reused from {path}",
                train_loss=v["train_loss_curves"][i],
                val_curve=v["val_curves"][i],
                final_val_loss=v["final_val_loss"][i],
                bytes_per_step=v["bytes_per_step"],
                bytes=v["bytes_detail"],
                wall_seconds=v["wall_seconds"][i],
                cpu_model=here,
            )
            (out / f"{m}-s{s}.json").write_text(json.dumps(record) + "\n")
        taken[m] = dict(source=path, command=doc["command"], machine=doc["machine"])
    return taken


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def aggregate(records: list[dict], seeds: list[int], modes: list[str]) -> dict:
    """Per mode: final validation losses, the paired gap to the baseline (mean, sd over seeds), bytes."""
    by = {(r["mode"], r["seed"]): r for r in records}
    out = {}
    for m in modes:
        finals = [by[m, s]["final_val_loss"] for s in seeds]
        gaps = [by[m, s]["final_val_loss"] - by["bf16", s]["final_val_loss"] for s in seeds]
        fmt, _, scheme = m.partition("-")
        out[m] = dict(
            format=fmt,
            scheme=scheme or "megatron",
            flags=MODES[m],
            final_val_loss=finals,
            final_val_mean=statistics.fmean(finals),
            final_val_sd=_sd(finals),
            gap_to_bf16=statistics.fmean(gaps),
            gap_sd=_sd(gaps),
            gaps=gaps,
            bytes_per_step=statistics.fmean(by[m, s]["bytes_per_step"] for s in seeds),
            bytes_detail=by[m, seeds[0]]["bytes"],
            coded_bytes_per_step=sum(v for k, v in by[m, seeds[0]]["bytes"].items() if "+scales" in k),
            train_loss_last50_mean=statistics.fmean(statistics.fmean(by[m, s]["train_loss"][-50:]) for s in seeds),
            val_curves=[by[m, s]["val_curve"] for s in seeds],
            train_loss_curves=[by[m, s]["train_loss"] for s in seeds],
            wall_seconds=[by[m, s]["wall_seconds"] for s in seeds],
        )
    return out


def reduction_error(out: Path, mode: str, seeds: list[int], iters: int) -> dict | None:
    """The reduction's error as the runs' telemetry logged it (``rel_l2`` of each coded layer's reduced gradient
    against its FP32 reduction, every logging step from a tenth of the run on): the geometric mean over seeds,
    steps and layers, per layer mode (``gift``, ``euclidean``); None where a seed's telemetry is missing (runs
    reused from an earlier JSON, BF16). Tells a loss gap from a larger error per step."""
    logs = {}
    for s in seeds:
        path = out / "telemetry" / f"{mode}-s{s}" / "gift_telemetry.jsonl"
        if not path.exists():
            return None
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["step"] >= iters // 10:
                for layer in rec["layers"].values():
                    if layer.get("rel_l2"):
                        logs.setdefault(layer["mode"], []).append(math.log(layer["rel_l2"]))
    return {k: round(math.exp(statistics.fmean(v)), 5) for k, v in sorted(logs.items())} or None


def verdicts(agg: dict) -> dict:
    """The issue's targets, each as the numbers it compares: a gap within two seed sd of zero, and
    GIFT + Hadamard NVFP4's gap at most Euclidean FP8's plus that noise."""
    res = {}
    for m, v in agg.items():
        if m != "bf16" and not math.isnan(v["gap_sd"]):
            res[m] = dict(within_2sd_of_zero=abs(v["gap_to_bf16"]) <= 2 * v["gap_sd"])
    g, e = agg.get("nvfp4-gift+hadamard"), agg.get("fp8-euclidean")
    if g and e and not math.isnan(g["gap_sd"]):
        res["nvfp4-gift+hadamard"]["le_fp8_euclidean_plus_noise"] = g["gap_to_bf16"] <= e["gap_to_bf16"] + 2 * max(
            g["gap_sd"], e["gap_sd"]
        )
    return res


def format_table(doc: dict) -> str:
    """Markdown table of the modes."""
    head = (
        "| mode | final val loss (mean) | sd | gap to BF16 | gap sd | bytes/step/rank | vs BF16 | coded |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    bf = doc["modes"]["bf16"]["bytes_per_step"]
    rows = [
        f"| {m} | {v['final_val_mean']:.4f} | {v['final_val_sd']:.4f} | {v['gap_to_bf16']:+.4f} | {v['gap_sd']:.4f} "
        f"| {v['bytes_per_step']:.0f} | {v['bytes_per_step'] / bf:.3f} | {v['coded_bytes_per_step']:.0f} |"
        for m, v in doc["modes"].items()
    ]
    return f"{doc['iters']} iterations, seeds {doc['seeds']}\n\n" + head + "\n".join(rows) + "\n"


def plot(doc: dict, path: Path) -> None:
    """Train loss (mean over seeds, smoothed) and validation loss per mode; and each mode's gap to BF16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for m, v in doc["modes"].items():
        curves = v["train_loss_curves"]
        mean = [statistics.fmean(c[i] for c in curves) for i in range(len(curves[0]))]
        k = max(1, len(mean) // 50)
        smooth = [statistics.fmean(mean[max(0, i - k) : i + 1]) for i in range(len(mean))]
        (line,) = ax.plot(range(1, len(mean) + 1), smooth, lw=1.2, label=m)
        pts = v["val_curves"][0]
        xs = [i for i, _ in pts]
        ys = [statistics.fmean(c[j][1] for c in v["val_curves"]) for j in range(len(pts))]
        ax.plot(xs, ys, "o", color=line.get_color(), ms=4)
    ax.set(xlabel="iteration", ylabel="loss (lines: train, smoothed; dots: validation)", title="mean over seeds")
    ax.legend(fontsize=8)
    names = [m for m in doc["modes"] if m != "bf16"]
    gaps = [doc["modes"][m]["gap_to_bf16"] for m in names]
    sds = [0 if math.isnan(doc["modes"][m]["gap_sd"]) else doc["modes"][m]["gap_sd"] for m in names]
    bx.bar(range(len(names)), gaps, yerr=[2 * s for s in sds], capsize=4, color="tab:blue")
    bx.axhline(0, color="k", lw=0.8)
    bx.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    bx.set(ylabel="final validation loss - bf16's (error bars: 2 sd over seeds)", title="gap to the bf16 baseline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    quick: bool = False,
    json_path: str | None = None,
    out: str = "runs/training",
    seeds: list[int] | None = None,
    iters: int | None = None,
    modes: list[str] | None = None,
    command: str | None = None,
    timeout: float = 3600,
    reuse_from: str | None = None,
    rerun: list[str] | None = None,
) -> dict:
    """Train every mode for every seed (seed by seed; ``reuse_from``: an earlier JSON's runs of the modes
    not in ``rerun``), aggregate, write the JSON and the plot."""
    from megatron_gift_tools.bench.corpus import build_token_corpus
    from megatron_gift_tools.bench.fidelity import machine
    from megatron_gift_tools.bench.indexed_data import megatron_data_args

    modes = modes or list(MODES)
    if "bf16" not in modes:
        modes = ["bf16", *modes]
    unknown = sorted((set(modes) | set(rerun or [])) - set(MODES))
    if unknown:
        raise SystemExit(f"bench training: unknown mode(s) {unknown}; choose from {list(MODES)}")
    p = dict(PRESET, eval_iters=20)
    if quick:
        p.update(iters=QUICK["iters"], eval_iters=2)
    if iters:
        p["iters"] = iters
    seeds = seeds or (QUICK["seeds"] if quick else [1234, 1, 2])
    out_dir = Path(out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    reused = reuse(reuse_from, rerun or [], p, seeds, modes, out_dir) if reuse_from else {}
    data_args = megatron_data_args(build_token_corpus(vocab_size=p["vocab"]))
    records = [train(m, s, p, data_args, out_dir, timeout) for s in seeds for m in modes]
    agg = aggregate(records, seeds, modes)
    for m in modes:
        agg[m]["reduction_rel_l2"] = reduction_error(out_dir, m, seeds, p["iters"]) if m != "bf16" else None
    doc = dict(
        benchmark="training",
        command=command or "megatron-gift bench training",
        machine=machine(),
        iters=p["iters"],
        seeds=seeds,
        ranks=RANKS,
        ranks_per_node=PER_NODE,
        preset=p,
        baseline="bf16: Megatron's own reduce-scatter (--gift-mode off --grad-reduce-in-bf16), in FP32 on these "
        "runs: the demo's parameters are FP32, whose gradient buffers stay FP32 whatever that flag says; its bytes "
        "are a BF16 ring's",
        final_val_loss_note=f"Megatron's end-of-training validation loss, {p['eval_iters']} batches of "
        f"{p['global_batch']} held-out sequences of {p['seq']} tokens (the same for every mode of a seed)",
        gap_note="gap_to_bf16: mean over seeds of (mode - bf16) on the same seed; gap_sd: their standard deviation",
        reduction_rel_l2_note="per layer mode, the geometric mean over seeds, logging steps from iters/10 on and "
        "layers of the telemetry's rel_l2 (reduced gradient against its FP32 reduction); null without telemetry",
        reused=reused,
        modes=agg,
        targets=verdicts(agg),
    )
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        plot(doc, path.with_suffix(".png"))
    print(format_table(doc), end="")
    return doc


if __name__ == "__main__":  # the command is ``megatron-gift bench training``; this runs its defaults
    os.environ.setdefault("NO_VCS_VERSION", "1")
    run(quick="--quick" in sys.argv)
