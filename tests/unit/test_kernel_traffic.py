"""The ``TRAFFIC`` entries of the kernels with whitening against what their programs load, counted by
Triton's interpreter.

The meter (``bench launches``) and the planner price each launch by ``TRAFFIC``; a formula that
counts a tensor once per launch hides a tiling whose programs each reload it (issue 35 item 3: the
GIFT sender's ``_GROUPS`` tiling gathered ``Qᵀ`` per element, ~4·r bytes, against 2 of gradient).
Here every load of a launch of the sender (``_encode_kernel``), the projection, ``T⁻¹`` and the placed
cast is counted as the interpreter runs it (the distinct addresses each program reads, in bytes) and the
entry must agree. The counting needs the interpreter
on before the kernels are defined: ``test_traffic_under_interpreter`` runs this file again in a fresh
process with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatron_gift.numerics.fp8 import CodecConfig
from megatron_gift.testing.kernel_log import assert_passes_under_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class _ProgramLoads:
    """Bytes of the distinct addresses each program loads, summed over the programs of the launches
    made while active (the interpreter's builder patched)."""

    def __init__(self):
        from triton.runtime import interpreter

        self.builder = interpreter.InterpreterBuilder
        self.total, self.seen = 0, set()

    def _add(self, ptrs, mask):
        size = np.dtype(interpreter_np_dtype(ptrs)).itemsize
        addresses = ptrs.data if mask is None else ptrs.data[mask.data.astype(bool)]
        for a in np.unique(addresses):
            if a not in self.seen:
                self.seen.add(a)
                self.total += size

    def __enter__(self):
        b, counter = self.builder, self
        self.saved = (b.set_grid_idx, b.create_masked_load, b.create_load)
        grid, masked, plain = self.saved

        def set_grid_idx(self, x, y, z):
            counter.seen = set()  # a new program: its loads count afresh
            return grid(self, x, y, z)

        def create_masked_load(self, ptrs, mask, other, *a):
            counter._add(ptrs, mask)
            return masked(self, ptrs, mask, other, *a)

        def create_load(self, ptr, *a):
            counter._add(ptr, None)
            return plain(self, ptr, *a)

        b.set_grid_idx, b.create_masked_load, b.create_load = set_grid_idx, create_masked_load, create_load
        return self

    def __exit__(self, *exc):
        self.builder.set_grid_idx, self.builder.create_masked_load, self.builder.create_load = self.saved


def interpreter_np_dtype(ptrs):
    from triton.runtime.interpreter import _get_np_dtype

    return _get_np_dtype(ptrs.get_element_ty())


def _counted_launches(fn, name="_encode_kernel", module=None):
    """``[(bound args, loaded bytes)]`` of the launches of ``<module>.<name>`` (``kernels.fused`` by
    default) that ``fn`` makes."""
    from megatron_gift.kernels import fused

    module = module or fused
    kernel, out = getattr(module, name), []

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                with _ProgramLoads() as loads:
                    kernel[grid](*args, **kwargs)
                out.append((dict(zip(kernel.arg_names, args), **kwargs, grid=tuple(grid)), loads.total))

            return launch

    setattr(module, name, Counted())
    try:
        fn()
    finally:
        setattr(module, name, kernel)
    return out


def _whitening(cols: int, r: int, gen: torch.Generator):
    """A rank-``r`` whitening of ``cols`` inputs with every factor filled (the sender's and the receiver's)."""
    from megatron_gift.numerics.whitening import LowRankWhitening

    w = LowRankWhitening.empty(cols, r)
    w.q.copy_(torch.randn(cols, r, generator=gen) / 16)
    w.d_inv_sqrt.copy_(torch.rand(cols, generator=gen) + 0.5)
    w.c.copy_(torch.rand(r, generator=gen))
    w.d_sqrt.copy_(w.d_inv_sqrt.reciprocal())
    w.c_inv.copy_(torch.rand(r, generator=gen))
    return w


if INTERPRET:

    @pytest.mark.parametrize("cols", [256, 2048])
    @pytest.mark.parametrize("lengths", [None, "blocks", "cut"])
    @pytest.mark.parametrize("programs", [pytest.param(None, id="default"), pytest.param(1, id="row-steps")])
    def test_sender_traffic_is_what_its_programs_load(lengths, cols, programs, monkeypatch):
        """GIFT's sender without and with ``lengths`` (the bucket sender always passes them: the
        ``_ROW_GROUPS`` tiling), the layout's groups or groups cut mid-row by shard boundaries, rows
        narrower and wider than a program's units, one row block per program or several
        (``ROW_PROGRAMS`` lowered): ``TRAFFIC``'s bytes read are within 10% of the interpreter's count of
        the distinct addresses each program loads. Bugs caught: ``Qᵀ`` counted once per launch where
        programs reload it; a tiling whose programs take groups of different columns (the old
        ``_GROUPS`` sender: ~4·r bytes of ``Qᵀ`` per element), which no formula of this shape matches."""
        from megatron_gift import kernels
        from megatron_gift.kernels import fused

        if programs is not None:
            monkeypatch.setattr(fused, "ROW_PROGRAMS", programs)
        rows, r = 40, 8
        gen = torch.Generator().manual_seed(0)
        g = torch.randn(rows, cols, generator=gen)
        w = _whitening(cols, r, gen)
        cfg = CodecConfig()
        groups = None
        if lengths is not None:
            bounds = torch.arange(0, rows * cols + 1, 128)
            if lengths == "cut":  # shard boundaries mid-group, one at a row's second element
                bounds = torch.unique(torch.cat([bounds, torch.tensor([cols + 1, 5 * cols + 77, 9 * cols + 300])]))
            groups = torch.diff(bounds)
        launches = _counted_launches(lambda: kernels.whiten_encode(g, w, cfg, lengths=groups))
        assert launches and all(a["WHITEN"] for a, _ in launches)
        want = fused._ROW_BLOCKS.value if lengths is None else fused._ROW_GROUPS.value
        assert {a["LAYOUT"] for a, _ in launches} == {want}
        assert programs is None or all(a["row_steps"] > 1 for a, _ in launches)
        for args, loaded in launches:
            read, _ = fused.TRAFFIC["_encode_kernel"](args)
            assert 0.9 * loaded <= read <= 1.1 * loaded, (read, loaded, args["LAYOUT"])

    @pytest.mark.parametrize("rows,cols", [(40, 256), (300, 2048)])
    @pytest.mark.parametrize("name", ["_project_kernel", "_unwhiten_kernel"])
    def test_projection_and_unwhiten_traffic_is_what_their_programs_load(name, rows, cols, monkeypatch):
        """The receiver's ``T⁻¹`` (``_project_kernel``: ``S Q`` in column splits where the rows give few
        programs, 128 rows each; ``_unwhiten_kernel``: several row blocks per program, ``ROW_PROGRAMS``
        lowered) and the sender's ``G Q`` (the same kernel): ``TRAFFIC``'s bytes read within 10% of the
        interpreter's count of the distinct addresses each program loads. Bugs caught: ``Q`` or ``Qᵀ``
        counted once per launch where every program reloads it, a split's columns counted for all."""
        from megatron_gift import kernels
        from megatron_gift.kernels import fused
        from megatron_gift.numerics.fp8 import Scaling

        monkeypatch.setattr(fused, "ROW_PROGRAMS", 1)
        r = 8
        gen = torch.Generator().manual_seed(1)
        w = _whitening(cols, r, gen)
        cfg = CodecConfig(scaling=Scaling.BLOCK)
        enc = kernels.whiten_encode(torch.randn(rows, cols, generator=gen), None, cfg)
        launches = _counted_launches(
            lambda: kernels.decode_sum_unwhiten(
                [enc.payload.view(1, -1)], [enc.scales.view(1, -1)], rows, cols, w, cfg, False
            ),
            name,
        )
        assert launches
        for args, loaded in launches:
            read, _ = fused.TRAFFIC[name](args)
            assert 0.9 * loaded <= read <= 1.1 * loaded, (read, loaded, args["grid"])

    @pytest.mark.parametrize("rows,cols,in_place", [(40, 256, 0), (300, 640, 0), (300, 640, 1), (300, 640, 3)], ids=str)
    def test_placed_whitening_traffic_is_what_its_programs_load(rows, cols, in_place, monkeypatch):
        """The placed cast with whitening (the two-level sender's BF16 intra-node wire, the summed-first
        rows, read in place from ``in_place`` matrices, padding between them): ``G T`` into a BF16 buffer,
        several row blocks per program (``ROW_PROGRAMS`` lowered): ``TRAFFIC``'s bytes read within 10% of the
        interpreter's per-program count, for the pass and its ``G Q``. Bugs caught: ``Qᵀ`` counted once per
        launch where every program reloads it; a ``RowsAt``'s buffer counted whole instead of its rows, or
        its padding rows as read."""
        from megatron_gift import kernels
        from megatron_gift.kernels import place
        from megatron_gift.kernels.placement import Placement

        monkeypatch.setattr(place, "ROW_PROGRAMS", 1)
        r = 8
        gen = torch.Generator().manual_seed(2)
        w = _whitening(cols, r, gen)
        g = torch.randn(rows, cols, generator=gen)
        if in_place:  # the rows every other row of a buffer twice their size, split among the matrices
            counts = [rows // in_place + (k < rows % in_place) for k in range(in_place)]
            pads, matrix, spans = kernels.placement.aligned_rows(counts, "cpu")
            starts, at = [], 0
            for n, pad in zip(counts, pads):
                starts += (2 * cols * torch.arange(at, at + n)).tolist() + [-1] * pad
                at += n
            buffer = torch.randn(2 * rows * cols, generator=gen)
            g = kernels.RowsAt(buffer, torch.tensor(starts), cols, matrix, spans)
            w = [_whitening(cols, r, gen) for _ in counts]
        out = torch.zeros(g.numel(), dtype=torch.bfloat16)
        into = Placement([g.numel()], [0], "cpu").at(out, 0)
        launches = _counted_launches(lambda: kernels.whiten_place(g, w, into), "_place_kernel", place)
        assert launches and all(a["row_steps"] > 1 for a, _ in launches)
        for args, loaded in launches:
            read, _ = place.TRAFFIC["_place_kernel"](args)
            assert 0.9 * loaded <= read <= 1.1 * loaded, (read, loaded, args["grid"])
        from megatron_gift.kernels import fused

        launches = _counted_launches(lambda: kernels.whiten_place(g, w, into), "_project_kernel")  # its G Q
        assert launches and all(a["ROW_INDEX"] == bool(in_place) for a, _ in launches)
        for args, loaded in launches:
            read, _ = fused.TRAFFIC["_project_kernel"](args)
            assert 0.9 * loaded <= read <= 1.1 * loaded, (read, loaded, args["grid"])

else:

    def test_traffic_under_interpreter():
        """This file's tests on the CPU, in Triton's interpreter, in a fresh process."""
        assert_passes_under_interpreter(__file__)
