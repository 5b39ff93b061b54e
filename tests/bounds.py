"""Error bounds that the multi-rank tests hold reduced gradients to; each derivation is written once, here.

**One rounding.** A value ``x`` rounded to nearest in a format with ``m`` mantissa bits (E4M3: 3,
E5M2: 2, BF16: 7) lands within half a spacing; in the normal range the spacing is at most
``2^-m |x|``. FP8 with per-group scales ``s = amax_group / fp8_max`` keeps a group's values in the
normal range down to ``2^-6 · fp8_max · s`` (E4M3: 2^-6/448 of the group's maximum); below it the
spacing is the scaled smallest subnormal ``σ s`` (E4M3 ``σ = 2^-9``). Modelling the error as
uniform within half a spacing and independent of every other element's::

    E e² = spacing² / 12 ≤ u² x² / 3 + (σ s)² / 12,    u = 2^-(m+1)                   (1)

(the group's maximum is exact). Over a mantissa uniform in ``log`` the mean of ``spacing²/x²`` is
0.54 of the first term, so a measured error sits near sqrt(0.54) ≈ 0.74 of the bound's root.

**Ranks, whitening, several roundings.** A reduction rounds *messages*: rank ``r`` sends
``Q(U_r)``, ``U_r = G_r T`` (``T = I`` for plain FP8 and BF16), the receiver sums in FP32 and maps
back, ``Σ_r Q(U_r) T⁻¹``. A rounding ``e`` made in whitened coordinates reaches element ``(a, j)``
as ``Σ_i e[a, i] T⁻¹[i, j]``; one made before ``T`` (the two-level exchange's BF16 intra-node
stage) as itself. With the roundings independent, the error ``E`` of the reduced tensor has::

    E E[a, j]² = Σ_i V_w[a, i] T⁻¹[i, j]² + V_p[a, j]                                 (2)

``V_w``, ``V_p``: (1) summed over the whitened and the plain roundings. Which messages a path
rounds (:func:`reduction_errors`): the flat reduce-scatter the ``R`` rank messages; the all-reduce
also the summed shard, re-encoded for its all-gather (a second rounding: RelL2 ``(u/√3) c`` becomes
``(u/√3) sqrt(c² + 1)``, ×√2 for uncorrelated gradients, where ``c = sqrt(Σ_r‖G_r‖²)/‖Σ_r G_r‖``);
the two-level exchange the intra-node messages (BF16 of ``G_r``, or FP8 of ``G_r T``; none for
FP32) and then the ``n`` node partial sums. Error feedback sends ``Q(U_r + ε_r T)``: with the
carried residuals ``ε_r`` known, ``Σ_r (G_r + ε_r)`` is the reference and (1) applies to
``U_r + ε_r T`` (without them the per-step error would be ~√2 larger: two roundings).

**From expectation to a bound.** ``‖E‖²`` over a region is a quadratic form in the independent
roundings. Its mean is (2) summed over the region. A Gaussian with the variances of (1) has the
larger fourth moment (a uniform's kurtosis is 1.8, a Gaussian's 3), so
``Var ‖E‖² ≤ 2 tr(C²)`` with ``C`` the region's error covariance, per row
``T⁻ᵀ diag(V_w[a]) T⁻¹ + diag(V_p[a])`` restricted to the region's columns. A test allows the mean
plus :data:`TAIL_SDS` standard deviations (Hanson–Wright: tails no heavier than sub-exponential;
~1e-9 for a Gaussian), then adds the FP32 work deterministically: ``G T``, the sums over ranks and
nodes and ``· T⁻¹`` are FP32 sums of at most ``d + R`` terms, each within ``(d + R) 2^-24`` of
``Σ_r |G_r| |T| |T⁻¹|``, and a BF16 gradient buffer rounds the result once more (``2^-8`` of it).

Assumption: ranks round independently, i.e. their gradients are not (nearly) identical (the tests'
ranks see different tokens).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from megatron_gift.numerics.fp8 import CodecConfig

TAIL_SDS = 6.0  # standard deviations of ‖E‖² above its mean that a test allows (see the module doc)
EPS32 = 2.0**-24  # FP32's unit roundoff
BF16_BITS = 7


@dataclass(frozen=True)
class Rounding:
    """One set of independently rounded messages: ``values [M, rows, cols]`` (FP64) in the
    coordinates they are rounded in (``whitened``: after ``T``), ``mantissa_bits``, and
    ``subnormal_spacing``: ``σ s`` per message (0 where every value is in the normal range)."""

    values: torch.Tensor
    mantissa_bits: int
    subnormal_spacing: torch.Tensor | float = 0.0
    whitened: bool = True

    def variance(self) -> torch.Tensor:
        """(1) summed over the messages: ``[rows, cols]``."""
        u = 2.0 ** -(self.mantissa_bits + 1)
        spacing = torch.as_tensor(self.subnormal_spacing, dtype=torch.float64).reshape(-1)
        return (u * u / 3.0) * (self.values * self.values).sum(0) + float((spacing**2).sum()) / 12.0


def fp8_format(dtype: torch.dtype) -> tuple[int, float, float]:
    """``(mantissa bits, smallest subnormal σ, max)`` of an FP8 dtype, from ``torch.finfo`` alone."""
    info = torch.finfo(dtype)
    bits = round(-math.log2(info.eps))
    return bits, info.smallest_normal * info.eps, float(info.max)


def error_bound(
    local: torch.Tensor,
    roundings: list[Rounding],
    t: torch.Tensor | None = None,
    t_inv: torch.Tensor | None = None,
    region: slice | None = None,
    buffer_u: float = 0.0,
    t_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> float:
    """Bound on ``‖got − Σ_r G_r‖`` over ``region`` of one tensor (module doc), unscaled.

    ``local [R, rows, cols]``: the ranks' gradients (FP64, residuals included); ``roundings``: the
    path's; ``t``, ``t_inv [cols, cols]``: the dense ``T``, ``T⁻¹`` used (None: ``T = I``);
    ``region``: a slice of the tensor's flat, row-major elements (None: all); ``buffer_u``: the
    relative rounding of the buffer the result is written to beyond FP32's (BF16: 2^-8);
    ``t_out``: the dense ``(T_out, T_out⁻¹) [rows, rows]`` of an output side (``U = T_outᵀ G T``,
    :func:`two_sided_error_bound`)."""
    if t_out is not None:
        return two_sided_error_bound(local, roundings, t, t_inv, t_out, region, buffer_u)
    local = local.double()
    ranks, rows, cols = local.shape
    eye = torch.eye(cols, dtype=torch.float64)
    t = eye if t is None else t.double()
    t_inv = eye if t_inv is None else t_inv.double()
    zero = torch.zeros(rows, cols, dtype=torch.float64)
    v_w = sum((r.variance() for r in roundings if r.whitened), zero)
    v_p = sum((r.variance() for r in roundings if not r.whitened), zero)
    w = t_inv * t_inv
    lo, hi = (0, rows * cols) if region is None else (region.start, region.stop)
    mean = var = 0.0
    first, last = lo // cols, (hi - 1) // cols
    for a0, a1, j in _row_blocks(first, last, lo, hi, cols):
        b = t_inv[:, j] @ t_inv[:, j].T
        vw, vp = v_w[a0:a1], v_p[a0:a1, j]
        spread = vw @ w[:, j]  # whitened roundings mapped to the region's columns
        mean += float(spread.sum() + vp.sum())
        var += 2.0 * float(((vw @ (b * b)) * vw).sum() + 2.0 * (spread * vp).sum() + (vp * vp).sum())
    exact = local.sum(0).flatten()[lo:hi]
    fp32 = (cols + ranks) * EPS32 * float((local.abs().sum(0) @ t.abs() @ t_inv.abs()).flatten()[lo:hi].norm())
    return math.sqrt(mean + TAIL_SDS * math.sqrt(var)) + fp32 + buffer_u * float(exact.norm())


def two_sided_error_bound(
    local: torch.Tensor,
    roundings: list[Rounding],
    t: torch.Tensor | None,
    t_inv: torch.Tensor | None,
    t_out: tuple[torch.Tensor, torch.Tensor],
    region: slice | None = None,
    buffer_u: float = 0.0,
) -> float:
    """:func:`error_bound` of a two-sided reduction, ``U_r = T_outᵀ G_r T`` sent, ``T_out⁻ᵀ (Σ_r Q(U_r)) T⁻¹``
    received (``numerics.two_sided``). A whitened rounding ``e`` reaches ``(a, j)`` as
    ``Σ_{b,i} T_out⁻ᵀ[a, b] e[b, i] T⁻¹[i, j]``, so (2) becomes
    ``E E[a, j]² = Σ_{b,i} T_out⁻ᵀ[a, b]² V_w[b, i] T⁻¹[i, j]² + V_p[a, j]``, summed over the region
    for the mean. ``T_out`` mixes rows, so the variance uses ``tr(C²) ≤ λ_max(C) tr(C)`` with
    ``λ_max(C) ≤ ‖T_out⁻¹‖₂² ‖T⁻¹‖₂² max V_w + max V_p`` (``C``: the region's error covariance, a
    restriction of ``M diag(V) Mᵀ``, ``M`` the map above). FP32 work: the maps, the sums over ranks and
    ``P``'s all-reduce are sums of at most ``cols + rows + R`` terms each (the low-rank maps' ``r``
    included), within that many ``2^-24`` of ``|T_out⁻ᵀ| |T_outᵀ| Σ_r |G_r| |T| |T⁻¹|``."""
    local = local.double()
    ranks, rows, cols = local.shape
    eye = torch.eye(cols, dtype=torch.float64)
    t = eye if t is None else t.double()
    t_inv = eye if t_inv is None else t_inv.double()
    o, o_inv = (x.double() for x in t_out)
    zero = torch.zeros(rows, cols, dtype=torch.float64)
    v_w = sum((r.variance() for r in roundings if r.whitened), zero)
    v_p = sum((r.variance() for r in roundings if not r.whitened), zero)
    lo, hi = (0, rows * cols) if region is None else (region.start, region.stop)
    per_element = ((o_inv.T * o_inv.T) @ v_w @ (t_inv * t_inv) + v_p).flatten()[lo:hi]
    mean = float(per_element.sum())
    norm2 = lambda m: float(torch.linalg.matrix_norm(m, 2)) ** 2  # noqa: E731
    lam = norm2(o_inv) * norm2(t_inv) * float(v_w.max()) + float(v_p.max())
    var = 2.0 * lam * mean
    exact = local.sum(0).flatten()[lo:hi]
    magnitude = o_inv.T.abs() @ o.T.abs() @ local.abs().sum(0) @ t.abs() @ t_inv.abs()
    fp32 = (cols + rows + ranks) * EPS32 * float(magnitude.flatten()[lo:hi].norm())
    return math.sqrt(mean + TAIL_SDS * math.sqrt(var)) + fp32 + buffer_u * float(exact.norm())


def _row_blocks(first: int, last: int, lo: int, hi: int, cols: int):
    """``(row_lo, row_hi, column slice)``: the region's rows, whole ones in one block, cut ones alone."""
    cut = sorted({a for a in (first, last) if a * cols < lo or (a + 1) * cols > hi})
    whole_lo, whole_hi = first + (first in cut), last + 1 - (last in cut and last != first)
    if first in cut:
        yield first, first + 1, slice(lo - first * cols, min(hi - first * cols, cols))
    if whole_lo < whole_hi:
        yield whole_lo, whole_hi, slice(0, cols)
    if last in cut and last != first:
        yield last, last + 1, slice(0, hi - last * cols)


