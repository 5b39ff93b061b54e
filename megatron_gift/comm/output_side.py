"""Output-side (two-sided) whitening around one bucket's quantized reduction: ``U = T_outᵀ G T_in``
sent, ``G = T_out⁻ᵀ V T_in⁻¹`` received (``numerics/two_sided.py``), for the segments given a ``T_out``.

The inner reduction (``QuantizedReduce`` or ``TwoLevelReduce``, reduce-scatter or all-reduce) does
everything of ``T_in``, the quantization, the sums and averaging; ``T_out``'s maps commute with it
(they act on the other side of ``G``). On rank ``r`` of ``p``, ``W = V T_in⁻¹`` (÷ p when averaging),
the stages are the inner's, extended::

    0    the inner's send, which encodes T_outᵀ G T_in (``outputs`` in its handoff: ``T_outᵀ`` applied row by
         row in the encode pass, ``X = D^{-1/2} G + Q Pre``, ``Pre = c ⊙ Qᵀ D^{-1/2} G`` from the
         read of G that gives T_in's projection: ``kernels.whiten_encode``'s ``output``)
    1..  the inner's stages; from stage 1 on it writes the two-sided segments' W on the rank's
         elements (its shard's part; all-reduce: the whole segment) into FP32 ``targets``, not the bucket
    L    the inner's last stage, then P = Qᵀ W [r_out, d_in] of every two-sided segment, packed in
         one FP32 buffer: reduce-scatter: the rank's partials Q[rows]ᵀ W[rows, cols] over its elements
         (``output_projection``: head piece, whole rows, tail piece), summed over the group by one
         asynchronous all-reduce (the ledger's ``all_reduce/fp32-out``); all-reduce: the whole P
         locally, no collective
    L+1  G = D^{1/2} (W + Q (c' ⊙ P)) on the rank's elements (``kernels.output_inverse``: one Triton
         launch per segment on the fused path, ``two_sided.output_inverse`` on the PyTorch one), written
         into the bucket once, in its dtype; the stage's ``nonfinite`` flag set where it holds a NaN/Inf

The bucket is only read at the sender and written only on the rank's elements (reduce-scatter:
nothing outside its shard). Each stage adds a fixed few ops per two-sided segment, whatever the
bucket's element count and the group's size; no host synchronisation. Temporaries: ``Pre``
(``4·r_out·d_in`` bytes per two-sided parameter) and on the fused path its per-program parts
(``r_out/32`` bytes per element, ``kernels.fused.OUTPUT_ROWS``) during its encode only, the
targets (FP32, the rank's elements of them) from stage 1 to the end, ``P`` (``4·Σ r_out·d_in``
bytes) from stage L. Error feedback needs nothing here: its residual is that of the encoded
values, in ``U``'s coordinates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..numerics.two_sided import output_projection
from ..numerics.whitening import LowRankWhitening
from .layout import FP8_MODES
from .ledger import CommLedger, ring_all_reduce_bytes
from .quantized import ShardReduction
from .schedule import StageResult, Wrapping, then

LEDGER_DTYPE = "fp32-out"  # the ledger's name of P's all-reduce (``all_reduce/fp32-out``)


class OutputSide(Wrapping):
    """``inner`` with ``T_out = outputs[i]`` on layout segment ``i`` (None: no output side there), the
    module doc's stages; ``ledger`` gets the bytes of P's all-reduce. Construction does no work."""

    def __init__(self, inner: ShardReduction, outputs: list[LowRankWhitening | None], ledger: CommLedger):
        layout = inner.layout
        if len(outputs) != len(layout.segments):
            raise ValueError(f"{len(outputs)} output-side transforms for {len(layout.segments)} segments")
        for s, w in zip(layout.segments, outputs):
            if w is not None and (s.mode not in FP8_MODES or w.d_in != s.rows):
                raise ValueError(
                    f"megatron-gift: an output-side transform of {w.d_in} rows for parameter {s.name!r} "
                    f"({s.rows} x {s.cols}, mode {s.mode.value}): only FP8-coded parameters, d_out rows"
                )
        self.inner, self.outputs, self.ledger = inner, outputs, ledger
        self.p_at, pos = {}, 0  # two-sided segment -> its P's first element in the packed buffer
        for i, w in enumerate(outputs):
            if w is not None:
                self.p_at[i], pos = pos, pos + w.rank * layout.segments[i].cols
        self.p_numel = pos
        self.sender = {i: outputs[i] for i in self.p_at}  # the sender's T_outᵀ (stage 0)
        # the rank's elements of each two-sided segment, bucket positions [lo, hi)
        if inner.all_reduce:
            self.owned = {i: (layout.segments[i].start, layout.segments[i].end) for i in self.p_at}
        else:
            self.owned = {p.seg: (p.lo, p.hi) for p in layout.shards[inner.rank].coded_parts if p.seg in self.p_at}

    def stages(self) -> list:
        """The inner's stages given ``outputs`` (stage 0) and the ``targets`` (from stage 1 on, handed on
        by each), the last one followed by the projections (``then``), and the output stage."""
        inner = self.inner.stages()

        def given(k, stage):
            def run(prev: StageResult) -> StageResult:
                if k == 0:
                    return stage(StageResult(outputs=self.sender))
                targets = self._targets() if k == 1 else prev.targets
                step = stage(StageResult(works=prev.works, **{**prev.handoff, "targets": targets}))
                return StageResult(works=step.works, **{**step.handoff, "targets": targets})

            run.__name__ = getattr(stage, "__name__", f"stage {k}")  # the meter's stage names
            return run

        stages = [given(k, s) for k, s in enumerate(inner)]
        return [*stages[:-1], then(stages[-1], self._projections), self._output]

    def _targets(self) -> dict:
        """FP32 tensors receiving ``W`` on the rank's elements of each two-sided segment."""
        device = self.inner.flat.device
        return {i: (torch.empty(hi - lo, device=device), lo) for i, (lo, hi) in self.owned.items()}

    def _p(self, proj: torch.Tensor, i: int) -> torch.Tensor:
        return proj[self.p_at[i] : self.p_at[i] + self.outputs[i].rank * self.inner.layout.segments[i].cols].view(
            self.outputs[i].rank, -1
        )

    def _projections(self, step: StageResult) -> StageResult:
        """``P`` of every two-sided segment (module doc, stage L): the rank's partials, launched into
        their all-reduce with reduce-scatter; the whole ``P`` with all-reduce."""
        inner, layout, targets = self.inner, self.inner.layout, step.targets  # the inner's last handoff holds them
        proj = torch.zeros(self.p_numel, device=inner.flat.device)
        for i, (lo, _hi) in self.owned.items():
            s = layout.segments[i]
            output_projection(self.outputs[i], targets[i][0], s.cols, lo - s.start, self._p(proj, i))
        # P, allocated on this stage's stream, is read by the next one: in the handoff, collective or not
        if inner.all_reduce or inner.world == 1 or self.p_numel == 0:  # the same answer on every rank
            return StageResult(works=step.works, **step.handoff, proj=proj)
        # its own ledger dtype: apart from the refresh's and the instances' FP32 all-reduces
        self.ledger.add("all_reduce", LEDGER_DTYPE, ring_all_reduce_bytes(inner.world, 4 * self.p_numel))
        work = dist.all_reduce(proj, group=inner.group, async_op=True)
        return StageResult(works=[*step.works, work], **step.handoff, proj=proj)

    def _output(self, prev: StageResult) -> StageResult:
        """``T_out⁻ᵀ W`` on the rank's elements, into the bucket (module doc, stage L+1)."""
        inner, layout = self.inner, self.inner.layout
        for i, (lo, hi) in self.owned.items():
            s, dest = layout.segments[i], inner.flat[lo:hi]
            inner.ops.output_inverse(
                self.outputs[i], prev.targets[i][0], s.cols, lo - s.start, self._p(prev.proj, i), dest
            )
            if inner.nonfinite is not None:  # this stage's own flag (``ShardReduction._reduced``)
                inner.nonfinite.mark(self.stage, dest)
        return StageResult()
