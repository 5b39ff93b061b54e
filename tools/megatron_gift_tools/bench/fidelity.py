"""Fidelity benchmark: error of an FP8 data-parallel gradient sum, Euclidean vs GIFT as it ships.

A small Llama-style model trains on the Python-docs corpus. At each measurement point a fixed
held-out batch is split over ``R`` simulated ranks; each rank's FP32 weight gradient ``G_r`` of
every transformer linear layer is encoded on its own and the decoded messages are summed in FP32
(what ``megatron_gift.comm`` does)::

    bf16        Σ_r bf16(G_r)
    euclid-*    Σ_r dec(enc(G_r))
    gift-*      (Σ_r dec(enc(G_r·T))) · T⁻¹        T identical on every rank

    rel_l2 = ‖approx − Σ_r G_r‖ / ‖Σ_r G_r‖,   cos = cosine(approx, Σ_r G_r)

GIFT schemes (:class:`GiftScheme`), their factors kept during training as the plugin keeps them:

* ``gift-<codec>``: ``GiftConfig()``'s defaults (:data:`DEFAULT`): input statistics of every step
  folded into a per-step EMA (Nyström sketch of ``XᵀX``), the factor rebuilt on the plugin's
  refresh steps (``GiftState.is_refresh_step``: every ``refresh_interval``, and 1, 2, 4, ...
  before), rank ``rank``, and the damping chosen per layer at measurement among
  ``damping_candidates`` and Euclidean by the error each gives on rank 0's own gradient
  (``profile.choose_damping``, as the factor's owner does at a refresh; Euclidean: ``T = I``).
* ``gift-chosen`` / ``gift-both`` / ``gift-auto`` (``-e4m3-block``, the configured codec; :data:`PLUGIN`):
  what the plugin sends at ``--gift-side input`` / ``both`` / ``auto``, simulated as
  ``bench.plugin_sim.GiftLayer`` runs it: the same statistics (and, for ``both`` and ``auto``,
  those of the layer's output gradients, folded a step later as the runtime folds them), the refresh
  on the plugin's steps with the damping (pair) chosen on that training step's gradient (the batch's,
  clipped: the owner's own gradient in the plugin) and installed a step late, and the
  cold-start rule (``profile.held_out_gate``). Also measured at ``cold_points`` (the first steps),
  where only plain FP8 and these are measured, and which the other summaries leave out.
* ``gift-paper-<codec>`` / ``gift-paper-dense-<codec>``: the paper's settings (:data:`PAPER`):
  exact ``XᵀX`` only on refresh steps (every 50, warm-ups below), EMA 0.95 per refresh, damping
  1e-3, rank 32; low-rank-plus-diagonal ``T``, or the paper's dense Cholesky ``T`` of the same Â.

Codec names ``<fmt>-<scaling>[-shared]``: ``-shared`` is one per-tensor scale from the maximum
over all ranks (the paper's baseline); otherwise every rank scales its own groups. Each scheme is
measured at ``tokens_per_rank`` = ``seqs_per_rank·seq_len`` and ``accumulation``× that (gradient
accumulation; a rank's gradient is the mean over all its tokens). ``factor_age``: steps between
the factor's refresh and the measured weights.

Geometry (``numerics.geometry``) is computed on the stack of per-rank gradients, since those are
what get quantized: ``p`` = share of tr(A) in its top-r eigenvalues, ``q`` = share of Σ_r‖G_r‖²
in that subspace, predicted GIFT/Euclidean RelL2 ratio ``shares: sqrt(ρq/p + (1−ρ)(1−q)/(1−p))``
with ``ρ = r/d_in`` and ``model: sqrt(Σ_r‖G_r T‖² · tr(Â)/d_in / Σ_r‖G_r‖²)``; next to them the
measured ratio ``rel_l2(gift-…-c) / rel_l2(euclid-c)`` for every codec ``c``.

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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gift.config import GiftConfig, WhiteningConfig
from megatron_gift.numerics import (
    CodecConfig,
    FP8Format,
    KFACStatistics,
    LowRankWhitening,
    Scaling,
    geometry_stats,
    roundtrip,
)
from megatron_gift.numerics.profile import choose_damping
from megatron_gift.testing.dense import DenseCholeskyWhitening
from megatron_gift_tools.bench import fp4_schemes
from megatron_gift_tools.bench.corpus import TokenCorpus, build_token_corpus
from megatron_gift_tools.bench.llama import (
    LlamaConfig,
    LlamaModel,
    Trainer,
    capture_inputs,
    capture_output_grads,
    layer_type,
    linear_layers,
    per_shard_grads,
)
from megatron_gift_tools.bench.plugin_sim import GiftLayer

LAYER_TYPES = ("qkv", "proj", "fc1", "fc2")

SCHEMA = {
    "results": "one record per (step, layer, tokens_per_rank, scheme): step, layer, layer_type, scheme, "
    "tokens_per_rank, rel_l2, rel_l2_se, cos; gift schemes add ratio_vs_euclid (rel_l2 / rel_l2 of euclid with the "
    "same codec), ratio_vs_best_euclid (rel_l2 / min(euclid-e4m3-block, euclid-e4m3-row)), noise_vs_best_euclid, "
    "best_euclid, damping (the damping used, 'euclidean' where the choice was T = I; the plugin's schemes: a "
    "candidate, a pair 'δ_in/δ_out', 'euclidean' or 'none' before any refresh) and (not the plugin's) factor_age; "
    "steps in cold_points hold only bf16, euclid and the plugin's schemes (gift-chosen, gift-both, gift-auto)",
    "schemes": "scheme name -> family (bf16|euclid|gift|gift-paper|gift-paper-dense), codec (fmt-scaling[-shared]), "
    "fmt, scaling, shared, gift_rank, settings (the GIFT scheme's statistics, refresh and damping)",
    "geometry": "one record per (step, layer, tokens_per_rank, gift scheme family gift|gift-paper): d_in, "
    "trace_share_top_r (p), grad_energy_share_top_r (q over the per-rank gradients), grad_energy_share_top_r_sum "
    "(q of Σ_r G_r), predicted_ratio_shares, predicted_ratio_model, measured_ratio {codec: gift/euclid rel_l2}",
    "points": "per measurement step: train_loss (mean over the last 8 training batches), heldout_loss, seconds",
    "summary": "over the points (not the cold_points) unless said: rel_l2_geomean (per tokens_per_rank, scheme, "
    "layer_type; 'all' = every layer), "
    "gift_vs_best_euclid (geomean of ratio_vs_best_euclid per tokens_per_rank ('all': both), family and layer_type, "
    "with the worst record), damping_choices (the default scheme's, per layer type), ratio_by_layer_type "
    "(geomeans of predicted and measured ratios), prediction_fit (per codec: Pearson correlation of log predicted vs "
    "log measured ratio over all geometry records, median measured/predicted), plugin_per_step (every step, cold "
    "ones included: per step and plugin scheme the geomean and worst ratio_vs_best_euclid, records sent whitened), "
    "gift_above_best_euclid_beyond_noise (records of gift-e4m3-block and the plugin's schemes, every step, above the "
    "best Euclidean by more than noise_vs_best_euclid)",
}


@dataclass(frozen=True)
class GiftScheme:
    """How GIFT keeps its factor: statistics (``sketch`` columns, 0: exact ``XᵀX``) folded into an EMA
    ``ema`` every step, or only on refresh steps (``per_refresh``, the EMA per refresh, each warm-up
    refresh replacing it); rebuilt every ``refresh_interval`` steps (and 1, 2, 4, ... before);
    ``rank``; ``damping`` (None: chosen per layer among ``candidates`` and Euclidean)."""

    rank: int
    sketch: int
    ema: float
    refresh_interval: int
    damping: float | None
    candidates: tuple[float, ...] = ()
    per_refresh: bool = False

    @classmethod
    def from_config(cls, w: WhiteningConfig) -> GiftScheme:
        return cls(w.rank, w.sketch, w.ema, w.refresh_interval, w.damping, w.damping_candidates)

    def is_refresh(self, step: int) -> bool:
        """``GiftState.is_refresh_step``'s schedule for this interval."""
        n = self.refresh_interval
        return step % n == 0 or (step < n and step & (step - 1) == 0)


