"""GIFT's refresh on the statistics' device: the staged build, its one all-gather of fixed-size
records, its host synchronisations, failures on one rank, and the step close without a host wait.

Unit tests check the numerics against FP64 references computed another way (dense Nyström,
``W Wᵀ``); multi-rank tests run real Megatron-Core training through GiftDistributedDataParallel
on 2 gloo ranks and compare ranks with each other and with an uninterrupted run.
"""

import logging
import os
import subprocess
import sys

import pytest
import torch

from megatron_gift.config import GiftConfig, Mode
from megatron_gift.numerics import CodecConfig, ErrorFeedback, KFACStatistics, LowRankWhitening
from megatron_gift.numerics.kfac import sketch_matrix
from megatron_gift.numerics.profile import choose_damping, damping_choice
from megatron_gift.numerics.refresh import (
    HEADER,
    BuildStatus,
    FactorBuild,
    FactorSide,
    HostCopy,
    OwnedLayer,
    RecordLayout,
    to_device,
)
from megatron_gift.numerics.whitening import (
    factor_from_sketch,
    factors_by_rank,
    nystrom_basis,
    nystrom_core,
    sketch_grams,
    whitening_gram,
    whitening_tensors,
)
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.dispatch import SyncSanitizer

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps
# the files whose host synchronisations this change removed (issue 17): state and refresh, statistics, factor build,
# profiles, telemetry, error feedback, the DDP adapter
MINE = (
    "megatron_gift/state.py",
    "megatron_gift/refresh_sync.py",
    "megatron_gift/numerics/kfac.py",
    "megatron_gift/numerics/whitening.py",
    "megatron_gift/numerics/refresh.py",
    "megatron_gift/numerics/geometry.py",
    "megatron_gift/numerics/profile.py",
    "megatron_gift/numerics/error_feedback.py",
    "megatron_gift/megatron/ddp.py",
    "megatron_gift/megatron/monitor.py",
)


