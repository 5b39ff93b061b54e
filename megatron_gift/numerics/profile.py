"""Per-parameter gradient profile: how FP8 treats one layer's gradient, Euclidean and GIFT.

``profile_gradient`` turns a rank's local gradient into a fixed-length FP64 vector of
*additive* statistics (sums and counts), so data-parallel ranks combine profiles with one
all-reduce SUM (stack several parameters' vectors into one tensor first) and every rank then
derives the same ``ProfileSummary`` with ``summarize``. Summed over ranks ``i``, with
``g_i [d_out, d_in]``, ``ĝ_i`` its round trip and ``e_i = ĝ_i - g_i``::

    RelL2 = sqrt(Σ‖e_i‖² / Σ‖g_i‖²)     cos = Σ⟨ĝ_i, g_i⟩ / sqrt(Σ‖ĝ_i‖² · Σ‖g_i‖²)

i.e. the error of the rank messages stacked into one matrix (each rank's message is encoded on
its own, as on the wire); the single round trip ignores error feedback. Round trips:
Euclidean ``ĝ = dec(enc(g))`` with the configured codec; GIFT ``ĝ = dec(enc(g T)) T⁻¹``.

Vulnerability (the paper's profile): ``g`` encoded in the configured format with one
per-tensor scale shared by all ranks (from ``tensor_amax``, the maximum over ranks; else each
rank's own); the share of codes at ±max plus the share of non-zero inputs that land on zero or
the smallest subnormal. Geometry (``geometry.geometry_stats``): the energy
share ``q`` of ``g`` in the factor's top-r subspace, the trace share ``p``, and the predicted
GIFT/Euclidean ratio, additive as ``ratio_model² · ‖g‖² = ‖g T‖² · tr(Â)/d_in``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .fp8 import CodecConfig, CodecStats, Scaling, decode, encode, roundtrip
from .geometry import geometry_stats, shares_ratio
from .whitening import LowRankFactor, LowRankWhitening

FIELDS = (
    "ranks",  # 1 per rank
    "numel",
    "nonfinite",  # non-finite gradient entries
    "grad_sq",  # ‖g‖²
    "tensor_at_max",  # shared per-tensor scale: codes at ±max
    "tensor_at_min",  # shared per-tensor scale: non-zero inputs flushed to 0, plus codes at the smallest subnormal
    "euclid_err_sq",  # ‖ĝ - g‖², configured codec on g
    "euclid_dot",  # ⟨ĝ, g⟩
    "euclid_dec_sq",  # ‖ĝ‖²
    "euclid_at_max",  # codes at ±max
    "euclid_flushed",  # non-zero inputs decoded as zero
    "gift_ranks",  # ranks that measured GIFT (had a whitening)
    "gift_err_sq",  # as euclid_*, for ĝ = dec(enc(g T)) T⁻¹ (at_max / flushed: codes of g T)
    "gift_dot",
    "gift_dec_sq",
    "gift_at_max",
    "gift_flushed",
    "geometry_ranks",  # ranks that had the factor
    "top_r_energy",  # ‖g V‖² = q ‖g‖²  (V: the factor's top-r eigenvectors)
    "trace_share",  # p, the same on every rank: summed, then divided by geometry_ranks
    "rank_fraction",  # ρ = r / d_in, likewise
    "model_sq",  # ‖g T‖² tr(Â)/d_in = ratio_model² ‖g‖²
)


@dataclass(frozen=True)
class ProfileSummary:
    """What every rank derives from the summed profile; ``None`` where nothing was measured.

    Shares are of all ``numel`` entries; ``saturation``/``underflow`` are the configured codec's
    (Euclidean) ``at_max`` / ``flushed`` shares, ``gift_*`` the same for ``g T``.
    """

    ranks: int
    numel: int
    nonfinite: int
    vulnerability: float
    tensor_max_share: float
    tensor_min_share: float
    saturation: float
    underflow: float
    euclidean_rel_l2: float | None
    euclidean_cos: float | None
    gift_rel_l2: float | None
    gift_cos: float | None
    gift_saturation: float | None
    gift_underflow: float | None
    measured_ratio: float | None
    top_r_share: float | None
    trace_share: float | None
    predicted_ratio: float | None
    predicted_ratio_shares: float | None


def _roundtrip_sums(g: torch.Tensor, g_hat: torch.Tensor) -> list[float]:
    """``[‖ĝ - g‖², ⟨ĝ, g⟩, ‖ĝ‖²]`` accumulated in FP64."""
    g64, h64 = g.double(), g_hat.double()
    return [float(((h64 - g64) ** 2).sum()), float((h64 * g64).sum()), float((h64 * h64).sum())]


def profile_gradient(
    g: torch.Tensor,
    cfg: CodecConfig,
    whitening: LowRankWhitening | None = None,
    factor: LowRankFactor | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive profile ``[len(FIELDS)]`` FP64 (on ``g``'s device) of the local gradient ``g``.

    ``g [d_out, d_in]`` (any shape without ``whitening``/``factor``). GIFT fields need
    ``whitening`` (built from ``factor`` when only that is given), geometry fields ``factor``
    (the ``LowRankFactor`` that ``whitening`` was built from); missing ones stay 0 and their
    ``*_ranks`` count says so. ``tensor_amax``: ``max |g|`` over the data-parallel ranks (a MAX
    all-reduce, one for all parameters stacked) for the vulnerability's shared per-tensor scale.
    """
    g = g.detach().float()
    if whitening is None and factor is not None:
        whitening = LowRankWhitening(factor, device=g.device)
    v = dict.fromkeys(FIELDS, 0.0)
    v["ranks"], v["numel"] = 1.0, float(g.numel())
    v["grad_sq"] = float((g.double() ** 2).sum())

    tensor_stats = CodecStats()
    amax = None if tensor_amax is None else torch.as_tensor(tensor_amax, dtype=torch.float32, device=g.device)
    encode(g, CodecConfig(cfg.fmt, Scaling.TENSOR), amax=amax, stats=tensor_stats)
    v["nonfinite"] = float(tensor_stats.nonfinite)
    v["tensor_at_max"] = float(tensor_stats.at_max)
    v["tensor_at_min"] = float(tensor_stats.flushed + tensor_stats.at_min_subnormal)

    stats = CodecStats()
    g_hat = decode(encode(g, cfg, stats=stats), cfg, out_shape=g.shape)
    v["euclid_err_sq"], v["euclid_dot"], v["euclid_dec_sq"] = _roundtrip_sums(g, g_hat)
    v["euclid_at_max"], v["euclid_flushed"] = float(stats.at_max), float(stats.flushed)

    if whitening is not None:
        u = whitening.apply(g)
        stats = CodecStats()
        g_hat = whitening.inverse(decode(encode(u, cfg, stats=stats), cfg, out_shape=u.shape))
        v["gift_ranks"] = 1.0
        v["gift_err_sq"], v["gift_dot"], v["gift_dec_sq"] = _roundtrip_sums(g, g_hat)
        v["gift_at_max"], v["gift_flushed"] = float(stats.at_max), float(stats.flushed)

    if factor is not None:
        geo = geometry_stats(g, factor, whitening)
        v["geometry_ranks"] = 1.0
        v["trace_share"] = geo.trace_share_top_r
        v["rank_fraction"] = factor.v.shape[1] / factor.d.shape[0]
        if v["grad_sq"] > 0:
            v["top_r_energy"] = geo.grad_energy_share_top_r * v["grad_sq"]
            v["model_sq"] = geo.predicted_ratio_model**2 * v["grad_sq"]
    return torch.tensor([v[k] for k in FIELDS], dtype=torch.float64, device=g.device)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _sqrt(x: float | None) -> float | None:
    return None if x is None else math.sqrt(x)


