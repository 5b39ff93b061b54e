"""Fidelity benchmark: error of an FP8 data-parallel gradient sum, Euclidean vs GIFT.

A small Llama-style model trains on the Python-docs corpus. At each measurement point a
fixed held-out batch is split over ``R`` simulated ranks; each rank's FP32 weight gradient
``G_r`` of every transformer linear layer is encoded on its own and the decoded messages are
summed in FP32 (what ``megatron_gift.comm`` does)::

    bf16        Σ_r bf16(G_r)
    euclid-*    Σ_r dec(enc(G_r))
    gift-*      (Σ_r dec(enc(G_r·T))) · T⁻¹        T identical on every rank

    rel_l2 = ‖approx − Σ_r G_r‖ / ‖Σ_r G_r‖,   cos = cosine(approx, Σ_r G_r)

Scheme names: ``bf16``; ``euclid-<fmt>-<scaling>[-shared]``; ``gift-r<r>-<fmt>-<scaling>[-shared]``
(low-rank-plus-diagonal whitening, ``LowRankWhitening``); ``gift-dense-r<r>-…`` (the paper's
dense Cholesky transform of the same Â). ``-shared``: one per-tensor scale from the maximum
over all ranks (the paper's baseline); otherwise every rank scales its own groups.
Each scheme is measured twice: ``tokens_per_rank`` = ``seqs_per_rank·seq_len``, and
``accumulation``× that (gradient accumulation; the rank's gradient is the mean over all its
tokens, as summing equal micro-batches and dividing gives).

K-FAC factor: ``A = XᵀX/n`` of the layer's inputs over the last ``kfac_batches`` *training*
batches before the point (``KFACStatistics``), so A never sees the held-out tokens whose
gradients are measured, and lags the weights by at most ``kfac_batches`` steps.

Geometry (``numerics.geometry``) is computed on the stack of per-rank gradients, since those
are what get quantized: ``p`` = share of tr(A) in its top-r eigenvalues, ``q`` = share of
Σ_r‖G_r‖² in that subspace, predicted GIFT/Euclidean RelL2 ratio
``shares: sqrt(ρq/p + (1−ρ)(1−q)/(1−p))`` with ``ρ = r/d_in`` and
``model: sqrt(Σ_r‖G_r T‖² · tr(Â)/d_in / Σ_r‖G_r‖²)``; next to them the measured ratio
``rel_l2(gift-r…-c) / rel_l2(euclid-c)`` for every codec ``c``. Geometry records are kept for the
low-rank ranks only: the dense transform of the same Â has the same predictions.

The JSON schema is :data:`SCHEMA` (also written into the file).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gift.bench.corpus import TokenCorpus, build_token_corpus
from megatron_gift.bench.llama import (
    LlamaConfig,
    LlamaModel,
    Trainer,
    capture_inputs,
    layer_type,
    linear_layers,
    per_shard_grads,
)
from megatron_gift.numerics import (
    CodecConfig,
    DenseCholeskyWhitening,
    FP8Format,
    KFACStatistics,
    LowRankWhitening,
    Scaling,
    approximate_factor,
    geometry_stats,
    roundtrip,
)

LAYER_TYPES = ("qkv", "proj", "fc1", "fc2")

SCHEMA = {
    "results": "one record per (step, layer, tokens_per_rank, scheme): step, layer, layer_type, scheme, "
    "tokens_per_rank, rel_l2, cos; gift schemes add ratio_vs_euclid (rel_l2 / rel_l2 of euclid with the same codec)",
    "schemes": "scheme name -> family (bf16|euclid|gift|gift-dense), codec (fmt-scaling[-shared]), fmt, "
    "scaling, shared, gift_rank",
    "geometry": "one record per (step, layer, tokens_per_rank, gift_rank): d_in, trace_share_top_r (p), "
    "grad_energy_share_top_r (q over the per-rank gradients), grad_energy_share_top_r_sum (q of Σ_r G_r), "
    "predicted_ratio_shares, predicted_ratio_model, measured_ratio {codec: gift/euclid rel_l2}",
    "points": "per measurement step: train_loss (mean over the K-FAC batches), heldout_loss, seconds",
    "summary": "rel_l2_geomean (per tokens_per_rank, scheme, layer_type; 'all' = every layer), "
    "ratio_by_layer_type (geomeans of predicted and measured ratios), prediction_fit (per codec: Pearson "
    "correlation of log predicted vs log measured ratio over all geometry records, median measured/predicted)",
}


@dataclass(frozen=True)
class FidelityConfig:
    """What to train and measure. ``points`` are cumulative training steps."""

    model: LlamaConfig
    points: tuple[int, ...]
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    seqs_per_rank: int = 2
    accumulation: int = 4
    kfac_batches: int = 4
    gift_ranks: tuple[int, ...] = (8, 16, 32)
    dense_rank: int = 32
    damping: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        steps = (0, *self.points)
        if self.kfac_batches < 1 or any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"need kfac_batches >= 1 and increasing positive points: {self.kfac_batches}, {self.points}")


QUICK = FidelityConfig(model=LlamaConfig(hidden=128, layers=2, heads=2, ffn_hidden=344, seq_len=64), points=(40, 120))
FULL = FidelityConfig(
    model=LlamaConfig(hidden=256, layers=3, heads=4, ffn_hidden=688, seq_len=64),
    points=(50, 200, 400),
    kfac_batches=8,
)


@dataclass(frozen=True)
class Scheme:
    """How one layer's gradient is communicated: ``family`` bf16/euclid/gift/gift-dense, codec, rank."""

    family: str
    codec: CodecConfig | None = None
    shared: bool = False
    rank: int = 0

    @property
    def codec_name(self) -> str:
        return self.codec.name + ("-shared" if self.shared else "")

    @property
    def name(self) -> str:
        if self.family == "bf16":
            return "bf16"
        if self.family == "euclid":
            return f"euclid-{self.codec_name}"
        return f"{self.family}-r{self.rank}-{self.codec_name}"

    def describe(self) -> dict:
        """The scheme's parts, for the JSON ``schemes`` table."""
        if self.codec is None:
            return {"family": self.family}
        return {
            "family": self.family,
            "codec": self.codec_name,
            "fmt": self.codec.fmt.value,
            "scaling": self.codec.scaling.value,
            "shared": self.shared,
            "gift_rank": self.rank or None,
        }


