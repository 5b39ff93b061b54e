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

What the output side changes in the reduction protocol (not in this module):

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

import torch

from .whitening import LowRankWhitening


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