DEFAULT = GiftScheme.from_config(WhiteningConfig())
"""What ships: ``WhiteningConfig()``'s statistics, refresh, rank and damping choice."""
PAPER = GiftScheme(rank=32, sketch=0, ema=0.95, refresh_interval=50, damping=1e-3, per_refresh=True)
"""The paper's artifact: exact statistics every 50 steps, EMA per refresh, damping 1e-3, rank 32."""


@dataclass(frozen=True)
class FidelityConfig:
    """What to train and measure. ``points`` are cumulative training steps."""

    model: LlamaConfig
    points: tuple[int, ...]
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    seqs_per_rank: int = 16
    accumulation: int = 4
    gift: GiftScheme = DEFAULT
    paper: GiftScheme = PAPER
    seed: int = 0
    cold_points: tuple[int, ...] = (1, 2)  # the plugin's cold start: measured before ``points``, plugin schemes only
    formats: tuple[str, ...] = ("fp8",)  # with "nvfp4"/"mxfp4": also each layer's FP4 schemes (``fp4_schemes``)

    def __post_init__(self):
        steps = (0, *self.cold_points, *self.points)
        if any(b <= a for a, b in zip(steps, steps[1:])) or not self.points:
            raise ValueError(f"need increasing positive cold_points then points, got {self.cold_points}, {self.points}")