def _spd(d: int, decay: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return (basis * torch.logspace(0, -decay, d, dtype=torch.float64)) @ basis.T


# --------------------------------------------------------------------------- numerics


def test_nystrom_core_matches_the_dense_nystrom_approximation():
    """The k x k route (Grams, Cholesky, eigh of EᵀE) gives the top-r eigenpairs of the dense
    Nyström approximation ``Y_ν (ΩᵀY_ν)⁻¹ Y_νᵀ - ν`` (catches a wrong Gram expansion or basis)."""
    d, k, r = 96, 16, 8
    a = _spd(d, 3.0, 0)
    om = sketch_matrix(d, k, 3).double()
    y = a @ om
    core = nystrom_core(sketch_grams(y, om), r)
    assert core.ok
    v = nystrom_basis(y, om, core.nu, core.basis)
    y_nu = y + core.nu * om
    dense = y_nu @ torch.linalg.solve(om.T @ y_nu, y_nu.T)
    evals, evecs = torch.linalg.eigh(0.5 * (dense + dense.T))
    lam_ref, v_ref = evals.flip(0)[:r] - core.nu, evecs.flip(1)[:, :r]
    # FP64 throughout; EᵀE squares E's condition number, so the eigenvalues carry ~eps·σ1² absolute
    # error and the basis ~eps·κ(E)² (κ from the reference itself), with a factor 100 for the k-term sums
    kappa2 = float(evals[-1] / evals.flip(0)[r - 1])
    assert (core.lam - lam_ref).abs().max() <= 100 * EPS64 * float(evals[-1])
    assert (v @ v.T - v_ref @ v_ref.T).abs().max() <= 100 * EPS64 * kappa2
    assert (v.T @ v - torch.eye(r, dtype=torch.float64)).abs().max() <= 100 * EPS64 * kappa2


def test_whitening_core_is_the_svd_of_w():
    """``Q diag(s) Qᵀ = W Wᵀ`` with orthonormal ``Q`` from the r x r Gram (catches a wrong
    ordering, scaling or a missing zero-column guard), a rank-deficient factor included."""
    d, r = 80, 12
    gen = torch.Generator().manual_seed(1)
    v, _ = torch.linalg.qr(torch.randn(d, r, generator=gen, dtype=torch.float64))
    lam = torch.logspace(2, -2, r, dtype=torch.float64)
    lam[-2:] = 0.0  # two empty directions: s = 0, their Q columns zero
    dd = torch.rand(d, generator=gen, dtype=torch.float64) + 0.1
    w, gram = whitening_gram(dd, v, lam)
    s, p = torch.linalg.eigh(gram)
    t = whitening_tensors(dd, w, s.flip(-1).clamp_min(0), p.flip(-1), dtype=torch.float64)
    q, s_desc = t["q"], s.flip(-1).clamp_min(0)
    assert torch.all(s_desc[:-1] >= s_desc[1:])
    bound = 100 * EPS64 * float(s_desc[0] / s_desc[r - 3])  # eps · κ(W)² over the non-empty columns
    assert ((q * s_desc) @ q.T - w @ w.T).abs().max() <= 100 * EPS64 * float(s_desc[0])
    assert (q[:, : r - 2].T @ q[:, : r - 2] - torch.eye(r - 2, dtype=torch.float64)).abs().max() <= bound
    assert torch.equal(q[:, r - 2 :], torch.zeros(d, 2, dtype=torch.float64)) and torch.equal(
        t["c"][-2:], torch.zeros(2, dtype=torch.float64)
    )


def test_damping_choice_rules():
    """Euclidean (index 0) wins ties and whenever its own estimate is not finite; a non-finite
    candidate never wins; ``best`` is the smallest finite candidate (catches argmin on NaN)."""
    errs = torch.tensor(
        [
            [1.0, 2.0, 1.0, 3.0],
            [5.0, float("nan"), 4.0, 4.0],
            [float("inf"), 0.5, 0.1, 1.0],
            [2.0, float("nan"), float("nan"), 1.0],
        ]
    )
    chosen, best = damping_choice(errs)
    assert chosen.tolist() == [0, 2, 0, 3] and best.tolist() == [1, 1, 1, 2]


def test_record_layout_views_are_disjoint_and_aligned():
    """Every field of a record lies in its own bytes, 8-aligned records tile a buffer (catches overlapping
    views); the record holds the header and ``T`` alone, no FP64 factor: ``8·7 + 4·(2d + d·r + 2r)``
    bytes, rounded up to 8, its header the seven fields both sides' headers have (catches the factor
    sent again, tripling the all-gather)."""
    lay = RecordLayout(37, 5)
    assert lay.nbytes % 8 == 0
    buf = torch.zeros(2 * lay.nbytes, dtype=torch.uint8)
    seen = [lay.views(buf[j * lay.nbytes : (j + 1) * lay.nbytes]) for j in range(2)]
    for j in range(2):
        for i, t in enumerate(seen[j]["input"].values()):
            t.fill_(10 * j + i + 1)
    for j in range(2):
        for i, t in enumerate(seen[j]["input"].values()):
            assert torch.all(t == 10 * j + i + 1)
    assert list(seen[0]) == ["input"] and list(seen[0]["input"]) == [
        "header",
        "d_inv_sqrt",
        "d_sqrt",
        "q",
        "c",
        "c_inv",
    ]
    assert HEADER == ("status", "rank", "choice", "damping", "trace", "held_out", "rotate")
    assert lay.nbytes == 8 * 7 + 4 * (2 * 37 + 37 * 5 + 2 * 5) + 4


def test_owners_balance_the_record_bytes():
    """Largest record first to the least-loaded rank: every rank's slot is within one record of the
    mean (the greedy's bound, max ≤ mean + largest), which round-robin misses on Llama-600M's four
    layer shapes at 64 ranks (catches an assignment that leaves the all-gather mostly padding)."""
    from megatron_gift.refresh_sync import RefreshSync
    from megatron_gift.state import GiftParam, GiftState
    from megatron_gift.testing.shapes import PRESETS, layer_shapes

    class Group:
        def size(self):
            return 64

    m, group = PRESETS["600m"], Group()
    layers = []
    for i in range(m["layers"] * 4):
        g = GiftParam(str(i), Mode.GIFT, candidate=True)
        g.input.stats = KFACStatistics(list(layer_shapes(m).values())[i % 4][1], sketch=64)
        layers.append((g, group))
    RefreshSync(GiftState(GiftConfig(mode=Mode.GIFT), torch.device("cpu"))).assign_owners(layers)
    sizes = [RecordLayout(g.input.stats.d_in, 32).nbytes for g, _ in layers]
    load = [sum(b for (g, _), b in zip(layers, sizes) if g.owner == r) for r in range(64)]
    assert max(load) <= sum(sizes) / 64 + max(sizes)
    round_robin = [sum(b for i, b in enumerate(sizes) if i % 64 == r) for r in range(64)]
    assert max(load) < 0.6 * max(round_robin)


def test_host_copy_and_to_device_round_trip():
    parts = [torch.arange(6.0).view(2, 3), torch.tensor([True, False]), torch.zeros(0)]
    back = HostCopy(parts, torch.device("cpu")).wait()
    assert [b.shape for b in back] == [p.shape for p in parts] and torch.equal(
        back[1], torch.tensor([1.0, 0.0], dtype=torch.float64)
    )
    dev = to_device(back, torch.device("cpu"))
    assert torch.equal(dev[0], parts[0].double())


def _stats(d: int, sketch: int, seed: int) -> KFACStatistics:
    s = KFACStatistics(d, sketch=sketch, seed=seed)
    a = _spd(d, 2.0, seed).float()
    x = torch.randn(400, d, generator=torch.Generator().manual_seed(seed)) @ torch.linalg.cholesky(a.double()).float().T
    s.accumulate(x)
    s.fold()
    return s


def _held_out_wins(g: torch.Tensor, held_out: LowRankWhitening | None, cfg: CodecConfig) -> bool:
    """Reference of the cold-start rule: the held-out ``T`` (dense, FP64 products) has a smaller FP8
    error than plain FP8 on ``g``."""
    if held_out is None:
        return False
    from megatron_gift.numerics.fp8 import roundtrip

    t, t_inv = (m.double() for m in held_out.dense())
    u = (g.double() @ t).float()
    e_gift = ((roundtrip(u, cfg) - u).double() @ t_inv).norm()
    return bool(e_gift < (roundtrip(g, cfg) - g).double().norm())


@pytest.mark.parametrize("held_out", ["none", "previous"])
def test_staged_build_writes_what_the_one_layer_path_builds(held_out):
    """The batched, staged build (device / host / device / host / device) of an exact and two
    sketched layers writes the factor, ``T`` and damping choice the one-layer host path gives
    (``factor_from_sketch`` + ``LowRankWhitening`` + ``choose_damping``), gated by the cold-start
    rule (Euclidean unless the previous build's ``T``, given here as ``held_out``, beat plain FP8 on
    the gradient): catches a mixed-up layer, candidate or column in the batching and the record
    packing, and a whitening sent before a held-out check passed (the first build has none). The
    factor stays with the build (``OwnedLayer.factor``), only ``T`` and the header go in the record."""
    cfg, cands = CodecConfig(), (0.3, 1.0, 3.0, 10.0)
    stats = [_stats(24, 0, 1), _stats(96, 16, 2), _stats(64, 16, 3)]
    # gradients in the inputs' span (g = E aᵀ, as a linear layer's are: whitening gains) for two layers,
    # isotropic for the third; the held-out T: a stale factor from other samples of the same inputs, or
    # one with the damping near zero (amplifies FP8 error: loses)
    grads = [torch.randn(40, s.d_in, generator=torch.Generator().manual_seed(9 + i)) for i, s in enumerate(stats)]
    grads[0], grads[1] = (g @ _spd(s.d_in, 2.0, i + 1).float() for i, (g, s) in enumerate(zip(grads[:2], stats)))

    def stale(d, seed, damping):  # A from 400 other samples of layer `seed`'s inputs
        x = torch.randn(400, d, generator=torch.Generator().manual_seed(50 + seed), dtype=torch.float64)
        x = x @ torch.linalg.cholesky(_spd(d, 2.0, seed)).T
        return LowRankWhitening(factors_by_rank(x.T @ x / 400, [8], damping)[8])

    helds = (
        [None] * 3
        if held_out == "none"
        else [stale(s.d_in, i + 1, damping) for i, (s, damping) in enumerate(zip(stats, (1.0, 1.0, 1e-6)))]
    )
    wins = [_held_out_wins(g, h, cfg) for g, h in zip(grads, helds)]
    assert held_out == "none" or (wins[0] and wins[1] and not wins[2])  # the test's premise: both branches taken
    layers = [
        OwnedLayer(f"l{i}", FactorSide(s.factor_rank(8), dict(s.ema_sums), s.ema_tokens, s.omega, h), grad=g)
        for i, (s, g, h) in enumerate(zip(stats, grads, helds))
    ]
    build = FactorBuild(layers, cands, True, cfg, 12)
    parts = build.whitening_cores(build.whitening_grams(build.cores(build.grams())))  # on a CPU host = device
    bufs = [torch.zeros(lay.layout.nbytes, dtype=torch.uint8) for lay in layers]
    build.finish(parts, [lay.layout.views(b) for lay, b in zip(layers, bufs)])
    for s, g, lay, buf, win in zip(stats, grads, layers, bufs, wins):
        rec = lay.layout.views(buf)
        head = dict(zip(HEADER, rec["input"]["header"].tolist()))
        m = s.ema_tokens.double()  # the build averages in FP64
        if s.omega is None:
            f = factors_by_rank(s.ema_sums["xtx"].double() / m, [8])[8]
        else:
            f = factor_from_sketch(s.ema_sums["y"].double() / m, s.omega, s.ema_sums["diag"].double() / m, 8, 0.0)
        chosen, errs = choose_damping(g, f, cands, cfg)
        best = min(cands, key=lambda c: errs[c])
        assert head["status"] == BuildStatus.OK and head["rank"] == f.v.shape[1]
        assert head["choice"] == (-1.0 if chosen is None or not win else chosen) and head["damping"] == best
        ref = f.with_damping(best)
        # FP64 both ways, batched vs one matrix at a time (BLAS may round differently): the basis
        # carries ~eps·κ² from its Gram (κ² = λ1/λr here), D the same through diag(V Λ Vᵀ)
        kappa2 = float(ref.lam[0] / ref.lam[-1])
        tol = 100 * EPS64 * kappa2 * float(ref.lam[0])
        d, v, lam = lay.input.factor
        assert (d - ref.d).abs().max() <= tol
        assert (v @ (v * lam).T - ref.v @ (ref.v * ref.lam).T).abs().max() <= tol
        w = LowRankWhitening(ref)
        t_rec, t_ref = LowRankWhitening.from_tensors({k: rec["input"][k] for k in w.tensors()}).dense()[0], w.dense()[0]
        assert (t_rec - t_ref).abs().max() <= 4 * s.d_in * EPS32 * float(t_ref.abs().max())  # both rounded to FP32 once


def test_indefinite_sketch_builds_the_diagonal_and_says_so(caplog):
    """A sketch whose core never becomes positive definite gives status INDEFINITE, rank 0, and
    the damped diagonal (the one-layer path's fallback, with its warning)."""
    s = _stats(32, 8, 4)
    s.ema_sums["y"].fill_(float("nan"))
    lay = OwnedLayer("nan", FactorSide(8, dict(s.ema_sums), s.ema_tokens, s.omega), grad=torch.randn(4, 32))
    build = FactorBuild([lay], (1.0,), False, CodecConfig(), 12)
    parts = build.cores(build.grams())
    parts = build.whitening_cores(build.whitening_grams(parts))
    buf = torch.zeros(lay.layout.nbytes, dtype=torch.uint8)
    build.finish(parts, [lay.layout.views(buf)])
    rec = lay.layout.views(buf)["input"]
    assert rec["header"][0] == BuildStatus.INDEFINITE and rec["header"][1] == 0 and torch.all(rec["q"] == 0)
    with caplog.at_level("WARNING"):
        m = s.ema_tokens.double()
        f = factor_from_sketch(s.ema_sums["y"].double() / m, s.omega, s.ema_sums["diag"].double() / m, 8, 1.0)
    assert (
        "stayed indefinite" in caplog.text
        and torch.allclose(lay.input.factor[0], f.d)
        and lay.input.factor[1].shape == (32, 0)
    )


def test_fold_all_equals_one_fold_per_layer():
    """One batched fold (``torch._foreach_*``) leaves every EMA as its own ``fold()`` would, bit for bit."""
    a, b = (
        [KFACStatistics(16, sketch=4, seed=i, ema=e) for i, e in ((0, 0.9), (1, 0.95))],
        [KFACStatistics(16, sketch=4, seed=i, ema=e) for i, e in ((0, 0.9), (1, 0.95))],
    )
    for step in range(3):
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(step))
        for s in a + b:
            s.accumulate(x)
        KFACStatistics.fold_all(a)
        for s in b:
            s.fold()
    for s, t in zip(a, b):
        assert all(torch.equal(s.ema_sums[k], t.ema_sums[k]) for k in s.ema_sums) and torch.equal(
            s.ema_tokens, t.ema_tokens
        )
        assert s.folds == t.folds == 3 and float(s.tokens) == 0