def summarize(vec: torch.Tensor) -> ProfileSummary:
    """The summary of a profile vector (one rank's, or the all-reduced sum over ranks).

    Plain Python arithmetic in FP64 on the CPU: identical vectors give identical summaries.
    RelL2 and cosine are ``None`` when ``Σ‖g‖² = 0``; GIFT fields unless every rank measured
    GIFT; geometry unless every rank had the factor.
    """
    if vec.shape != (len(FIELDS),):
        raise ValueError(f"profile vector must have shape ({len(FIELDS)},), got {tuple(vec.shape)}")
    v = dict(zip(FIELDS, vec.detach().to("cpu", torch.float64).tolist()))
    ranks, n, sq = int(v["ranks"]), v["numel"], v["grad_sq"]

    def share(key: str) -> float:
        return v[key] / n if n > 0 else 0.0

    def rel_cos(prefix: str) -> tuple[float | None, float | None]:
        if sq <= 0:
            return None, None
        dec = v[f"{prefix}_dec_sq"]
        return math.sqrt(v[f"{prefix}_err_sq"] / sq), (v[f"{prefix}_dot"] / math.sqrt(dec * sq) if dec > 0 else 0.0)

    eu_rel, eu_cos = rel_cos("euclid")
    has_gift = ranks > 0 and int(v["gift_ranks"]) == ranks
    gi_rel, gi_cos = rel_cos("gift") if has_gift else (None, None)
    q = p = model = shares = None
    geo_ranks = int(v["geometry_ranks"])
    if ranks > 0 and geo_ranks == ranks:
        p = v["trace_share"] / geo_ranks
        q = _ratio(v["top_r_energy"], sq)
        model = _sqrt(_ratio(v["model_sq"], sq))
        shares = None if q is None else shares_ratio(p, q, v["rank_fraction"] / geo_ranks)
    return ProfileSummary(
        ranks=ranks,
        numel=int(n),
        nonfinite=int(v["nonfinite"]),
        vulnerability=share("tensor_at_max") + share("tensor_at_min"),
        tensor_max_share=share("tensor_at_max"),
        tensor_min_share=share("tensor_at_min"),
        saturation=share("euclid_at_max"),
        underflow=share("euclid_flushed"),
        euclidean_rel_l2=eu_rel,
        euclidean_cos=eu_cos,
        gift_rel_l2=gi_rel,
        gift_cos=gi_cos,
        gift_saturation=share("gift_at_max") if has_gift else None,
        gift_underflow=share("gift_flushed") if has_gift else None,
        measured_ratio=_ratio(gi_rel, eu_rel) if gi_rel is not None and eu_rel else None,
        top_r_share=q,
        trace_share=p,
        predicted_ratio=model,
        predicted_ratio_shares=shares,
    )


