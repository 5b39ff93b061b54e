"""Independent references for tests: FP8 group scales and round trips written from the OCP definition
with torch's own FP8 cast (not ``megatron_gift.numerics.fp8``), for finite inputs; the FP32 rank sum
in order; and a dense FP64 whitening built from its definition, against which a runtime transform's
results are held (``CheckedWhitening``)."""

import math

import torch

from tests.bounds import EPS32, lowrank_gamma, lowrank_magnitudes


def fp8_scales(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, width: int | None = 128, power_of_two: bool = False
) -> torch.Tensor:
    """Per-element dequantization scale of ``x [rows, cols]``: ``s = max|group| / fp8_max`` in FP32
    over each group of ``width`` consecutive elements of a row (``None``: the whole tensor; the row
    width: one group per row), clamped to FP32's smallest normal, 1 for a group of zeros;
    ``power_of_two`` (MX): ``2^ceil(log2 s)`` by ``math.frexp`` (the maximum never exceeds ``fp8_max``)."""
    fmax = torch.finfo(dtype).max
    x = x.float()
    groups = [x.reshape(1, -1)] if width is None else list(x.split(width, dim=1))
    out = []
    for grp in groups:
        amax = grp.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, (amax / fmax).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
        if power_of_two:  # the FP32 s rounded up to a power of two: 2^ceil(log2 s) from frexp
            exps = [math.frexp(v)[1] - (math.frexp(v)[0] == 0.5) for v in s.double().flatten().tolist()]
            s = torch.tensor([2.0**e for e in exps], dtype=torch.float32).view_as(amax)
        out.append(s.expand_as(grp))
    return out[0].reshape(x.shape) if width is None else torch.cat(out, dim=1)


def fp8_roundtrip(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, width: int | None = 128, power_of_two: bool = False
) -> torch.Tensor:
    """``round(x / s) · s`` with :func:`fp8_scales`' ``s`` (saturating at ``fp8_max``)."""
    fmax = torch.finfo(dtype).max
    s = fp8_scales(x, dtype, width, power_of_two)
    return (x.float() / s).clamp(-fmax, fmax).to(dtype).float() * s


def fp8_roundtrip_groups(
    x: torch.Tensor, lengths, dtype: torch.dtype = torch.float8_e4m3fn, power_of_two: bool = False
) -> torch.Tensor:
    """:func:`fp8_roundtrip` of the flat ``x`` with one scale per run of ``lengths`` (a list of
    ints summing to ``x.numel()``): each run rounded on its own, as a one-row tensor-scaled matrix."""
    out, pos = [], 0
    for n in lengths:
        out.append(fp8_roundtrip(x[pos : pos + n].reshape(1, -1), dtype, None, power_of_two).reshape(-1))
        pos += n
    assert pos == x.numel(), (pos, x.numel())
    return torch.cat(out) if out else x.float().new_zeros(0)


def ordered_sum(values) -> torch.Tensor:
    """FP32 sum in the given (rank) order: ``acc = x_0``, then ``acc += x_i``, written out here so that
    a test's reference stays independent of ``kernels.ordered_sum``, the runtime's."""
    acc = values[0].float().clone()
    for t in values[1:]:
        acc += t.float()
    return acc


def scaling_groups(rows: int, cols: int, start: int, shard_size: int, scaling: str, block: int = 128) -> list[int]:
    """Lengths (row-major order) of the scaling groups of a ``[rows, cols]`` parameter at bucket offset
    ``start`` in a bucket cut into shards of ``shard_size``: per tensor, row, or ``block`` columns
    (``mx``: 32) of a row, each further cut where a shard boundary falls inside it."""
    pos = torch.arange(rows * cols)
    width = {"tensor": rows * cols, "row": cols}.get(scaling, 32 if scaling == "mx" else block)
    group = pos // cols * cols + (pos % cols) // width if scaling != "tensor" else torch.zeros_like(pos)
    shard = (start + pos) // shard_size
    key = group * (10**9) + shard  # a new group wherever the parameter's group or the shard changes
    change = torch.ones(rows * cols, dtype=torch.bool)
    change[1:] = key[1:] != key[:-1]
    firsts = torch.nonzero(change).flatten().tolist() + [rows * cols]
    return [b - a for a, b in zip(firsts[:-1], firsts[1:])]