@pytest.mark.parametrize("applied", [True, False])
def test_error_feedback_commit_on_the_device(applied):
    """A 0-d bool tensor commits like the Python bool: the new residual kept, or, after a step not
    applied (NaN written), zero. Bug caught: the device-side commit leaving the NaN residual in place."""
    ef, ref = ErrorFeedback(5), ErrorFeedback(5)
    for e in (ef, ref):
        e.residual.copy_(torch.arange(5.0))
        e.stage(torch.full((5,), float("nan")) if not applied else torch.ones(5), torch.zeros(5))
    ef.commit(torch.tensor(applied))
    ref.commit(applied)
    assert torch.equal(ef.residual, ref.residual) and torch.equal(ef.residual, torch.full((5,), float(applied)))


@pytest.mark.gpu
def test_whitening_matmuls_are_full_fp32_under_the_tf32_override():
    """Under ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (NGC) ``G T`` keeps FP32 accuracy and the user's
    matmul precision is restored afterwards. Bound: two FP32 evaluations of d-term sums (``G T``
    and the rows of ``T``), ``2·d·eps32`` = 3.1e-5 at d = 128; TF32 rounds every input by up to
    2^-11 (typically ~2e-4 relative on the result), which the bound excludes."""
    code = r"""
import torch
from megatron_gift.numerics.whitening import LowRankWhitening, approximate_factor
assert torch.get_float32_matmul_precision() == "high"
d = 128
a = torch.randn(4000, d, dtype=torch.float64); a = a.T @ a / 4000
w = LowRankWhitening(approximate_factor(a, 32, 1.0), device="cuda")
g = torch.randn(256, d, device="cuda")
t = w.apply(torch.eye(d, device="cuda")).double()
ref = g.double() @ t
err = ((w.apply(g).double() - ref).norm() / ref.norm()).item()
assert torch.get_float32_matmul_precision() == "high"
print(err)
"""
    env = {**os.environ, "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout.split()[-1]) <= 2 * 128 * EPS32


# --------------------------------------------------------------------------- inside Megatron training


def _ddp(dist_opt: bool, interval: int, error_feedback: bool = True, log_interval: int = 0):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt

    model = build_tiny_gpt(hidden_size=72, ffn_hidden_size=136)
    gift = GiftConfig.build(
        mode=Mode.GIFT,
        rank=8,
        sketch=16,
        refresh_interval=interval,
        error_feedback=error_feedback,
        log_interval=log_interval,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=6000
    )
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=gift)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [ddp])
    return model, ddp, opt