def fp32_sum_bound(local: torch.Tensor, buffer_u: float = 0.0) -> float:
    """``‖got − Σ_r G_r‖`` of a sum in FP32 (``off`` parameters): each element within
    ``(R − 1) 2^-24 Σ_r |G_r|`` of the exact sum (``R`` terms summed in some order), and the
    result's own rounding (``2^-24``, plus ``buffer_u`` for a lower-precision buffer).
    ``local [R, k]`` FP64."""
    local = local.double()
    exact = local.sum(0)
    per_element = (local.shape[0] - 1) * EPS32 * local.abs().sum(0) + (EPS32 + buffer_u) * exact.abs()
    return float(per_element.norm())


def reduced_rel_l2_bound(mantissa_bits: int, c: float, requantized: bool = False) -> float:
    """The module doc's RelL2 of a plain (``T = I``) reduction: ``(u/√3) c``, ``(u/√3) sqrt(c² + 1)``
    with the all-reduce's second rounding; ``c`` measured on the test's own gradients."""
    u = 2.0 ** -(mantissa_bits + 1)
    return u / math.sqrt(3) * (math.sqrt(c * c + 1) if requantized else c)


# --------------------------------------------------------------------------- one DDP's reduction


@dataclass(frozen=True)
class ReductionPath:
    """How a test set the reduction up: ``all_reduce`` (no distributed optimizer), and for the
    two-level exchange ``ranks_per_node`` (consecutive ranks of the reduction group; None: flat)
    with its intra-node wire dtype ``intra`` (``fp32``, ``bf16``, ``fp8``)."""

    all_reduce: bool = False
    ranks_per_node: int | None = None
    intra: str = "bf16"