def dense_whitening(
    a: torch.Tensor, rank: int, damping: float = 1e-3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Â, T, T⁻¹)`` in FP64 from the factor ``A`` by numerics/whitening.py's definitions, densely:
    ``Â = D + V Λ Vᵀ`` (top-``rank`` eigenpairs of ``A``, ``D`` the residual diagonal clamped at 0 plus
    ``δ·mean(diag A)``); ``T = D^{-1/2} B^{-1/2}`` with ``B = D^{-1/2} Â D^{-1/2}`` (the documented
    ``D^{-1/2}(I + Q diag(c) Qᵀ)``, ``I + Q diag(s) Qᵀ = B``: ``Tᵀ Â T = I``), from one ``d x d`` eigh
    (the runtime takes the ``r x r`` Gram of ``W`` instead)."""
    a64 = a.double()
    a64 = 0.5 * (a64 + a64.T)
    evals, evecs = torch.linalg.eigh(a64)
    k = a64.shape[0] - rank  # the top ``rank`` pairs (eigh: ascending)
    v, lam = evecs[:, k:], evals[k:].clamp_min(0.0)
    d = (torch.diagonal(a64) - (v * v) @ lam).clamp_min(0.0) + damping * torch.diagonal(a64).mean()
    a_hat = torch.diag(d) + (v * lam) @ v.T
    b = a_hat / torch.outer(d.sqrt(), d.sqrt())
    s, u = torch.linalg.eigh(0.5 * (b + b.T))
    t = (u * s.rsqrt()) @ u.T / d.sqrt().unsqueeze(1)
    t_inv = (u * s.sqrt()) @ u.T * d.sqrt()
    return a_hat, t, t_inv


class CheckedWhitening:
    """The runtime transform ``w`` as a test's reference uses it, each result held to the dense FP64
    ``T`` / ``T⁻¹`` (``dense_whitening``) elementwise within ``γ |X| M`` (tests/bounds.py's
    ``lowrank_magnitudes``; FP64's own error of ``T`` is ~1e-12 of it, allowed as 1e-9) and
    returned as the runtime computed it. A cut row: each piece's ``U Q[cols]`` is kept, and the
    finished pieces of a row are checked together, once the last one is done (``γ`` grows by the
    pieces' extra sums: 4 roundings more)."""

    def __init__(self, w, t, t_inv):
        self.w, self.t, self.t_inv = w, t, t_inv
        self.m, self.m_inv = lowrank_magnitudes(w)
        self.gamma = lowrank_gamma(w)
        self.checked = 0
        self.rows = {}  # a cut row's pieces so far: {id(proj): [(cols, u, finished)]}

    def _check(self, x, got, exact, mags, gamma):
        x = x.double()
        err = (got.double() - x @ exact).abs()
        bound = gamma * (x.abs() @ mags) + 1e-9 * (x.abs() @ exact.abs())
        assert bool((err <= bound).all()), (
            f"T departs from its dense definition: excess {(err - bound).max().item():.3e}"
        )
        self.checked += 1

    def apply(self, g):
        out = self.w.apply(g)
        self._check(g, out, self.t, self.m, self.gamma)
        return out

    def inverse(self, u):
        out = self.w.inverse(u)
        self._check(u, out, self.t_inv, self.m_inv, self.gamma)
        return out

    def projection(self, u, cols):
        return self.w.projection(u, cols)

    def inverse_piece(self, u, proj, cols):
        out = self.w.inverse_piece(u, proj, cols)
        pieces = self.rows.setdefault(id(proj), [])
        pieces.append((cols, u.clone(), out.clone()))
        if sum(c.stop - c.start for c, _, _ in pieces) == self.w.d_in:  # the whole row: check it
            pieces.sort(key=lambda p: p[0].start)
            row_u, row_out = (torch.cat([p[k] for p in pieces], 1) for k in (1, 2))
            self._check(row_u, row_out, self.t_inv, self.m_inv, self.gamma + 4 * EPS32)
            del self.rows[id(proj)]
        return out


def output_side(gp):
    """``gp.output``, or an empty ``SideState`` where the layer has no output side (its fields all None),
    for tests that read an output side's fields on every layer."""
    from megatron_gift.state import SideState

    return gp.output if gp.output is not None else SideState()