def _step(ddp, opt, step, rank):
    from megatron_gift.testing.gpt import lm_loss, random_tokens

    ddp.zero_grad_buffer()
    opt.zero_grad()
    lm_loss(ddp, random_tokens(step, rank)).backward()
    ddp.finish_grad_sync()
    opt.step()


def _transforms(ddp) -> torch.Tensor:
    """What every rank installs: each layer's ``T`` and damping choice (the factor is its owner's alone)."""
    layers = [g for g in ddp.gift_params.values() if g.candidate and g.input.whitening is not None]
    return torch.cat(
        [torch.zeros(0, dtype=torch.float64)]
        + [
            t.flatten().double()
            for g in layers
            for t in (
                torch.tensor([-1.0 if g.input.damping is None else g.input.damping]),
                *g.input.whitening.tensors().values(),
            )
        ]
    )


def _factors_on_owners(ddp, rank) -> bool:
    """Every installed layer has its factor on its owner and nowhere else."""
    return all(
        (g.input.factor is not None) == (g.owner == rank)
        for g in ddp.gift_params.values()
        if g.candidate and g.input.whitening is not None
    )


def _sync_worker(rank, world):
    """Per step: the plugin's host-synchronising ops from this change's files, the refresh's host
    waits, the factor collectives (count and bytes), and the transforms."""
    from megatron.core import parallel_state

    import megatron_gift.refresh_sync as refresh_mod

    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for dist_opt in (True, False):
        _, ddp, opt = _ddp(dist_opt, interval=4)
        gathers, broadcasts = [], []
        real_gather, real_bcast = refresh_mod._all_gather, torch.distributed.broadcast
        refresh_mod._all_gather = lambda recv, send, **kw: gathers.append(send.numel()) or real_gather(recv, send, **kw)
        torch.distributed.broadcast = lambda *a, **kw: broadcasts.append(1) or real_bcast(*a, **kw)
        steps = []
        try:
            for step in range(8):
                waits, n_gather = ddp.refresh.host_waits, len(gathers)
                san = SyncSanitizer()
                with san:
                    _step(ddp, opt, step, rank)
                counts = san.counts()
                mine = {k: v for k, v in counts.items() if k.startswith(MINE) and not k.endswith("(HostCopy.wait)")}
                seen = sum(v for k, v in counts.items() if k.endswith("(HostCopy.wait)"))
                steps.append(
                    dict(
                        mine=mine,
                        all=dict(counts),
                        waits=ddp.refresh.host_waits - waits,
                        seen_waits=seen,
                        gathers=gathers[n_gather:],
                        refresh=ddp.is_refresh_step(step),
                        transforms=_transforms(ddp),
                        whitened=sorted(
                            g.name for g in ddp.gift_params.values() if g.candidate and g.input.damping is not None
                        ),
                        factors=sum(
                            1 for g in ddp.gift_params.values() if g.candidate and g.input.whitening is not None
                        ),
                        on_owners=_factors_on_owners(ddp, rank),
                    )
                )
            ddp.zero_grad_buffer()  # closes step 7
        finally:
            refresh_mod._all_gather, torch.distributed.broadcast = real_gather, real_bcast
        installed = [
            t
            for gp in ddp.gift_params.values()
            if gp.candidate and gp.input.factor is not None
            for t in (gp.input.factor.d, gp.input.factor.v, gp.input.factor.lam, *gp.input.whitening.tensors().values())
        ]
        out[dist_opt] = dict(
            steps=steps,
            waits=ddp.refresh.host_waits,
            broadcasts=len(broadcasts),
            own_storage=all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in installed),
        )
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_steady_steps_never_synchronise_and_a_refresh_sends_one_collective():
    """Refresh steps 0, 1, 2, 4 (interval 4) on 2 ranks, distributed optimizer on and off, overlap
    on, error feedback on. Steady steps 6, 7 (no refresh, nothing to install): zero host
    synchronisations from this change's files, no host wait. Each refresh: exactly 3 host waits
    (refresh_sync.py module doc; the sanitizer sees each ``HostCopy.wait``), no other synchronising
    op; one all-gather of the same byte count on every rank, no broadcast; every rank installs
    bit-identical ``T`` and choices, the FP64 factor on its owner only, each in its own storage
    (views would keep the gathered buffer, R slots, alive until the next refresh).
    Cold start: step 1 runs with the factors of step 0's refresh, which no held-out check has passed
    yet, so every layer is sent Euclidean (``T = I``) though its factor is installed; later, every
    rank whitens the same layers."""
    res = run_on_ranks(_sync_worker, 2, cpu_harness=True, timeout=900)
    for dist_opt in (True, False):
        per_rank = [r[dist_opt] for r in res]
        for r in per_rank:
            steps = r["steps"]
            assert [s["refresh"] for s in steps] == [True, True, True, False, True, False, False, False]
            assert all(s["mine"] == {} for s in steps), [s["mine"] for s in steps]
            assert [s["seen_waits"] for s in steps] == [s["waits"] for s in steps]  # the sanitizer sees each host wait
            assert [len(s["gathers"]) for s in steps] == [
                0,
                1,
                1,
                1,
                0,
                1,
                0,
                0,
            ]  # sent at the close of each refresh step
            # host waits by step: the first at finish_grad_sync of a refresh step, the second at its
            # close (the next step's zero_grad_buffer), the third at the next step's first sync
            assert [s["waits"] for s in steps] == [1, 3, 3, 2, 1, 2, 0, 0] and r["waits"] == 3 * 4
            assert r["broadcasts"] == 0 and r["own_storage"]
            assert steps[1]["factors"] > 0 and steps[1]["whitened"] == []
            assert all(s["on_owners"] for s in steps)
        assert per_rank[0]["steps"][1]["gathers"] == per_rank[1]["steps"][1]["gathers"]
        for s0, s1 in zip(per_rank[0]["steps"], per_rank[1]["steps"]):
            assert torch.equal(s0["transforms"], s1["transforms"]) and s0["whitened"] == s1["whitened"], dist_opt
        assert (
            per_rank[0]["steps"][0]["transforms"].numel() == 0 < per_rank[0]["steps"][1]["transforms"].numel()
        )  # a step late