def _mode(ddp, p, name, sent):
    """``(mode, output side, GiftParam)``: the mode and whether ``T_out`` was applied from ``sent``
    (``{name: testing.wire.WireRecord.mode}``, what went on the wire: ``+out`` for the output side)
    when given, else from the DDP's own state."""
    g = getattr(ddp, "gift_params", {}).get(p)
    if sent is not None:
        mode = sent[name] if name in sent else "off"
        return mode.removesuffix("+out"), mode.endswith("+out"), g
    out = (
        g is not None
        and g.mode.value == "gift"
        and g.output is not None
        and g.output.whitening is not None
        and g.output.whitening.rank > 0
    )
    return (g.mode.value if g is not None else "off"), out, g


def _roundings(
    mode: str, coded: torch.Tensor, plain: torch.Tensor, spacing: torch.Tensor, bits: int, path: ReductionPath
) -> list[Rounding]:
    """The roundings of one tensor: ``coded [R, rows, cols]`` its FP8 messages' values, ``plain`` the
    gradients, ``spacing [R]`` each rank's ``σ s`` bound."""
    node = path.ranks_per_node
    nodes = None if node is None else [slice(k, k + node) for k in range(0, coded.shape[0], node)]
    if mode == "bf16":
        out = [Rounding(plain, BF16_BITS, whitened=False)]
        if nodes is not None:
            out.append(Rounding(torch.stack([plain[k].sum(0) for k in nodes]), BF16_BITS, whitened=False))
        if path.all_reduce:
            out.append(Rounding(plain.sum(0, keepdim=True), BF16_BITS, whitened=False))
        return out
    out = []
    if nodes is None:
        out.append(Rounding(coded, bits, spacing))
    else:
        if path.intra == "fp8":
            out.append(Rounding(coded, bits, spacing))
        elif path.intra == "bf16":
            out.append(Rounding(plain, BF16_BITS, whitened=False))
        out.append(
            Rounding(
                torch.stack([coded[k].sum(0) for k in nodes]), bits, torch.stack([spacing[k].sum() for k in nodes])
            )
        )
    if path.all_reduce:
        out.append(Rounding(coded.sum(0, keepdim=True), bits, spacing.sum()))
    return out