def damping_errors(g: torch.Tensor, factor: LowRankFactor, candidates, cfg: CodecConfig) -> dict:
    """Local estimate of each candidate's FP8 error on one rank's gradient ``g [d_out, d_in]``:
    ``‖(q(G T_δ) - G T_δ) T_δ⁻¹‖`` for each relative damping ``δ`` in ``candidates`` (``T_δ``
    from ``factor.with_damping(δ)``), and ``‖q(G) - G‖`` under the key ``None`` (Euclidean)."""
    g = g.detach().float()
    out = {None: float((roundtrip(g, cfg) - g).norm())}
    for delta in candidates:
        w = LowRankWhitening(factor.with_damping(delta), device=g.device)
        u = w.apply(g)
        out[delta] = float(w.inverse(roundtrip(u, cfg) - u).norm())
    return out


def choose_damping(g: torch.Tensor, factor: LowRankFactor, candidates, cfg: CodecConfig) -> tuple[float | None, dict]:
    """The candidate of ``damping_errors`` with the smallest error (``None``: Euclidean; it wins
    ties and non-finite estimates), and all the estimates."""
    errs = damping_errors(g, factor, candidates, cfg)
    finite = {k: e for k, e in errs.items() if math.isfinite(e)}
    best = min(finite, key=lambda k: (finite[k], k is not None)) if None in finite else None
    return best, errs