CODECS = [(CodecConfig(FP8Format.E5M2, Scaling.TENSOR), True)] + [
    (CodecConfig(fmt, scaling), False) for fmt in (FP8Format.E5M2, FP8Format.E4M3) for scaling in Scaling
]
"""(codec, shared): the paper's baseline, then both formats at every granularity (1x128 blocks)."""


def schemes(cfg: FidelityConfig) -> list[Scheme]:
    """Every scheme measured, in table order."""
    out = [Scheme("bf16")] + [Scheme("euclid", c, s) for c, s in CODECS]
    out += [Scheme("gift", c, s, r) for r in cfg.gift_ranks for c, s in CODECS]
    return out + [Scheme("gift-dense", c, s, cfg.dense_rank) for c, s in CODECS]


# --------------------------------------------------------------------------- measurement


def _log(msg: str) -> None:
    print(f"[fidelity] {msg}", file=sys.stderr, flush=True)


def quantized_sum(stack: torch.Tensor, codec: CodecConfig, shared: bool) -> torch.Tensor:
    """``Σ_r dec(enc(G_r))`` in FP32, rank order; ``shared``: one scale from the max over ranks."""
    amax = stack.abs().amax().reshape(1, 1) if shared else None
    total = torch.zeros_like(stack[0])
    for g in stack:
        total += roundtrip(g, codec, amax=amax)
    return total


def errors(approx: torch.Tensor, truth: torch.Tensor) -> dict:
    """``rel_l2`` and ``cos`` of ``approx`` against ``truth``, in FP64."""
    a, t = approx.double().flatten(), truth.double().flatten()
    return {"rel_l2": float((a - t).norm() / t.norm()), "cos": float(a @ t / (a.norm() * t.norm()))}


def _fp8_record(scheme: Scheme, stack: torch.Tensor, truth: torch.Tensor, transform=None) -> dict:
    total = quantized_sum(stack, scheme.codec, scheme.shared)
    approx = total if transform is None else transform.inverse(total)
    return {"scheme": scheme.name, **errors(approx, truth)}