def _fault_worker(rank, world, fault):
    """Rank 1's builds raise (``fail``) or find every Nyström core indefinite (``deficient``)."""
    from megatron.core import parallel_state

    import megatron_gift.numerics.refresh as refresh

    parallel_state.initialize_model_parallel(1, 1)
    _, ddp, opt = _ddp(True, interval=1, error_feedback=False)
    real = refresh.nystrom_core
    if rank == 1:
        if fault == "fail":

            def broken(*a, **kw):
                raise FloatingPointError("injected")

            refresh.nystrom_core = broken
        else:
            refresh.nystrom_core = lambda grams, rank_, max_shifts: real(grams, rank_, -1)  # no shift tried: indefinite
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("megatron_gift").addHandler(handler)
    error, ranks = None, []
    try:
        for step in range(3):
            _step(ddp, opt, step, rank)
            ranks.append(
                {
                    g.name: g.input.factor.v.shape[1]
                    for g in ddp.gift_params.values()
                    if g.candidate and g.input.factor is not None
                }
            )  # its own
    except Exception as e:  # noqa: BLE001 - the message is what is compared
        error = f"{type(e).__name__}: {e}"
    finally:
        refresh.nystrom_core = real
        logging.getLogger("megatron_gift").removeHandler(handler)
    owners = {g.name: g.owner for g in ddp.gift_params.values() if g.candidate}
    transforms = _transforms(ddp) if error is None else None
    parallel_state.destroy_model_parallel()
    return dict(
        error=error,
        warnings=[m for m in records if "stayed indefinite" in m],
        ranks=ranks,
        owners=owners,
        transforms=transforms,
    )


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_a_failed_build_on_one_rank_stops_every_rank_with_the_same_message():
    """Rank 1's builds raise: no hang, and both ranks raise the same error naming rank 1's layers."""
    res = run_on_ranks(_fault_worker, 2, "fail", cpu_harness=True, timeout=600)
    assert res[0]["error"] is not None and res[0]["error"] == res[1]["error"], [r["error"] for r in res]
    assert "RuntimeError" in res[0]["error"] and "failed" in res[0]["error"]
    named = [n for n, o in res[0]["owners"].items() if n in res[0]["error"]]
    assert named and all(res[0]["owners"][n] == 1 for n in named)


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_a_rank_deficient_build_on_one_rank_gives_the_same_warning_and_factors_everywhere():
    """Rank 1's Nyström cores stay indefinite: every rank warns the same, rank 1 holds rank-0 factors
    for its layers and rank 0 full-rank ones for its own (each owner its own layers' factors, no
    other), every rank installs the same ``T``, and training goes on."""
    res = run_on_ranks(_fault_worker, 2, "deficient", cpu_harness=True, timeout=600)
    assert all(r["error"] is None for r in res), [r["error"] for r in res]
    assert res[0]["warnings"] and res[0]["warnings"] == res[1]["warnings"]
    for name, owner in res[0]["owners"].items():
        assert res[owner]["ranks"][-1][name] == (0 if owner == 1 else 8), (name, res[owner]["ranks"][-1][name])
        assert name not in res[1 - owner]["ranks"][-1]
    assert torch.equal(res[0]["transforms"], res[1]["transforms"])


