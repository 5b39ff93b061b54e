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
from .geometry import geometry_sums, row_spans, shares_ratio
from .two_sided import TwoSidedWhitening
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
    "geometry_ranks",  # ranks that had the factor (its owner: the refresh leaves it there)
    "geometry_grad_sq",  # ‖g‖² on those ranks: what the geometry's shares are of
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


def _roundtrip_sums(g: torch.Tensor, g_hat: torch.Tensor) -> list[torch.Tensor]:
    """``[‖ĝ - g‖², ⟨ĝ, g⟩, ‖ĝ‖²]`` accumulated in FP64 (0-d tensors on ``g``'s device): FP64 dot products of
    the two FP64 copies, the difference made in place of ``ĝ``'s copy once the others are taken (16 B per
    element at once, not 32)."""
    g64, h64 = g.reshape(-1).double(), g_hat.reshape(-1).to(torch.float64, copy=True)
    dot, sq = torch.dot(h64, g64), torch.dot(h64, h64)
    diff = h64.sub_(g64)
    return [torch.dot(diff, diff), dot, sq]


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the finite values of ``x`` (0 where none), as ``fp8.encode`` takes a group's."""
    return x.abs().nan_to_num_(nan=0.0, posinf=0.0).amax()


def profile_gradient(
    g: torch.Tensor,
    cfg: CodecConfig,
    whitening: LowRankWhitening | None = None,
    factor: LowRankFactor | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive profile ``[len(FIELDS)]`` FP64 (on ``g``'s device) of the local gradient ``g``,
    computed on that device without a host synchronisation.

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
    # Row blocks (``geometry.row_spans``): every codec group lies inside a row, and a per-tensor scale
    # comes from the maximum over the blocks (the same value), so each block encodes as the whole would;
    # one block where the map mixes rows (a two-sided one's ``T_outᵀ``).
    m = g.reshape(g.shape[0], -1) if g.dim() > 1 else g.reshape(1, -1)
    rows = m.shape[0]
    spans = (row_spans(rows) if not isinstance(whitening, TwoSidedWhitening) else [(0, rows)]) if g.numel() else []
    over_rows = lambda f: torch.stack([f(m[a:b]) for a, b in spans]).amax()  # noqa: E731
    per_tensor = cfg.scaling is Scaling.TENSOR
    own = over_rows(_finite_amax) if spans and (tensor_amax is None or per_tensor) else None
    shared = own if tensor_amax is None else tensor_amax.to(g.device, torch.float32)
    u_amax = over_rows(lambda x: _finite_amax(whitening.apply(x))) if spans and per_tensor and whitening else None
    tensor = CodecConfig(cfg.fmt, Scaling.TENSOR)
    stats = {k: CodecStats() for k in ("tensor", "euclid", "gift")}  # an encode adds its counts
    sums = {k: [] for k in ("grad", "euclid", "gift")}
    for a, b in spans:
        x = m[a:b]
        x64 = x.reshape(-1).double()
        sums["grad"].append(torch.dot(x64, x64))  # 0-d: their sum is too
        del x64
        encode(x, tensor, amax=shared, stats=stats["tensor"])
        x_hat = decode(encode(x, cfg, amax=own if per_tensor else None, stats=stats["euclid"]), cfg)
        sums["euclid"].append(torch.stack(_roundtrip_sums(x, x_hat)))
        del x_hat
        if whitening is not None:
            u = whitening.apply(x)
            x_hat = decode(encode(u, cfg, amax=u_amax, stats=stats["gift"]), cfg)
            del u
            x_hat = whitening.inverse(x_hat)
            sums["gift"].append(torch.stack(_roundtrip_sums(x, x_hat)))
            del x_hat
    zero = torch.zeros(3, dtype=torch.float64, device=g.device)
    total = lambda k: torch.stack(sums[k]).sum(0) if sums[k] else zero  # noqa: E731
    v["grad_sq"] = total("grad") if spans else 0.0
    v["nonfinite"] = stats["tensor"].nonfinite
    v["tensor_at_max"] = stats["tensor"].at_max
    v["tensor_at_min"] = stats["tensor"].flushed + stats["tensor"].at_min_subnormal
    v["euclid_err_sq"], v["euclid_dot"], v["euclid_dec_sq"] = total("euclid").unbind()
    v["euclid_at_max"], v["euclid_flushed"] = stats["euclid"].at_max, stats["euclid"].flushed
    if whitening is not None:
        v["gift_ranks"] = 1.0
        v["gift_err_sq"], v["gift_dot"], v["gift_dec_sq"] = total("gift").unbind()
        v["gift_at_max"], v["gift_flushed"] = stats["gift"].at_max, stats["gift"].flushed

    if factor is not None:
        v["geometry_grad_sq"], v["top_r_energy"], v["model_sq"], v["trace_share"] = geometry_sums(
            g, factor, whitening
        ).unbind()
        v["geometry_ranks"] = 1.0
        v["rank_fraction"] = factor.v.shape[1] / factor.d.shape[0]
    # Python numbers become device scalars by ``full`` (a fill, not a host-to-device copy)
    as_t = lambda x: (
        x.double() if isinstance(x, torch.Tensor) else torch.full((), x, dtype=torch.float64, device=g.device)
    )  # noqa: E731
    return torch.stack([as_t(v[k]) for k in FIELDS])


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _sqrt(x: float | None) -> float | None:
    return None if x is None else math.sqrt(x)


def summarize(vec: torch.Tensor) -> ProfileSummary:
    """The summary of a profile vector (one rank's, or the all-reduced sum over ranks).

    Plain Python arithmetic in FP64 on the CPU: identical vectors give identical summaries.
    RelL2 and cosine are ``None`` when ``Σ‖g‖² = 0``; GIFT fields unless every rank measured
    GIFT; geometry unless some rank had the factor: it describes the gradients of the ranks that
    had it (the layer's factor owner after a refresh), as the damping choice does.
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
    if geo_ranks > 0:
        p = v["trace_share"] / geo_ranks
        q = _ratio(v["top_r_energy"], v["geometry_grad_sq"])
        model = _sqrt(_ratio(v["model_sq"], v["geometry_grad_sq"]))
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


def damping_errors(g: torch.Tensor, whitenings, cfg) -> torch.Tensor:
    """Local estimates of the wire's error on one rank's gradient ``g [d_out, d_in]``, ``[1 + len(whitenings)]``
    on ``g``'s device: ``‖q(G) - G‖`` (Euclidean), then ``‖(q(G T) - G T) T⁻¹‖`` for each ``T`` in
    ``whitenings`` (one per damping candidate: anything with ``apply``/``inverse`` on ``[d_out, d_in]``,
    a ``LowRankWhitening`` or a two-sided ``TwoSidedWhitening``, whose error is ``‖T_out⁻ᵀ (q(U) - U) T_in⁻¹‖``).
    ``q``: FP8 with ``cfg`` a ``CodecConfig``, else ``cfg`` itself, a round trip ``U -> dec(enc(U))``
    (``fp4.FP4Wire``)."""
    q = (lambda x: roundtrip(x, cfg)) if isinstance(cfg, CodecConfig) else cfg  # noqa: E731
    g = g.detach().float()
    errs = [q(g).sub_(g).norm()]
    for w in whitenings:  # one candidate at a time, each temporary freed once used: a few copies of g at most
        u = w.apply(g)
        diff = q(u).sub_(u)
        del u
        errs.append(w.inverse(diff).norm())
        del diff
    return torch.stack(errs)


def damping_choice(errs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-side choice from ``damping_errors`` ``[..., 1 + C]``: ``chosen`` indexes
    ``[Euclidean, *candidates]`` (the smallest error; Euclidean wins ties, and whenever its own
    estimate is not finite; a non-finite candidate estimate never wins), ``best`` the candidates
    (``[0, C)``, the smallest finite error: the damping of the factor kept even when Euclidean is chosen)."""
    e = torch.where(torch.isfinite(errs), errs, torch.inf)
    chosen = torch.where(torch.isfinite(errs[..., 0]), e.argmin(-1), 0)
    return chosen, e[..., 1:].argmin(-1)


def held_out_gate(chosen: torch.Tensor, euclidean_err: torch.Tensor, held_out_err: torch.Tensor | None) -> torch.Tensor:
    """The cold-start rule on the device: ``chosen`` (an index into ``[Euclidean, *candidates]``) where
    the previous build's ``T`` (its best candidate, installed before this step's statistics existed)
    had a smaller FP8 error than Euclidean on this step's gradient, which it never saw; else 0
    (Euclidean). ``held_out_err`` None (no previous build) or not finite: Euclidean. Why a held-out
    check rather than a token count: docs/fidelity.md#cold-start."""
    if held_out_err is None:
        return torch.zeros_like(chosen)
    trusted = torch.isfinite(held_out_err) & (held_out_err < euclidean_err)
    return torch.where(trusted, chosen, torch.zeros_like(chosen))


def choose_damping(g: torch.Tensor, factor: LowRankFactor, candidates, cfg: CodecConfig) -> tuple[float | None, dict]:
    """``damping_choice`` of ``damping_errors`` for ``T_δ`` from ``factor.with_damping(δ)``, δ in
    ``candidates``, read on the host: the chosen δ (``None``: Euclidean) and every estimate by δ."""
    whitenings = [LowRankWhitening(factor.with_damping(delta), device=g.device) for delta in candidates]
    errs = damping_errors(g, whitenings, cfg)
    keys = [None, *candidates]
    return keys[int(damping_choice(errs)[0])], dict(zip(keys, errs.tolist()))