def _transforms(a: torch.Tensor, cfg: FidelityConfig):
    """``(family, rank, factor, whitening)`` for every GIFT variant, built from the factor ``a``."""
    for r in cfg.gift_ranks:
        factor = approximate_factor(a, r, cfg.damping)
        yield "gift", r, factor, LowRankWhitening(factor)
    factor = approximate_factor(a, cfg.dense_rank, cfg.damping)
    yield "gift-dense", cfg.dense_rank, factor, DenseCholeskyWhitening(factor)


def _geometry(stack: torch.Tensor, truth: torch.Tensor, factor, whitening) -> dict:
    per_rank = geometry_stats(stack.reshape(-1, stack.shape[-1]), factor, whitening)
    return {
        **dataclasses.asdict(per_rank),
        "grad_energy_share_top_r_sum": geometry_stats(truth, factor, whitening).grad_energy_share_top_r,
    }


def measure_layer(stack: torch.Tensor, a: torch.Tensor, cfg: FidelityConfig) -> tuple[list[dict], list[dict]]:
    """Result records of every scheme and geometry records of every low-rank GIFT rank for one
    layer's per-rank gradients ``stack [R, d_out, d_in]`` and K-FAC factor ``a [d_in, d_in]``."""
    truth = stack.sum(0)
    results = [{"scheme": "bf16", **errors(stack.bfloat16().float().sum(0), truth)}]
    euclid = {}
    for codec, shared in CODECS:
        scheme = Scheme("euclid", codec, shared)
        results.append(_fp8_record(scheme, stack, truth))
        euclid[scheme.codec_name] = results[-1]["rel_l2"]
    geometry = []
    for family, rank, factor, whitening in _transforms(a, cfg):
        whitened = whitening.apply(stack)
        measured = {}
        for codec, shared in CODECS:
            scheme = Scheme(family, codec, shared, rank)
            rec = _fp8_record(scheme, whitened, truth, whitening)
            rec["ratio_vs_euclid"] = measured[scheme.codec_name] = rec["rel_l2"] / euclid[scheme.codec_name]
            results.append(rec)
        if family == "gift":
            geo = _geometry(stack, truth, factor, whitening)
            geometry.append({"gift_rank": rank, "d_in": stack.shape[-1], **geo, "measured_ratio": measured})
    return results, geometry


# --------------------------------------------------------------------------- training


def _train_to(trainer: Trainer, model: LlamaModel, step: int, kfac_batches: int) -> tuple[dict[str, torch.Tensor], float]:
    """Train up to ``step``; the last ``kfac_batches`` batches feed the K-FAC factors.

    Returns the factor ``A`` of every linear layer and the mean loss of those batches.
    """
    trainer.run(max(0, step - trainer.step - kfac_batches))
    layers = linear_layers(model)
    stats = {name: KFACStatistics(m.in_features) for name, m in layers.items()}
    losses = []
    for _ in range(step - trainer.step):
        with capture_inputs(model, layers) as acts:
            losses += trainer.run(1)
        for name, x in acts.items():
            stats[name].accumulate(x)
    for s in stats.values():
        s.fold(ema=0.0)  # the plain mean of the K-FAC batches
    return {name: s.factor for name, s in stats.items()}, statistics.fmean(losses)


