"""Training evidence over seeds: the CPU demo (``megatron_gift_tools.demo``) run once per seed, its loss
curves and per-layer reduced-gradient RelL2 (second half of the run) aggregated.

For each of the 16 transformer linear layers: the mean over seeds of the RelL2 of BF16,
Euclidean-E4M3, GIFT-E4M3 (fixed) and auto, GIFT / Euclidean, and auto / the better fixed FP8
choice (Euclidean or GIFT); the counts behind the targets (GIFT <= 0.8x Euclidean, auto within 5%).

``python -m megatron_gift_tools.bench.training_evidence --seeds 1234 1 2 --out DIR --json PATH
[--iters N] [--reuse]`` (``--reuse``: aggregate the ``DIR/s<seed>/metrics.json`` already there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from megatron_gift_tools import demo
from megatron_gift_tools.bench.fidelity import _md_table, machine

LINEAR = (".linear_qkv.", ".linear_proj.", ".linear_fc1.", ".linear_fc2.")


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def aggregate(docs: list[dict]) -> dict:
    """Loss and per-layer summaries over the seeds' demo metrics documents."""
    modes = list(docs[0]["modes"])
    loss = {}
    for m in modes:
        finals = [d["modes"][m]["final_loss"] for d in docs]
        tails = [statistics.fmean(d["modes"][m]["loss_curve"][-10:]) for d in docs]
        gaps = [t - statistics.fmean(d["modes"]["fp32"]["loss_curve"][-10:]) for t, d in zip(tails, docs)]
        loss[m] = dict(
            final_mean=statistics.fmean(finals),
            final_sd=_sd(finals),
            last10_mean=statistics.fmean(tails),
            last10_gap_to_fp32=statistics.fmean(gaps),
            last10_gap_sd=_sd(gaps),
            bytes_per_step=statistics.fmean(d["modes"][m]["bytes_per_step"] for d in docs),
        )
    names = sorted(n for n in docs[0]["modes"]["gift-e4m3"]["per_layer_rel_l2"] if any(k in n for k in LINEAR))
    layers = []
    for n in names:
        rel = {
            m: statistics.fmean(d["modes"][m]["per_layer_rel_l2"][n] for d in docs)
            for m in ("bf16", "euclidean-e4m3", "gift-e4m3", "gift-auto")
        }
        best = min(rel["euclidean-e4m3"], rel["gift-e4m3"])
        auto_modes = sorted({d["modes"]["gift-auto"]["final_layer_modes"][n] for d in docs})
        layers.append(
            dict(
                layer=n,
                **rel,
                gift_over_euclid=rel["gift-e4m3"] / rel["euclidean-e4m3"],
                auto_over_best_fixed=rel["gift-auto"] / best,
                auto_final_modes=auto_modes,
            )
        )
    return dict(
        seeds=[d["seed"] for d in docs],
        iters=len(docs[0]["modes"]["fp32"]["loss_curve"]),
        loss=loss,
        layers=layers,
        gift_le_0p8_euclid=sum(r["gift_over_euclid"] <= 0.8 for r in layers),
        auto_within_5pct=sum(r["auto_over_best_fixed"] <= 1.05 for r in layers),
        n_layers=len(layers),
    )


def format_tables(agg: dict) -> str:
    rows = [
        [
            demo.LABELS[m],
            v["final_mean"],
            v["final_sd"],
            v["last10_mean"],
            v["last10_gap_to_fp32"],
            v["last10_gap_sd"],
            round(v["bytes_per_step"]),
        ]
        for m, v in agg["loss"].items()
    ]
    head = ["mode", "final loss (mean)", "sd", "last-10 mean", "gap to FP32", "gap sd", "bytes/step/rank"]
    out = [f"Loss over seeds {agg['seeds']} ({agg['iters']} iterations)\n\n" + _md_table(head, rows)]
    rows = [
        [
            r["layer"].removeprefix("decoder.layers.").removesuffix(".weight"),
            r["bf16"],
            r["euclidean-e4m3"],
            r["gift-e4m3"],
            r["gift-auto"],
            r["gift_over_euclid"],
            r["auto_over_best_fixed"],
            "/".join(r["auto_final_modes"]),
        ]
        for r in agg["layers"]
    ]
    head = ["layer", "BF16", "Euclidean", "GIFT", "auto", "GIFT / Eucl.", "auto / best fixed FP8", "auto's final mode"]
    out.append(
        f"Per-layer reduced-gradient RelL2, second half, mean over seeds: GIFT <= 0.8x Euclidean on "
        f"{agg['gift_le_0p8_euclid']} of {agg['n_layers']} layers, auto within 5% of the better fixed FP8 choice on "
        f"{agg['auto_within_5pct']} of {agg['n_layers']}\n\n" + _md_table(head, rows)
    )
    return "\n\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_gift_tools.bench.training_evidence", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    ap.add_argument("--out", default="runs/training-evidence")
    ap.add_argument("--json", required=True)
    ap.add_argument("--iters", type=int, default=None, help="iterations (default: the demo's default preset)")
    ap.add_argument("--reuse", action="store_true", help="aggregate existing OUT/s<seed>/metrics.json")
    args = ap.parse_args(argv)
    preset = {"iters": args.iters} if args.iters else None
    docs = []
    for seed in args.seeds:
        path = Path(args.out) / f"s{seed}"
        if not args.reuse:
            demo.run(out=path, seed=seed, preset=preset)
        docs.append(json.loads((path / "metrics.json").read_text()))
    agg = aggregate(docs)
    cmd = "python -m megatron_gift_tools.bench.training_evidence " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    doc = {
        "benchmark": "training-evidence",
        "command": cmd,
        "machine": machine(),
        **agg,
        "loss_curves": {m: [d["modes"][m]["loss_curve"] for d in docs] for m in docs[0]["modes"]},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
    print(format_tables(agg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
