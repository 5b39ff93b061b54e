"""GIFT as the plugin runs it, simulated on the host for the benchmarks (``bench pretrained``, ``bench
fidelity``): one layer's statistics, refreshes on the plugin's steps installed a step late, the damping
(pair) choice of every ``--gift-side`` and the cold-start rule (``numerics.profile``), on gradients the
benchmark provides, in FP8 with the configured codec (E4M3, 1x128 blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_gift.numerics import CodecConfig, KFACStatistics, LowRankWhitening, TwoSidedWhitening
from megatron_gift.numerics.profile import damping_choice, held_out_gate
from megatron_gift_tools.bench import fp8_sim

BLOCK = CodecConfig()  # E4M3, 1x128 block scales: what the plugin sends


def damping_errors(g: torch.Tensor, whitenings: list) -> torch.Tensor:
    """``numerics.profile.damping_errors(g, whitenings, BLOCK)``, its numbers bit for bit, faster: the
    round trips of ``fp8_sim`` and each input side's ``G T_in`` computed once for all the pairs of the
    grid that share it (the same maps in the same order: ``TwoSidedWhitening.apply`` is
    ``T_out``'s ``apply`` of the transposed ``G T_in``)."""
    g = g.detach().float()
    errs, applied = [fp8_sim.roundtrip(g, BLOCK).sub_(g).norm()], {}
    for w in whitenings:
        t_in = w.input_side if isinstance(w, TwoSidedWhitening) else w
        if id(t_in) not in applied:
            applied[id(t_in)] = t_in.apply(g)
        u = applied[id(t_in)]
        if isinstance(w, TwoSidedWhitening):
            u = w.output_side.apply(u.mT).mT
        errs.append(w.inverse(fp8_sim.roundtrip(u, BLOCK).sub_(u)).norm())
    return torch.stack(errs)


def wire_errors(g: torch.Tensor, whitenings: list, roundtrip) -> torch.Tensor:
    """``damping_errors`` with the wire's round trip ``roundtrip(u) -> dec(enc(u))`` in place of FP8's:
    ``‖q(G) - G‖``, then ``‖(q(G T) - G T) T⁻¹‖`` for each ``T``."""
    g = g.detach().float()
    errs = [roundtrip(g).sub_(g).norm()]
    for w in whitenings:
        u = w.apply(g)
        errs.append(w.inverse(roundtrip(u).sub_(u)).norm())
    return torch.stack(errs)


@dataclass
class GiftLayer:
    """One layer's GIFT as the plugin keeps it: the per-step EMA statistics of the inputs (and, for the
    two-sided sides, of the output gradients; both summed over ranks: the refresh's all-reduce), the
    ``T`` each variant sends, and per side the held-out ``T`` of the last refresh."""

    stats: KFACStatistics
    rank: int
    out_stats: KFACStatistics | None = None  # B; None: the input side only
    sent: dict = field(default_factory=dict)  # (side, gated) -> (T or None, damping label)
    held_out: dict = field(default_factory=dict)  # side -> the last refresh's best candidate
    pending: dict | None = None  # built at a refresh, installed at the next step
    # name -> round trip ``u -> dec(enc(u))`` of another wire (FP4): the input side's damping chosen (and
    # gated) on its errors instead of FP8's, sent as side "input@name"
    quantizers: dict = field(default_factory=dict)
    wire_error: dict = field(default_factory=dict)  # "input@name" -> the sent choice's error on g0 at the refresh

    def install(self) -> None:
        if self.pending is not None:
            self.sent, self.held_out = self.pending["sent"], self.pending["best"]
            self.wire_error, self.pending = self.pending["wire_error"], None

    def observe(self, inputs: list[torch.Tensor], out_grads: list[torch.Tensor]) -> None:
        """One step's statistics, summed over the ranks' ``inputs`` and ``out_grads``: ``A``'s folded
        into the EMA now; ``B``'s accumulated and folded at the next call, as the runtime folds the
        output gradients at the start of the next step (a refresh sees ``B`` a step older than ``A``)."""
        for x in inputs:
            self.stats.accumulate(x)
        self.stats.fold()
        if self.out_stats is not None:
            if float(self.out_stats.tokens) > 0:
                self.out_stats.fold()
            for g in out_grads:
                self.out_stats.accumulate(g)

    def candidates(self, dampings: tuple[float, ...]) -> dict[str, list]:
        """Side -> ``[(label, T)]``: ``input`` the ``T_in`` of each damping; with output statistics
        ``both`` the ``TwoSidedWhitening`` of every pair (``T_out = I`` while ``B`` holds no token:
        the first refresh) and ``auto`` the union of the two (the same objects)."""
        f_in = self.stats.low_rank_factor(self.rank, 0.0)
        inputs = [(c, LowRankWhitening(f_in.with_damping(c))) for c in dampings]
        if self.out_stats is None:
            return {"input": inputs}
        if float(self.out_stats.ema_tokens) > 0:
            f_out = self.out_stats.low_rank_factor(self.rank, 0.0)
            outputs = [(c, LowRankWhitening(f_out.with_damping(c))) for c in dampings]
        else:
            outputs = [("I", LowRankWhitening.identity(self.out_stats.d_in))]
        grid = [(f"{ci}/{co}", TwoSidedWhitening(ti, to)) for ci, ti in inputs for co, to in outputs]
        return {"input": inputs, "both": grid, "auto": inputs + grid}

    def refresh(self, g0: torch.Tensor, dampings: tuple[float, ...]) -> None:
        """The owner's build (``numerics.refresh.FactorBuild``'s maths on the host): factors, every
        candidate's ``T``, per side the damping choice on rank 0's gradient ``g0`` among Euclidean and
        the side's candidates and the cold-start gate with that side's held-out ``T``."""
        sides = self.candidates(dampings)
        unique = list({id(t): t for cands in sides.values() for _, t in cands}.values())
        held = list(self.held_out.items())
        errs = damping_errors(g0, unique + [t for _, t in held])  # [Euclidean, *unique, *held]
        col = {id(t): 1 + i for i, t in enumerate(unique)}
        held_err = {side: errs[1 + len(unique) + i] for i, (side, _) in enumerate(held)}
        sent, best = {}, {}
        for side, cands in sides.items():
            chosen, b = damping_choice(errs[[0, *(col[id(t)] for _, t in cands)]])
            gated = held_out_gate(chosen, errs[0], held_err.get(side))
            for flag, i in ((False, int(chosen)), (True, int(gated))):
                sent[(side, flag)] = (None, "euclidean") if i == 0 else cands[i - 1][::-1]
            best[side] = cands[int(b)][1]
        wire_error = {}
        for name, q in self.quantizers.items():  # the input side's choice on another wire's errors
            side = f"input@{name}"
            cands, held = sides["input"], self.held_out.get(side)
            errs = wire_errors(g0, [t for _, t in cands] + ([held] if held is not None else []), q)
            chosen, b = damping_choice(errs[: 1 + len(cands)])
            gated = held_out_gate(chosen, errs[0], errs[-1] if held is not None else None)
            for flag, i in ((False, int(chosen)), (True, int(gated))):
                sent[(side, flag)] = (None, "euclidean") if i == 0 else cands[i - 1][::-1]
            best[side] = cands[int(b)][1]
            wire_error[side] = float(errs[int(gated)])
        self.pending = {"sent": sent, "best": best, "wire_error": wire_error}