def _heldout_batches(corpus: TokenCorpus, cfg: FidelityConfig, ranks: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches, by tokens per rank: ``seqs_per_rank`` and ``accumulation``× that per rank."""
    seq = cfg.model.seq_len
    out = {}
    for i, k in enumerate((1, cfg.accumulation)):
        seqs = cfg.seqs_per_rank * k
        out[seqs * seq] = next(corpus.batches(seq, ranks * seqs, seed=cfg.seed + 1 + i, split="heldout"))
    return out


def _measure_point(model, factors, batches, ranks, cfg, step) -> tuple[list[dict], list[dict], float]:
    """Records of every layer at every held-out batch size, and the held-out loss of the first batch."""
    results, geometry, heldout_loss = [], [], float("nan")
    for tokens, (x, y) in batches.items():
        shards = per_shard_grads(model, x, y, shards=ranks)
        if math.isnan(heldout_loss):
            heldout_loss = statistics.fmean(s.loss for s in shards)
        for name in factors:
            stack = torch.stack([s.grads[name] for s in shards])
            res, geo = measure_layer(stack, factors[name], cfg)
            key = {"step": step, "layer": name, "layer_type": layer_type(name), "tokens_per_rank": tokens}
            results += [{**key, **r} for r in res]
            geometry += [{**key, **g} for g in geo]
        _log(f"step {step}: measured {len(factors)} layers at {tokens} tokens/rank")
    return results, geometry, heldout_loss


# --------------------------------------------------------------------------- summary


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def _pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation; None where it is undefined (fewer than 3 points or a constant side)."""
    return statistics.correlation(xs, ys) if len(xs) > 2 and len(set(xs)) > 1 and len(set(ys)) > 1 else None


def _rel_l2_geomean(results: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for r in results:
        for lt in (r["layer_type"], "all"):
            groups[(r["tokens_per_rank"], r["scheme"], lt)].append(r["rel_l2"])
    return [
        {"tokens_per_rank": t, "scheme": s, "layer_type": lt, "rel_l2": _geomean(v)} for (t, s, lt), v in groups.items()
    ]


def _ratio_by_layer_type(geometry: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for g in geometry:
        groups[(g["tokens_per_rank"], g["gift_rank"], g["layer_type"])].append(g)
    out = []
    for (tokens, rank, lt), gs in groups.items():
        codecs = gs[0]["measured_ratio"]
        out.append(
            {
                "tokens_per_rank": tokens,
                "gift_rank": rank,
                "layer_type": lt,
                "trace_share_top_r": statistics.fmean(g["trace_share_top_r"] for g in gs),
                "grad_energy_share_top_r": statistics.fmean(g["grad_energy_share_top_r"] for g in gs),
                "predicted_ratio_shares": _geomean(g["predicted_ratio_shares"] for g in gs),
                "predicted_ratio_model": _geomean(g["predicted_ratio_model"] for g in gs),
                "measured_ratio": {c: _geomean(g["measured_ratio"][c] for g in gs) for c in codecs},
            }
        )
    return out


def _prediction_fit(geometry: list[dict]) -> list[dict]:
    out = []
    for codec in geometry[0]["measured_ratio"] if geometry else ():
        row = {"codec": codec}
        for kind in ("model", "shares"):
            pred = [math.log(g[f"predicted_ratio_{kind}"]) for g in geometry]
            meas = [math.log(g["measured_ratio"][codec]) for g in geometry]
            row[f"corr_log_{kind}"] = _pearson(pred, meas)
            row[f"median_measured_over_{kind}"] = math.exp(statistics.median(m - p for m, p in zip(meas, pred)))
        out.append(row)
    return out


def summarize(results: list[dict], geometry: list[dict]) -> dict:
    """Aggregates over layers and steps; the printed tables are rendered from these alone."""
    return {
        "rel_l2_geomean": _rel_l2_geomean(results),
        "ratio_by_layer_type": _ratio_by_layer_type(geometry),
        "prediction_fit": _prediction_fit(geometry),
    }


# --------------------------------------------------------------------------- tables

RATIO_CODECS = ("e5m2-tensor-shared", "e4m3-tensor", "e4m3-row", "e4m3-block", "e4m3-mx")
"""Codecs whose measured GIFT/Euclidean ratio is printed (the JSON holds all of them)."""


def _md_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else "–" if v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows])


def _rel_l2_tables(summary: dict, order: list[str]) -> list[str]:
    cols = [*LAYER_TYPES, "all"]
    cell = {(r["tokens_per_rank"], r["scheme"], r["layer_type"]): r["rel_l2"] for r in summary["rel_l2_geomean"]}
    tables = []
    for tokens in sorted({t for t, _, _ in cell}):
        rows = [[s, *(cell.get((tokens, s, c), float("nan")) for c in cols)] for s in order]
        title = f"RelL2 (geometric mean over layers and steps), {tokens} tokens/rank"
        tables.append(f"{title}\n\n" + _md_table(["scheme", *cols], rows))
    return tables


def _ratio_table(summary: dict) -> str:
    header = ["tokens/rank", "r", "layer", "p (trace)", "q (grad)", "pred shares", "pred model"]
    header += [f"meas {c}" for c in RATIO_CODECS]
    keys = ("tokens_per_rank", "gift_rank", "layer_type", "trace_share_top_r", "grad_energy_share_top_r")
    keys += ("predicted_ratio_shares", "predicted_ratio_model")
    recs = sorted(
        summary["ratio_by_layer_type"],
        key=lambda r: (r["tokens_per_rank"], r["gift_rank"], LAYER_TYPES.index(r["layer_type"])),
    )
    rows = [[*(r[k] for k in keys), *(r["measured_ratio"][c] for c in RATIO_CODECS)] for r in recs]
    title = "GIFT/Euclidean RelL2 ratio, predicted vs measured (geometric means)"
    return f"{title}\n\n" + _md_table(header, rows)


def _fit_table(summary: dict) -> str:
    header = ["codec", "corr log (model)", "median meas/model", "corr log (shares)", "median meas/shares"]
    keys = ("codec", "corr_log_model", "median_measured_over_model", "corr_log_shares", "median_measured_over_shares")
    rows = [[f[k] for k in keys] for f in summary["prediction_fit"]]
    return "Prediction fit over every (step, layer, tokens/rank, r)\n\n" + _md_table(header, rows)


def format_tables(report: dict) -> str:
    """Markdown tables of ``report['summary']``: RelL2 per scheme and layer type, predicted vs
    measured GIFT/Euclidean ratios per layer type, and how well the prediction fits."""
    summary = report["summary"]
    parts = [*_rel_l2_tables(summary, list(report["schemes"])), _ratio_table(summary), _fit_table(summary)]
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------- driver


def machine() -> dict:
    """Platform, CPU model and count, torch version and threads."""
    models = [line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo") if line.startswith("model name")]
    return {
        "platform": platform.platform(),
        "cpu_model": models[0] if models else platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _rounded(obj):
    """``obj`` with every float rounded to 6 significant digits, to keep the JSON small."""
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_rounded(v) for v in obj]
    return obj


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def run(
    quick: bool = False,
    json_path: str | os.PathLike | None = None,
    ranks: int = 8,
    config: FidelityConfig | None = None,
    command: str | None = None,
    threads: int | None = 1,
) -> dict:
    """Train, measure every point, summarize; write the report to ``json_path`` if given.

    ``config`` overrides the ``QUICK``/``FULL`` preset chosen by ``quick``. ``threads`` sets
    torch's intra-op threads for the run (restored after; None keeps the current setting):
    1 by default because the measurement is thousands of small ops, for which thread
    hand-offs cost more than they gain, ruinously so on a shared machine.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        return _run(quick, json_path, ranks, config or (QUICK if quick else FULL), command)
    finally:
        torch.set_num_threads(previous)


def _run(quick: bool, json_path, ranks: int, cfg: FidelityConfig, command: str | None) -> dict:
    t0 = time.perf_counter()
    corpus = build_token_corpus(vocab_size=cfg.model.vocab_size)
    model = LlamaModel(cfg.model, seed=cfg.seed)
    trainer = Trainer(model, corpus, lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed, warmup_steps=cfg.warmup_steps)
    batches = _heldout_batches(corpus, cfg, ranks)
    results, geometry, points = [], [], []
    for step in cfg.points:
        t = time.perf_counter()
        factors, train_loss = _train_to(trainer, model, step, cfg.kfac_batches)
        _log(f"step {step}: train loss {train_loss:.3f} ({time.perf_counter() - t:.1f}s)")
        res, geo, heldout_loss = _measure_point(model, factors, batches, ranks, cfg, step)
        results += res
        geometry += geo
        seconds = time.perf_counter() - t
        points.append({"step": step, "train_loss": train_loss, "heldout_loss": heldout_loss, "seconds": seconds})
    report = {
        "benchmark": "fidelity",
        "schema": SCHEMA,
        "command": command or " ".join(sys.argv),
        "machine": machine(),
        "config": {**dataclasses.asdict(cfg), "ranks": ranks, "quick": quick, "codec_block": CodecConfig().block},
        "corpus": corpus.manifest,
        "schemes": {s.name: s.describe() for s in schemes(cfg)},
        "points": points,
        "results": results,
        "geometry": geometry,
        "summary": summarize(results, geometry),
        "wall_seconds": time.perf_counter() - t0,
    }
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(_rounded(report), separators=(",", ":")) + "\n")
        _log(f"wrote {json_path}")
    return report