def _resume_worker(rank, world):
    """6 steps straight vs 3 (the last a refresh step, its build still in flight), state saved, a
    fresh model/DDP/optimizer restored, 3 more."""
    import copy

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)

    def snapshot(model, ddp):
        flat = [p.detach().flatten() for p in model.parameters()]
        state = ddp.gift_state_dict()
        for entry in state["params"].values():
            flat += [t.flatten().double() for t in entry.get("whitening", {}).values()]
            flat += [t.flatten().double() for t in (entry.get("stats", {}).get("ema_sums") or {}).values()]
            flat += [entry["residual"].flatten()] if "residual" in entry else []
        return torch.cat([t.double() for t in flat])

    # without the distributed optimizer: its state_dict() leaves the Adam moments out (Megatron saves them apart)
    straight = _ddp(False, interval=3)
    for step in range(6):
        _step(*straight[1:], step, rank)
    first = _ddp(False, interval=3)
    for step in range(3):
        _step(*first[1:], step, rank)
    pending = first[1].refresh.pending is not None or first[1].gift_state.step_open
    saved = copy.deepcopy(
        dict(
            gift=first[1].gift_state_dict(),
            opt=first[2].state_dict(),
            params=[p.detach().clone() for p in first[0].parameters()],
        )
    )
    resumed = _ddp(False, interval=3)
    with torch.no_grad():
        for p, q in zip(resumed[0].parameters(), saved["params"]):
            p.copy_(q)
    resumed[2].load_state_dict(saved["opt"])
    missing = resumed[1].load_gift_state_dict(saved["gift"])
    for step in range(3, 6):
        _step(*resumed[1:], step, rank)
    equal = torch.equal(snapshot(*straight[:2]), snapshot(*resumed[:2]))
    parallel_state.destroy_model_parallel()
    return dict(pending=pending, missing=missing, equal=equal)


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_a_checkpoint_with_a_refresh_in_flight_resumes_bitwise():
    """Saved right after refresh step 2 (interval 3: refreshes 0, 1, 2; its build not installed yet):
    the resumed run ends bitwise equal to the uninterrupted one (parameters, T, statistics, residuals)."""
    for r in run_on_ranks(_resume_worker, 2, cpu_harness=True, timeout=900):
        assert r["pending"] and r["missing"] == [] and r["equal"], r