def reduction_errors(
    ddp,
    local: dict,
    scale_of,
    path: ReductionPath = ReductionPath(),
    owned=None,
    residuals: dict | None = None,
    buffer_u: float = 0.0,
    sent: dict[str, str] | None = None,
) -> list[tuple[str, str, float, float]]:
    """``(parameter name, mode, ‖got − scale Σ_r (G_r + ε_r)‖, bound)`` over each parameter's part of
    its bucket that this rank holds after the reduction, the bound by the module doc for the mode:
    FP32 sums for ``off``, BF16 roundings for ``bf16``, FP8 of ``G_r T`` (``T`` the parameter's
    current ``whitening`` in GIFT mode, else ``I``; ``T_outᵀ G_r T`` with its output side's ``whitening``)
    for ``euclidean`` / ``gift``.

    ``local``: ``{param: [ranks, numel]}`` (``megatron_gift.testing.reference.gathered_local_gradients``);
    ``scale_of(param)``: its scaling; ``owned(bucket group, bucket) -> slice`` of ``grad_data``
    (default: all of it); ``residuals``: ``{param: [ranks, numel]}`` error-feedback residuals carried
    into this step, in the gradient's coordinates (counted for parameters sent in FP8 this step: a
    switch to BF16 drops them); ``buffer_u``: 2^-8 for a BF16 gradient buffer; ``sent``: each
    parameter's mode as the wire record saw it (``testing.wire.WireRecord.mode``; a parameter it does
    not name is ``off``; ``+out``: with the output side): the bound then follows what was sent (``T``
    and ``T_out`` only where they were applied), not what the DDP says it sent."""
    # stock Megatron's DDP (every parameter off, FP32 sums) has no codec: the default one is never read
    codec = ddp.gift_config.wire.codec if hasattr(ddp, "gift_config") else CodecConfig()
    bits, sigma, fmax = fp8_format(codec.fmt.dtype)
    mx = codec.scaling.value == "mx"  # power-of-two scales, rounded up: s < 2 amax / fmax
    names = {p: n for n, p in ddp.module.named_parameters()}
    out = []
    for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for bucket in bg.buckets:
            region = slice(
                *(owned(bg, bucket) if owned is not None else slice(None)).indices(bucket.grad_data.numel())[:2]
            )
            entries = {}
            for p, (a, b) in bucket.param_to_index.items():
                mode, with_out, g = _mode(ddp, p, re.sub(r"^(module\.)+", "", names[p]), sent)  # the DDP's names
                rows = p.shape[0] if p.dim() > 1 else 1
                plain = local[p].view(-1, rows, (b - a) // rows).double()
                if residuals is not None and p in residuals and mode in ("euclidean", "gift"):  # BF16 drops it
                    plain = plain + residuals[p].view_as(plain).double()
                t = g.input.whitening.dense() if mode == "gift" and g.input.whitening is not None else (None, None)
                coded = plain if t[0] is None else plain @ t[0].double()
                t_out = None  # an output side applied (--gift-side both / auto): U = T_outᵀ G T
                if with_out:
                    t_out = g.output.whitening.dense()
                    coded = t_out[0].double().T @ coded
                entries[p] = (a, b, mode, plain, coded, t, t_out)
            maxima = [e[4].abs().flatten(1).amax(1) for e in entries.values() if e[2] in ("euclidean", "gift")]
            # the largest scale a rank's group can have: groups may straddle parameters of the bucket
            spacing = sigma * (2 if mx else 1) * torch.stack(maxima).amax(0) / fmax if maxima else None
            for p, (a, b, mode, plain, coded, t, t_out) in entries.items():
                lo, hi = max(a, region.start), min(b, region.stop)
                if lo >= hi:
                    continue
                scale = scale_of(p)
                want = scale * plain.flatten(1)[:, lo - a : hi - a].sum(0)
                err = float((bucket.grad_data[lo:hi].double() - want).norm())
                if mode == "off":
                    bound = fp32_sum_bound(plain.flatten(1)[:, lo - a : hi - a], buffer_u)
                else:
                    rounds = _roundings(mode, coded, plain, spacing, bits, path)
                    bound = error_bound(plain, rounds, *t, region=slice(lo - a, hi - a), buffer_u=buffer_u, t_out=t_out)
                out.append((names[p], mode, err, scale * bound))
    return out


# --------------------------------------------------------------------------- FP32 low-rank transforms


def lowrank_magnitudes(w) -> tuple[torch.Tensor, torch.Tensor]:
    """Componentwise magnitudes ``(M, M')`` (FP64 ``[d, d]``) of a ``LowRankWhitening``'s FP32
    evaluation, so that ``|fl(G T) − G T| ≤ γ |G| M`` and ``|fl(U T⁻¹) − U T⁻¹| ≤ γ |U| M'`` with
    ``γ = (d + r + 6) 2^-24``, ``T`` the exact transform of the FP64 factor it was built from.

    ``G T = G' + ((G' Q) ⊙ c) Qᵀ``, ``G' = G D^{-1/2}``: each output is a sum of at most
    ``d + r + 1`` products of stored values, each stored value one FP32 rounding of its FP64 one
    (``D^{-1/2}``, ``Q``, ``c``; three more ``2^-24``), so its error is within ``γ`` of the sum of
    the products' magnitudes: ``|G| |D^{-1/2}| (I + |Q| |c| |Q|ᵀ)``; ``U T⁻¹`` likewise with
    ``(I + |Q| |c'| |Q|ᵀ) |D^{1/2}|``."""
    q, c, c_inv = (w.q.double().abs(), w.c.double().abs(), w.c_inv.double().abs())
    eye = torch.eye(q.shape[0], dtype=torch.float64)
    m = w.d_inv_sqrt.double().abs().unsqueeze(1) * (eye + (q * c) @ q.T)
    m_inv = (eye + (q * c_inv) @ q.T) * w.d_sqrt.double().abs()
    return m, m_inv


def lowrank_gamma(w) -> float:
    """``γ`` of :func:`lowrank_magnitudes`."""
    return (w.d_in + w.rank + 6) * EPS32