# points in the middle of the default refresh interval (factors 4-5 steps old), late enough to be past the warm-up
QUICK = FidelityConfig(model=LlamaConfig(hidden=128, layers=2, heads=2, ffn_hidden=344, seq_len=64), points=(45, 125))
FULL = FidelityConfig(
    model=LlamaConfig(hidden=256, layers=3, heads=4, ffn_hidden=688, seq_len=64), points=(55, 205, 405)
)


@dataclass(frozen=True)
class Scheme:
    """How one layer's gradient is communicated: ``family`` bf16/euclid/gift/gift-paper/gift-paper-dense, codec."""

    family: str
    codec: CodecConfig | None = None
    shared: bool = False

    @property
    def codec_name(self) -> str:
        return self.codec.name + ("-shared" if self.shared else "")

    @property
    def name(self) -> str:
        return "bf16" if self.family == "bf16" else f"{self.family}-{self.codec_name}"

    def describe(self, cfg: FidelityConfig) -> dict:
        """The scheme's parts, for the JSON ``schemes`` table."""
        if self.codec is None:
            return {"family": self.family}
        out = {
            "family": self.family,
            "codec": self.codec_name,
            "fmt": self.codec.fmt.name,
            "scaling": self.codec.scaling.value,
            "shared": self.shared,
        }
        gift = {"gift": cfg.gift, "gift-paper": cfg.paper, "gift-paper-dense": cfg.paper}.get(self.family)
        if self.family in PLUGIN:
            gift = cfg.gift
            out.update(side=PLUGIN[self.family])
        if gift is not None:
            out.update(gift_rank=gift.rank, settings=dataclasses.asdict(gift))
        return out


CODECS = [(CodecConfig(FP8Format.E5M2, Scaling.TENSOR), True)] + [
    (CodecConfig(fmt, scaling), False) for fmt in (FP8Format.E5M2, FP8Format.E4M3) for scaling in Scaling
]
"""(codec, shared): the paper's baseline, then both formats at every granularity (1x128 blocks)."""
GIFT_FAMILIES = ("gift", "gift-paper", "gift-paper-dense")
PLUGIN = {"gift-chosen": "input", "gift-both": "both", "gift-auto": "auto"}
"""The plugin's schemes (module doc) -> the ``--gift-side`` each simulates; configured codec only."""
BEST_EUCLID = ("euclid-e4m3-block", "euclid-e4m3-row")  # the strongest plain FP8: GIFT's ratio_vs_best_euclid


def schemes(cfg: FidelityConfig | None = None) -> list[Scheme]:
    """Every scheme measured, in table order."""
    return (
        [Scheme("bf16")]
        + [Scheme(family, c, s) for family in ("euclid", *GIFT_FAMILIES) for c, s in CODECS]
        + [Scheme(family, GiftConfig().wire.codec) for family in PLUGIN]
    )


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


CHUNKS = 16  # interleaved element groups the noise of a RelL2 is estimated from


def chunk_errors(approx: torch.Tensor, truth: torch.Tensor, chunks: int = CHUNKS) -> list[float]:
    """Squared error ``‖approx − truth‖²`` of each of ``chunks`` interleaved groups of elements (element
    ``k`` of the flattened tensor in group ``k mod chunks``), FP64: the samples ``noisy_rel_l2`` estimates
    the noise from. Interleaved, every group samples each row and scale block alike, so their spread is
    the rounding's randomness and not the differences between rows."""
    diff = (approx.double() - truth.double()).pow(2).flatten()
    n = diff.numel() - diff.numel() % chunks
    head = diff[:n].view(-1, chunks).sum(0)
    head[: diff.numel() - n] += diff[n:]
    return head.tolist()


