"""Two-sided (K-FAC) whitening of a weight gradient: the input-side map of ``whitening`` plus the
same construction on the output side.

Shapes: gradient ``G [d_out, d_in]``; input factor ``A = E[a aᵀ]`` ``[d_in, d_in]`` over the
layer's input activations ``a``, output factor ``B = E[g gᵀ]`` ``[d_out, d_out]`` over the
gradients ``g`` of the layer's outputs (one per token, as seen by a backward hook). K-FAC models
the covariance of ``vec G`` as ``A ⊗ B``. Both factors are approximated alike
(``whitening.approximate_factor`` / ``factor_from_sketch``: top-r plus damped residual diagonal,
damping relative to the factor's own mean diagonal), giving ``T_in`` (``T_inᵀ Â T_in = I``) and
``T_out`` (``T_outᵀ B̂ T_out = I``), each a ``LowRankWhitening``. Then::

    U = T_outᵀ G T_in            (sender; [d_out, d_in])
    G = T_out⁻ᵀ U T_in⁻¹         (receiver)

and ``Cov(vec U) = (T_inᵀ Â T_in) ⊗ (T_outᵀ B̂ T_out) = I``. ``T_outᵀ G = (Gᵀ T_out)ᵀ``, so the
output side is ``LowRankWhitening.apply`` on the transpose: O(d_out·d_in·(r_in + r_out)) time,
O(d_in·r_in + d_out·r_out) memory. Both maps are linear and identical on every rank, so the sum
over ranks commutes with them as for the input side alone. Relative damping keeps the map
invariant to the scale of ``B`` (a loss scale, ``1/num_microbatches``), as long as the statistics
of one EMA share that scale.

What the output side changes in the reduction protocol (``comm/output_side.py``; its row-block maps,
``OutputRows`` (the sender's), ``output_projection``, ``output_inverse``, are at the end of this module):

* **Row sharding.** ``U T_in⁻¹`` mixes entries within a row; ``T_out⁻ᵀ V = D_out^{1/2}(V + Q_out
  diag(c') Q_outᵀ V)`` mixes rows. With the distributed optimizer a rank holds a contiguous
  shard of the summed ``U`` that cuts through rows, and its rows of ``G`` need
  ``P = Q_outᵀ V`` (``[r_out, d_in]``), a sum over *all* rows of the parameter: every shard owner
  adds its rows' (and row pieces') partial ``Q_out[rows]ᵀ V[rows]`` and the partials are summed
  over the reduction group (an all-reduce of ``r_out·d_in`` FP32 per parameter per step, after the
  reduce-scatter, before the optimizer reads the shard), then
  ``G[rows] = D_out^{1/2}[rows] (V[rows] + Q_out[rows] diag(c') P)``. Its payload is
  ``4·r_out·d_in`` bytes against the parameter's ``d_out·d_in`` FP8 bytes, ``4·r_out/d_out``
  (10% for ``r_out = 32``, ``d_out = 1280``; 2% for ``d_out = 6912``), and a ring all-reduce sends
  about twice its payload per rank where the reduce-scatter sends about once. A parameter that no
  shard boundary cuts (all-reduce without the distributed optimizer, or one held by a single rank)
  needs nothing. (The partials of ``P`` can travel in the same exchange as the input side's
  per-split-row projections: ``(U + Q_out c' P) Q_in = U Q_in + Q_out c' (P Q_in)``.)
* **No row-local shortcut.** A diagonal ``T_out`` (rank 0) scales whole rows, and a 1x128 block
  lies within one row, so with block (or row) scales it changes the FP8 round trip only by the
  rounding of the FP32 scales: whatever the output side gains comes with its rank-``r_out`` part,
  which mixes rows.
* **Tensor parallelism.** A column-parallel weight ``[d_out/tp, d_in]`` sees the output gradients
  of its own output columns: its local ``B`` is a diagonal block of the full one and whitening per
  TP shard with it needs no TP communication. A row-parallel weight ``[d_out, d_in/tp]`` sees all
  ``d_out`` outputs; without sequence parallelism every TP rank sees the same output gradients, with
  it only ``s/tp`` tokens: all-reduce the partial sums over the TP group (a TP rank using its own
  tokens alone would still be consistent within its data-parallel group, just noisier). The EMA is
  linear in the per-step sums (``kfac``), so that TP sum can ride on the refresh's statistics
  all-reduce (over the TP x DP group) instead of running every step.

No torch.distributed here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .whitening import LowRankWhitening, ieee_fp32


class TwoSidedWhitening:
    """``U = T_outᵀ G T_in`` and its inverse (module doc), from two ``LowRankWhitening``s; either may be
    ``LowRankWhitening.identity`` (input side only: ``T_out = I``; output side only: ``T_in = I``)."""

    def __init__(self, input_side: LowRankWhitening, output_side: LowRankWhitening):
        self.input_side, self.output_side = input_side, output_side

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """``T_outᵀ G T_in`` for ``G [..., d_out, d_in]``."""
        return self.output_side.apply(self.input_side.apply(g).mT).mT

    def inverse(self, u: torch.Tensor) -> torch.Tensor:
        """``T_out⁻ᵀ U T_in⁻¹`` for ``U [..., d_out, d_in]``."""
        return self.output_side.inverse(self.input_side.inverse(u).mT).mT


def sent_map(t_in: LowRankWhitening | None, t_out: LowRankWhitening | None):
    """The map a parameter's gradient is sent through: ``T_in`` alone (None: no ``T``), or
    ``TwoSidedWhitening`` where it has an output side ``t_out``."""
    return TwoSidedWhitening(t_in, t_out) if t_out is not None else t_in


# -- the output side's row-block maps, as the reduction runs them (comm/output_side.py) -------------
# ``w``: ``T_out``, a ``LowRankWhitening`` over the ``d_out`` rows (``q [d_out, r]``, ``c``, ``c_inv``
# ``[r]``, ``d_inv_sqrt``, ``d_sqrt [d_out]``); all maps in FP32 (full FP32 on CUDA: ``ieee_fp32``).


@dataclass(frozen=True)
class OutputRows:
    """The sender's ``T_outᵀ`` on rows of a parameter ``G [d_out, d_in]``, as the encode pass applies it
    row by row: ``X[rows] = D^{-1/2}[rows] G[rows] + Q[rows] Pre``, where ``Pre = c ⊙ Qᵀ (D^{-1/2} G)``
    ``[r, d_in]`` sums over *all* rows (``X + Q (c ⊙ Qᵀ X)`` with ``X = D^{-1/2} G``). ``d_inv_sqrt [rows]``,
    ``q [rows, r]``: ``T_out``'s on these rows; ``pre``: None until computed from the whole ``G``
    (``with_pre``; the fused kernels compute it in the read of ``G`` that gives the input side's
    projection: ``kernels/fused.py``)."""

    d_inv_sqrt: torch.Tensor
    q: torch.Tensor
    c: torch.Tensor
    pre: torch.Tensor | None = None

    @classmethod
    def of(cls, w: LowRankWhitening) -> OutputRows:
        """All rows of ``T_out = w``, ``Pre`` not yet known."""
        return cls(w.d_inv_sqrt, w.q, w.c)

    @property
    def rank(self) -> int:
        return self.q.shape[1]

    def rows(self, r0: int, r1: int) -> OutputRows:
        """Rows ``[r0, r1)`` of these (``Pre`` known: it is the whole parameter's)."""
        return OutputRows(self.d_inv_sqrt[r0:r1], self.q[r0:r1], self.c, self.pre)

    def with_pre(self, g: torch.Tensor) -> OutputRows:
        """These rows with ``Pre`` from ``g`` (all ``d_out`` rows of the parameter, any float dtype) where
        not known yet: ``((D^{-1/2} Q) c)ᵀ G``, one matmul over ``G`` (an FP32 copy of a narrower ``g``)."""
        if self.pre is not None:
            return self
        if g.shape[0] != self.q.shape[0]:
            raise ValueError(f"Pre sums over all {self.q.shape[0]} rows of the parameter, got {g.shape[0]}")
        with ieee_fp32(g.device):
            pre = (self.q * self.d_inv_sqrt[:, None] * self.c).T @ g.float()
        return OutputRows(self.d_inv_sqrt, self.q, self.c, pre)

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """``X = T_outᵀ G`` on these rows (``g [rows, d_in]``, any float dtype; ``Pre`` known) as a new FP32
        tensor: ``D^{-1/2} G`` (one pass), then ``+ Q Pre`` (one ``addmm_``)."""
        x = g * self.d_inv_sqrt[:, None]  # FP32 whatever g's dtype (type promotion)
        if self.rank == 0:
            return x
        with ieee_fp32(x.device):
            return x.addmm_(self.q, self.pre)


def row_blocks(cols: int, e0: int, e1: int) -> list[tuple[int, int, int, int, int]]:
    """Elements ``[e0, e1)`` (row-major) of a ``[rows, cols]`` matrix as at most three blocks
    ``(offset from e0, first row, rows, c0, c1)``: a head piece of the row ``e0`` starts inside, the
    whole rows, a tail piece of the row ``e1`` ends inside (one piece when both lie in one row)."""
    blocks, pos = [], e0
    if pos % cols:
        end = min(e1, (pos // cols + 1) * cols)
        blocks.append((0, pos // cols, 1, pos % cols, end - pos // cols * cols))
        pos = end
    full = (e1 - pos) // cols
    if full:
        blocks.append((pos - e0, pos // cols, full, 0, cols))
        pos += full * cols
    if pos < e1:
        blocks.append((pos - e0, pos // cols, 1, 0, e1 - pos))
    return blocks


def _block(values: torch.Tensor, offset: int, rows: int, c0: int, c1: int) -> torch.Tensor:
    return values[offset : offset + rows * (c1 - c0)].view(rows, c1 - c0)


def output_projection(w: LowRankWhitening, values: torch.Tensor, cols: int, e0: int, out: torch.Tensor) -> None:
    """``out += Q[rows]ᵀ W[rows, cols]`` (``out [r, cols]`` FP32) for ``W``'s elements ``[e0, e0 + n)``
    given flat (``values [n]``, FP32): the part of ``P = Qᵀ W`` these elements contribute (summed
    over the owners of a parameter's elements, ``P`` is whole). One ``addmm_`` per ``row_blocks``
    block: ``out[:, c0:c1] += Q[i0:i1]ᵀ W[i0:i1, c0:c1]``."""
    with ieee_fp32(values.device):
        for offset, i0, n, c0, c1 in row_blocks(cols, e0, e0 + values.numel()):
            out[:, c0:c1].addmm_(w.q[i0 : i0 + n].T, _block(values, offset, n, c0, c1))


def output_inverse(
    w: LowRankWhitening, values: torch.Tensor, cols: int, e0: int, proj: torch.Tensor, out: torch.Tensor
) -> None:
    """``T_out⁻ᵀ W`` on ``W``'s elements ``[e0, e0 + n)`` (``values [n]`` FP32) from the whole ``P = Qᵀ W``
    (``proj [r, cols]``): ``G[i, j] = d_sqrt[i] (W[i, j] + Σ_k Q[i, k] c'_k P[k, j])``, computed in FP32
    and written once into ``out [n]`` (any float dtype: rounded once). Per ``row_blocks`` block an
    ``addmm`` and a ``mul`` into ``out``, plus one ``c' ⊙ P``."""
    with ieee_fp32(values.device):
        cp = proj * w.c_inv[:, None]
        for offset, i0, n, c0, c1 in row_blocks(cols, e0, e0 + values.numel()):
            g = torch.addmm(_block(values, offset, n, c0, c1), w.q[i0 : i0 + n], cp[:, c0:c1])
            torch.mul(g, w.d_sqrt[i0 : i0 + n, None], out=_block(out, offset, n, c0, c1))