def _remap_worker(rank, world):
    """At each install, each GIFT layer's error-feedback residual before and after, and both transforms."""
    from megatron.core import parallel_state

    from megatron_gift.state import GiftState

    parallel_state.initialize_model_parallel(1, 1)
    _, ddp, opt = _ddp(False, interval=1)
    seen = []
    real = GiftState.remap_residual

    def spy(g, old, new, residuals):
        residuals = list(residuals)
        before = [v.clone() for v, o in residuals if o is g]
        real(g, old, new, residuals)
        after = [v.clone() for v, o in residuals if o is g]
        if old is not None and before:
            seen.append(dict(before=before[0], after=after[0], old=old, new=new))

    GiftState.remap_residual = staticmethod(spy)
    try:
        for step in range(3):
            _step(ddp, opt, step, rank)
    finally:
        GiftState.remap_residual = staticmethod(real)
    parallel_state.destroy_model_parallel()
    return [
        dict(
            plain_before=s["old"].inverse(s["before"]).double(),
            plain_after=s["new"].inverse(s["after"]).double(),
            kappa=float(torch.linalg.cond(s["new"].dense()[0].double())),
            d=s["before"].shape[1],
        )
        for s in seen
    ]


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_refresh_carries_the_residual_into_the_new_coordinates():
    """At a refresh the residual kept in whitened coordinates is re-expressed in the new ones: mapped
    back to plain coordinates (``T⁻¹``) it is the same error as before (catches a residual left in
    the old coordinates, or remapped twice). The remap computes ``x T_new`` from the same FP32
    ``x = r T_old⁻¹`` the check starts from, so what is left is the FP32 round trip ``(x T_new) T_new⁻¹``:
    within ``2·d·eps·κ(T_new)`` (``tests/unit/test_whitening.py::fp32_bound``)."""
    for per_rank in run_on_ranks(_remap_worker, 2, cpu_harness=True, timeout=600):
        assert per_rank, "no residual was remapped"
        for s in per_rank:
            rel = (s["plain_after"] - s["plain_before"]).norm() / s["plain_before"].norm()
            assert rel <= 2 * s["d"] * EPS32 * s["kappa"], (rel, s["kappa"])