def noisy_rel_l2(errs: list[float], ref2: float) -> tuple[float, float]:
    """``(rel_l2, standard error)`` from the chunks' squared errors ``e_c`` and ``ref2 = ‖truth‖²``:
    ``rel² = Σe_c / ref2``; treating the chunks as samples, ``se(Σe) = sqrt(n·var(e_c))`` and
    ``se(rel) = rel·se(Σe)/(2Σe)`` (the reference is the same for every scheme, so only the error varies)."""
    e = torch.tensor(errs, dtype=torch.float64)
    rel = math.sqrt(float(e.sum()) / ref2)
    n = e.numel()
    se = rel * math.sqrt(n * float(e.var())) / (2 * float(e.sum())) if n > 1 and float(e.sum()) > 0 else 0.0
    return rel, se


def rel_l2_noise(approx: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """``(rel_l2, standard error)`` of ``approx`` against ``truth`` (``noisy_rel_l2`` of ``chunk_errors``)."""
    return noisy_rel_l2(chunk_errors(approx, truth), float(truth.double().pow(2).sum()))


def errors(approx: torch.Tensor, truth: torch.Tensor) -> dict:
    """``rel_l2``, its standard error ``rel_l2_se`` (``rel_l2_noise``) and ``cos`` of ``approx`` against ``truth``, in
    FP64."""
    a, t = approx.double().flatten(), truth.double().flatten()
    return {
        "rel_l2": float((a - t).norm() / t.norm()),
        "rel_l2_se": rel_l2_noise(approx, truth)[1],
        "cos": float(a @ t / (a.norm() * t.norm())),
    }


def _geometry(stack: torch.Tensor, truth: torch.Tensor, factor, whitening) -> dict:
    per_rank = geometry_stats(stack.reshape(-1, stack.shape[-1]), factor, whitening)
    return {
        **dataclasses.asdict(per_rank),
        "grad_energy_share_top_r_sum": geometry_stats(truth, factor, whitening).grad_energy_share_top_r,
    }


def _gift_sum(stack: torch.Tensor, codec: CodecConfig, shared: bool, whitening) -> torch.Tensor:
    """``(Σ_r dec(enc(G_r T))) T⁻¹``; ``whitening`` None: ``T = I`` (plain FP8)."""
    if whitening is None:
        return quantized_sum(stack, codec, shared)
    return whitening.inverse(quantized_sum(whitening.apply(stack), codec, shared))


def measure_layer(
    stack: torch.Tensor, factors: dict, cfg: FidelityConfig, plugin=None
) -> tuple[list[dict], list[dict]]:
    """Result records of every scheme and geometry records of each GIFT scheme for one layer's
    per-rank gradients ``stack [R, d_out, d_in]``; ``factors``: ``{"gift" | "gift-paper": (undamped
    LowRankFactor of the scheme's last refresh, its age in steps)}`` (empty: those schemes left out);
    ``plugin``: the layer's ``GiftLayer``, whose installed ``T`` the :data:`PLUGIN` schemes send."""
    truth = stack.sum(0)
    results = [{"scheme": "bf16", **errors(stack.bfloat16().float().sum(0), truth)}]
    euclid, euclid_se = {}, {}
    for codec, shared in CODECS:
        scheme = Scheme("euclid", codec, shared)
        results.append({"scheme": scheme.name, **errors(quantized_sum(stack, codec, shared), truth)})
        euclid[scheme.codec_name], euclid_se[scheme.codec_name] = results[-1]["rel_l2"], results[-1]["rel_l2_se"]
    best_name = min((name.removeprefix("euclid-") for name in BEST_EUCLID), key=euclid.get)
    best, best_se = euclid[best_name], euclid_se[best_name]

    def compared(rec: dict, codec_name: str) -> dict:
        rec["ratio_vs_euclid"] = rec["rel_l2"] / euclid[codec_name]
        rec["ratio_vs_best_euclid"] = rec["rel_l2"] / best
        rec["noise_vs_best_euclid"] = 2 * math.hypot(rec["rel_l2_se"], best_se)  # GIFT loses only beyond it
        rec["best_euclid"] = best
        return rec

    if plugin is not None:
        codec = GiftConfig().wire.codec
        for family, side in PLUGIN.items():
            t, label = plugin.sent.get((side, True), (None, "none"))
            rec = {
                "scheme": Scheme(family, codec).name,
                **errors(_gift_sum(stack, codec, False, t), truth),
                "damping": label,
            }
            results.append(compared(rec, codec.name))
    geometry = []
    for family, (factor, age) in factors.items():
        gift = cfg.gift if family == "gift" else cfg.paper
        variants = [(family, LowRankWhitening)] + (
            [("gift-paper-dense", DenseCholeskyWhitening)] if family == "gift-paper" else []
        )
        measured, shipped = {}, None
        for codec, shared in CODECS:
            # auto: the owner's choice on its own gradient (rank 0's), for this codec; None: Euclidean (T = I)
            damping = (
                gift.damping
                if gift.damping is not None
                else choose_damping(stack[0], factor, gift.candidates, codec)[0]
            )
            for fam, transform in variants:
                scheme = Scheme(fam, codec, shared)
                whitening = None if damping is None else transform(factor.with_damping(damping))
                rec = {
                    "scheme": scheme.name,
                    **errors(_gift_sum(stack, codec, shared, whitening), truth),
                    "damping": "euclidean" if damping is None else damping,
                    "factor_age": age,
                }
                results.append(compared(rec, scheme.codec_name))
                if fam == family:
                    measured[scheme.codec_name] = rec["ratio_vs_euclid"]
                    if codec == GiftConfig().wire.codec and not shared and whitening is not None:
                        shipped = (factor.with_damping(damping), whitening)
        if shipped is not None:  # the factor and T of the configured codec's damping (nothing to predict where T = I)
            geo = _geometry(stack, truth, *shipped)
            geometry.append(
                {
                    "family": family,
                    "gift_rank": factor.v.shape[1],
                    "d_in": stack.shape[-1],
                    **geo,
                    "measured_ratio": measured,
                }
            )
    return results, geometry


# --------------------------------------------------------------------------- training


class _SchemeFactors:
    """One GIFT scheme's statistics of every linear layer during training, as the plugin keeps them,
    and the undamped factor of each layer's last refresh with the step it was built on."""

    def __init__(self, gift: GiftScheme, layers: dict):
        self.gift = gift
        self.stats = {
            n: KFACStatistics(m.in_features, ema=gift.ema, sketch=gift.sketch, seed=i)
            for i, (n, m) in enumerate(layers.items())
        }
        self.factors: dict[str, tuple] = {}

    def after_step(self, step: int, acts: dict) -> None:
        gift, refresh = self.gift, self.gift.is_refresh(step)
        for n, x in acts.items():
            stats = self.stats[n]
            if refresh or not gift.per_refresh:
                stats.accumulate(x)
                stats.fold(ema=0.0 if gift.per_refresh and step < gift.refresh_interval else None)  # warm-up: replace
            if refresh:
                self.factors[n] = (stats.low_rank_factor(stats.factor_rank(gift.rank), 0.0), step)


class _PluginLayers:
    """Every linear layer's GIFT as the plugin runs it (:data:`PLUGIN`), one
    ``plugin_sim.GiftLayer`` each, fed by the training steps."""

    def __init__(self, gift: GiftScheme, layers: dict):
        self.gift, n = gift, len(layers)
        self.layers = {
            name: GiftLayer(
                KFACStatistics(m.in_features, gift.ema, gift.sketch, seed=i),
                gift.rank,
                KFACStatistics(m.out_features, gift.ema, gift.sketch, seed=n + i),
            )
            for i, (name, m) in enumerate(layers.items())
        }

    def install(self) -> None:
        """The last refresh's ``T``, a step late (what the next step sends)."""
        for layer in self.layers.values():
            layer.install()

    def after_step(self, step: int, acts: dict, dys: dict, grads: dict) -> None:
        """Step ``step``'s statistics (inputs ``acts``, output gradients ``dys``); on a refresh step the
        factors and the damping choice on its gradient ``grads``."""
        self.install()
        dampings = self.gift.candidates if self.gift.damping is None else (self.gift.damping,)
        for name, layer in self.layers.items():
            layer.observe([acts[name]], [dys[name]])
            if self.gift.is_refresh(step):
                layer.refresh(grads[name], dampings)


def _heldout_batches(
    corpus: TokenCorpus, cfg: FidelityConfig, ranks: int
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches, by tokens per rank: ``seqs_per_rank`` and ``accumulation``× that per rank."""
    seq = cfg.model.seq_len
    out = {}
    for i, k in enumerate((1, cfg.accumulation)):
        seqs = cfg.seqs_per_rank * k
        out[seqs * seq] = next(corpus.batches(seq, ranks * seqs, seed=cfg.seed + 1 + i, split="heldout"))
    return out


def _measure_point(
    model, trackers: dict, plugin: _PluginLayers, batches, ranks, cfg, step
) -> tuple[list[dict], list[dict], list[dict], float]:
    """Records of every layer at every held-out batch size (FP8, geometry, FP4 with ``cfg.formats``), and
    the held-out loss of the first batch (at a cold point: only plain FP8 and the plugin's schemes)."""
    results, geometry, fp4, heldout_loss = [], [], [], float("nan")
    plugin.install()
    cold = step in cfg.cold_points
    for tokens, (x, y) in batches.items():
        shards = per_shard_grads(model, x, y, shards=ranks)
        if math.isnan(heldout_loss):
            heldout_loss = statistics.fmean(s.loss for s in shards)
        for name in plugin.layers:
            stack = torch.stack([s.grads[name] for s in shards])
            factors = (
                {}
                if cold
                else {family: (t.factors[name][0], step - 1 - t.factors[name][1]) for family, t in trackers.items()}
            )
            res, geo = measure_layer(stack, factors, cfg, plugin.layers[name])
            key = {"step": step, "layer": name, "layer_type": layer_type(name), "tokens_per_rank": tokens}
            results += [{**key, **r} for r in res]
            geometry += [{**key, **g} for g in geo]
            if not cold and len(cfg.formats) > 1:  # T: what the plugin sends at --gift-side input (None: Euclidean)
                t = plugin.layers[name].sent.get(("input", True), (None, "none"))[0]
                model_key = {"model": f"llama-h{cfg.model.hidden}-l{cfg.model.layers}", **key}
                fp4 += fp4_schemes.measure(stack, stack.sum(0), t, cfg.formats, model_key, rel_l2_noise)
        _log(f"step {step}: measured {len(plugin.layers)} layers at {tokens} tokens/rank")
    return results, geometry, fp4, heldout_loss


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
        groups[(g["tokens_per_rank"], g["family"], g["layer_type"])].append(g)
    out = []
    for (tokens, family, lt), gs in groups.items():
        codecs = gs[0]["measured_ratio"]
        out.append(
            {
                "tokens_per_rank": tokens,
                "family": family,
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


def _gift_vs_best_euclid(results: list[dict]) -> list[dict]:
    """Geomean and worst of ``ratio_vs_best_euclid`` per tokens per rank (``all``: both), GIFT family
    and layer type (``all``: every layer), for the configured codec (E4M3, 1x128 blocks)."""
    codec = GiftConfig().wire.codec.name
    groups = defaultdict(list)
    for r in results:
        family = r["scheme"].removesuffix(f"-{codec}")
        if family in (*GIFT_FAMILIES, *PLUGIN) and r["scheme"].endswith(codec):
            for t in (r["tokens_per_rank"], "all"):
                for lt in (r["layer_type"], "all"):
                    groups[(t, family, lt)].append(r["ratio_vs_best_euclid"])
    return [
        {
            "tokens_per_rank": t,
            "family": f,
            "layer_type": lt,
            "ratio_geomean": _geomean(v),
            "worst": max(v),
            "n": len(v),
        }
        for (t, f, lt), v in groups.items()
    ]


def _damping_choices(results: list[dict]) -> dict:
    """How often the default scheme chose each damping (or Euclidean), per layer type, configured codec."""
    name = Scheme("gift", GiftConfig().wire.codec).name
    out = defaultdict(lambda: defaultdict(int))
    for r in results:
        if r["scheme"] == name:
            out[r["layer_type"]][str(r["damping"])] += 1
    return {k: dict(v) for k, v in out.items()}


def _plugin_per_step(results: list[dict]) -> list[dict]:
    """Per step and plugin scheme: geomean and worst ``ratio_vs_best_euclid`` over the layers and
    batch sizes, and how many records were sent whitened (a damping other than Euclidean or none)."""
    names = {Scheme(f, GiftConfig().wire.codec).name: f for f in PLUGIN}
    groups = defaultdict(list)
    for r in results:
        if r["scheme"] in names:
            groups[(r["step"], names[r["scheme"]])].append(r)
    return [
        {
            "step": t,
            "family": f,
            "ratio_geomean": _geomean(r["ratio_vs_best_euclid"] for r in rs),
            "worst": max(r["ratio_vs_best_euclid"] for r in rs),
            "whitened": sum(r["damping"] not in ("euclidean", "none") for r in rs),
            "n": len(rs),
        }
        for (t, f), rs in sorted(groups.items())
    ]


def summarize(results: list[dict], geometry: list[dict], cold_points: tuple[int, ...] = ()) -> dict:
    """Aggregates over layers and steps (the steps after ``cold_points`` unless the key says otherwise:
    module doc, ``SCHEMA``); the printed tables are rendered from these alone."""
    everything, results = results, [r for r in results if r["step"] not in cold_points]
    return {
        "rel_l2_geomean": _rel_l2_geomean(results),
        "gift_vs_best_euclid": _gift_vs_best_euclid(results),
        "damping_choices": _damping_choices(results),
        "ratio_by_layer_type": _ratio_by_layer_type(geometry),
        "prediction_fit": _prediction_fit(geometry),
        "plugin_per_step": _plugin_per_step(everything),
        "gift_above_best_euclid_beyond_noise": _losses(everything),
    }


def _losses(results: list[dict]) -> list[dict]:
    """Records of the default scheme and the plugin's (configured codec) whose RelL2 exceeds the best
    Euclidean's by more than ``noise_vs_best_euclid`` (twice the combined standard error)."""
    names = {Scheme(f, GiftConfig().wire.codec).name for f in ("gift", *PLUGIN)}
    return [
        {
            k: r[k]
            for k in ("step", "layer", "scheme", "tokens_per_rank", "rel_l2", "best_euclid", "noise_vs_best_euclid")
        }
        for r in results
        if r["scheme"] in names and r["rel_l2"] - r["best_euclid"] > r["noise_vs_best_euclid"]
    ]


# --------------------------------------------------------------------------- tables

RATIO_CODECS = ("e5m2-tensor-shared", "e4m3-tensor", "e4m3-row", "e4m3-block", "e4m3-mx")
"""Codecs whose measured GIFT/Euclidean ratio is printed (the JSON holds all of them)."""


def fp4_summary(records: list[dict]) -> list[dict]:
    """Per FP4 format, scheme and layer type: the geometric-mean ratio to the format's Euclidean over layers,
    steps and batch sizes, with the standard error of that mean (from the log ratios' spread), and the
    worst record's ratio."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        groups.setdefault((r["format"], r["scheme"], r["layer_type"]), []).append(r["ratio"])
    out = []
    for (fmt, scheme, kind), ratios in groups.items():
        logs = [math.log(x) for x in ratios]
        mean = statistics.fmean(logs)
        se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
        ratio = math.exp(mean)
        rec = dict(format=fmt, scheme=scheme, layer_type=kind, n=len(ratios), ratio=ratio, ratio_se=ratio * se)
        out.append({**rec, "worst": max(ratios)})
    return out


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


def _best_euclid_table(summary: dict) -> str:
    cols = [*LAYER_TYPES, "all"]
    cell = {(r["tokens_per_rank"], r["family"], r["layer_type"]): r for r in summary["gift_vs_best_euclid"]}
    tokens = sorted({t for t, _, _ in cell if t != "all"}) + ["all"]
    rows = [
        [
            family,
            t,
            *(cell[(t, family, c)]["ratio_geomean"] if (t, family, c) in cell else None for c in cols),
            cell[(t, family, "all")]["worst"] if (t, family, "all") in cell else None,
        ]
        for family in (*GIFT_FAMILIES, *PLUGIN)
        for t in tokens
    ]
    title = (
        f"GIFT / best Euclidean ({' or '.join(BEST_EUCLID)}) RelL2, {GiftConfig().wire.codec.name}, geometric mean "
        "over layers and steps"
    )
    return f"{title}\n\n" + _md_table(["scheme", "tokens/rank", *cols, "worst record"], rows)


def _ratio_table(summary: dict) -> str:
    header = ["tokens/rank", "scheme", "layer", "p (trace)", "q (grad)", "pred shares", "pred model"]
    header += [f"meas {c}" for c in RATIO_CODECS]
    keys = ("tokens_per_rank", "family", "layer_type", "trace_share_top_r", "grad_energy_share_top_r")
    keys += ("predicted_ratio_shares", "predicted_ratio_model")
    recs = sorted(
        summary["ratio_by_layer_type"],
        key=lambda r: (r["tokens_per_rank"], r["family"], LAYER_TYPES.index(r["layer_type"])),
    )
    rows = [[*(r[k] for k in keys), *(r["measured_ratio"][c] for c in RATIO_CODECS)] for r in recs]
    title = "GIFT/Euclidean RelL2 ratio, predicted vs measured (geometric means)"
    return f"{title}\n\n" + _md_table(header, rows)


def _fit_table(summary: dict) -> str:
    header = ["codec", "corr log (model)", "median meas/model", "corr log (shares)", "median meas/shares"]
    keys = ("codec", "corr_log_model", "median_measured_over_model", "corr_log_shares", "median_measured_over_shares")
    rows = [[f[k] for k in keys] for f in summary["prediction_fit"]]
    return "Prediction fit over every (step, layer, tokens/rank, GIFT scheme)\n\n" + _md_table(header, rows)


def _plugin_table(summary: dict) -> str:
    rows = [
        [r["step"], r["family"], r["ratio_geomean"], r["worst"], f"{r['whitened']}/{r['n']}"]
        for r in summary["plugin_per_step"]
    ]
    title = (
        "The plugin's schemes per step, cold start included: scheme / best Euclidean RelL2 (geometric mean and "
        "worst over layers and batch sizes), records sent whitened"
    )
    return f"{title}\n\n" + _md_table(["step", "scheme", "geomean", "worst", "whitened"], rows)


def format_tables(report: dict) -> str:
    """Markdown tables of ``report['summary']``: GIFT against the best plain FP8, RelL2 per scheme and
    layer type, the default scheme's damping choices, predicted vs measured GIFT/Euclidean ratios per
    layer type, and how well the prediction fits."""
    summary = report["summary"]
    choices = "\n".join(
        f"- {lt}: " + ", ".join(f"{k} x{v}" for k, v in sorted(c.items()))
        for lt, c in sorted(summary["damping_choices"].items())
    )
    parts = [
        _best_euclid_table(summary),
        *_rel_l2_tables(summary, list(report["schemes"])),
        "Damping chosen by the default scheme (records per layer type)\n\n" + choices,
        _ratio_table(summary),
        _fit_table(summary),
        _plugin_table(summary),
        f"Records of gift-{GiftConfig().wire.codec.name} and the plugin's schemes above the best Euclidean by more "
        "than "
        f"twice the combined standard error of the two RelL2s: {len(summary['gift_above_best_euclid_beyond_noise'])}",
    ]
    if summary.get("fp4"):
        rows = [
            [r["format"], r["scheme"], r["layer_type"], r["n"], r["ratio"], r["ratio_se"], r["worst"]]
            for r in sorted(summary["fp4"], key=lambda r: (r["format"], r["layer_type"], r["scheme"]))
        ]
        head = ["format", "scheme", "layer type", "records", "RelL2 / Euclidean (geomean)", "se", "worst record"]
        parts.append("Four-bit schemes against the same format's Euclidean\n\n" + _md_table(head, rows))
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
    with torch_threads(threads or torch.get_num_threads()):
        return _run(quick, json_path, ranks, config or (QUICK if quick else FULL), command)


@contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _run(quick: bool, json_path, ranks: int, cfg: FidelityConfig, command: str | None) -> dict:
    t0 = time.perf_counter()
    corpus = build_token_corpus(vocab_size=cfg.model.vocab_size)
    model = LlamaModel(cfg.model, seed=cfg.seed)
    trainer = Trainer(model, corpus, lr=cfg.lr, batch_size=cfg.batch_size, seed=cfg.seed, warmup_steps=cfg.warmup_steps)
    layers = linear_layers(model)
    trackers = {"gift": _SchemeFactors(cfg.gift, layers), "gift-paper": _SchemeFactors(cfg.paper, layers)}
    plugin = _PluginLayers(cfg.gift, layers)
    batches = _heldout_batches(corpus, cfg, ranks)
    results, geometry, fp4, points = [], [], [], []
    for step in (*cfg.cold_points, *cfg.points):
        t, losses = time.perf_counter(), []
        while trainer.step < step:
            with capture_inputs(model, layers) as acts, capture_output_grads(model, layers) as dys:
                losses += trainer.run(1)
            for tracker in trackers.values():
                tracker.after_step(trainer.step - 1, acts)
            plugin.after_step(trainer.step - 1, acts, dys, {n: m.weight.grad for n, m in layers.items()})
        train_loss = statistics.fmean(losses[-8:])
        _log(f"step {step}: train loss {train_loss:.3f} ({time.perf_counter() - t:.1f}s)")
        res, geo, four, heldout_loss = _measure_point(model, trackers, plugin, batches, ranks, cfg, step)
        results += res
        geometry += geo
        fp4 += four
        points.append(
            {"step": step, "train_loss": train_loss, "heldout_loss": heldout_loss, "seconds": time.perf_counter() - t}
        )
    report = {
        "benchmark": "fidelity",
        "schema": SCHEMA,
        "command": command or " ".join(sys.argv),
        "machine": machine(),
        "config": {**dataclasses.asdict(cfg), "ranks": ranks, "quick": quick, "codec_block": CodecConfig().block},
        "corpus": corpus.manifest,
        "schemes": {s.name: s.describe(cfg) for s in schemes(cfg)},
        "points": points,
        "results": results,
        "geometry": geometry,
        "summary": summarize(results, geometry, cfg.cold_points),
        "wall_seconds": time.perf_counter() - t0,
    }
    if fp4:
        report["fp4"] = fp4
        report["summary"]["fp4"] = fp4_summary(fp4)
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(_rounded(report), separators=(",", ":")) + "\n")
        _log(f"wrote {json_path}")
    return report
