"""The refresh with output-side (two-sided) statistics: ``T_out`` built beside ``T_in``, the joint
damping choice, the held-out gate on pairs, a skipped output side, and the checkpoint state.

The multi-rank test drives ``RefreshSync`` on plain gloo groups (no Megatron) over 4 ranks laid out
as DP 2 x TP 2, and checks against an independent FP64 reference built from the raw activations
and output gradients: dense factors from ``eigh``, dense ``T = D^{-1/2} (D^{-1/2} Â D^{-1/2})^{-1/2}``
(the one ``T`` with ``Tᵀ Â T = I`` that is ``D^{-1/2}`` times a symmetric matrix: the plugin's), and
every candidate's FP8 error ``‖T_out⁻ᵀ (q(U) - U) T_in⁻¹‖``, ``U = T_outᵀ G T_in``, by brute force.
"""

from pathlib import Path

import pytest
import torch

from megatron_gift.config import GiftConfig, Mode
from megatron_gift.numerics import CodecConfig, KFACStatistics, LowRankWhitening, TwoSidedWhitening
from megatron_gift.numerics.fp8 import roundtrip
from megatron_gift.numerics.refresh import HEADER, BuildStatus, FactorBuild, FactorSide, OwnedLayer
from megatron_gift.testing import run_on_ranks
from tests.reference import output_side

CANDS = (0.1, 1.0, 10.0)
RANK = 4
TOKENS = 64
STEPS = 4  # refreshes at 0 (B empty), 1, 2 (a bad held-out T_out for qkv), 3 (a NaN in fc2's B on rank 0)
# name: (d_out, d_in, output statistics: None, "dp" (column-parallel: B summed over DP) or "dp+tp"
# (row-parallel with sequence parallelism: over DP and TP), B's sketch size (0: exact))
LAYERS = {"qkv": (48, 32, "dp", 0), "fc2": (32, 40, "dp+tp", 0), "proj": (24, 24, None, 0), "fc1": (40, 24, "dp", 16)}
# margin between the reference's best candidate and the runner-up (and between the held-out error
# and Euclidean's) above which the plugin must agree exactly. The plugin's estimates differ from the
# reference's by (a) its FP32 statistics (sums of TOKENS·R products: ~1e-5 relative on A, B), (b) the
# FP32 low-rank T and products against dense FP64 ones (~d·eps32·κ(T) ~ 1e-4 relative on U): these move
# an FP8 code only where U lies within that distance of a rounding boundary, i.e. ~2^3·1e-4 of the
# entries, each changing the error by at most one quantum: the estimates agree to ~1e-3 relative,
# below this margin.
MARGIN = 0.01


def _spd(d: int, decay: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return (basis * torch.logspace(0, -decay, d, dtype=torch.float64)) @ basis.T


def _data(layer: int, rank: int, step: int):
    """Rank ``rank``'s activations ``X [TOKENS, d_in]`` and output gradients ``Y [TOKENS, d_out]`` of
    ``layer`` at ``step`` (anisotropic on both sides); its weight gradient is ``Yᵀ X``."""
    d_out, d_in = list(LAYERS.values())[layer][:2]
    gen = torch.Generator().manual_seed(1000 * layer + 100 * step + rank)
    x = torch.randn(TOKENS, d_in, generator=gen, dtype=torch.float64) @ torch.linalg.cholesky(_spd(d_in, 3.0, layer)).T
    y = (
        torch.randn(TOKENS, d_out, generator=gen, dtype=torch.float64)
        @ torch.linalg.cholesky(_spd(d_out, 3.0, 50 + layer)).T
    )
    return x.float(), y.float()


# --------------------------------------------------------------------------- independent reference


def _ref_factor(m: torch.Tensor, delta: float):
    """``(D, V, Λ)`` of the rank-``RANK`` factor of the dense FP64 ``m`` at relative damping ``delta``."""
    evals, evecs = torch.linalg.eigh(m)
    v, lam = evecs[:, -RANK:], evals[-RANK:]
    d = (torch.diagonal(m) - (v * v) @ lam).clamp_min(0) + delta * torch.trace(m) / m.shape[0]
    return d, v, lam


def _ref_t(m: torch.Tensor, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``(T, T⁻¹)`` for ``G T``: ``T = D^{-1/2} S``, ``S = (D^{-1/2} Â D^{-1/2})^{-1/2}``."""
    d, v, lam = _ref_factor(m, delta)
    # D^{-1/2} (D + V Λ Vᵀ) D^{-1/2} = I + D^{-1/2} V Λ Vᵀ D^{-1/2}
    n = torch.eye(m.shape[0], dtype=torch.float64) + (v * lam) @ v.T / (d.sqrt()[:, None] * d.sqrt()[None, :])
    e, u = torch.linalg.eigh(n)
    s, s_inv = (u * e.rsqrt()) @ u.T, (u * e.sqrt()) @ u.T
    return d.rsqrt()[:, None] * s, s_inv * d.sqrt()[None, :]


def _ref_error(g: torch.Tensor, t_in, t_out, codec: CodecConfig) -> float:
    """``‖T_out⁻ᵀ (q(U) - U) T_in⁻¹‖`` with ``U = T_outᵀ G T_in`` (dense FP64, ``U`` rounded to FP32
    as sent); ``t_*`` ``(T, T⁻¹)`` or None (identity)."""
    g64 = g.double()
    u64 = g64 @ t_in[0] if t_in is not None else g64
    u64 = t_out[0].T @ u64 if t_out is not None else u64
    u = u64.float()
    e = (roundtrip(u, codec) - u).double()
    e = e @ t_in[1] if t_in is not None else e
    e = t_out[1].T @ e if t_out is not None else e
    return float(e.norm())


def _reference(a: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor, side: str, codec: CodecConfig) -> dict:
    """Every candidate's error by brute force: ``{(δ_in, δ_out or None): error}``, and Euclidean's."""
    errs = {}
    pairs = []
    if side == "auto" or b is None:
        pairs += [(di, None) for di in CANDS]
    if b is not None:
        pairs += [(di, do) for di in CANDS for do in CANDS]
    for di, do in pairs:
        errs[di, do] = _ref_error(g, _ref_t(a, di), _ref_t(b, do) if do is not None else None, codec)
    return dict(euclidean=_ref_error(g, None, None, codec), pairs=errs)


def _mean_gram(layer: int, ranks, step: int, which: int) -> torch.Tensor:
    """The FP64 mean of ``x xᵀ`` over the tokens of ``ranks`` at ``step``: ``A`` (``which`` 0) or ``B`` (1)."""
    return sum(_data(layer, r, step)[which].double().T @ _data(layer, r, step)[which].double() for r in ranks) / (
        TOKENS * len(ranks)
    )


def _dense(w: LowRankWhitening | None):
    """``(T, T⁻¹)`` of a held-out transform in FP64, or None."""
    return None if w is None else tuple(t.double() for t in w.dense())


# --------------------------------------------------------------------------- the multi-rank run


def _worker(rank, world, side):
    """4 ranks: DP groups {0, 2}, {1, 3}; TP groups {0, 1}, {2, 3}. Refresh steps 0, 1, 2 (B folded a
    step late: none at step 0); per step what every layer installed, the host waits and collectives,
    and on each layer's owner the reference of its choice."""
    import torch.distributed as dist

    import megatron_gift.refresh_sync as refresh_mod
    from megatron_gift.refresh_sync import RefreshSync
    from megatron_gift.state import GiftParam, GiftState, SideState
    from megatron_gift.testing.dispatch import SyncSanitizer

    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp, tp = dps[rank % 2], tps[rank // 2]
    dp_ranks, all_ranks = [rank % 2, rank % 2 + 2], [0, 1, 2, 3]
    cfg = GiftConfig.build(mode=Mode.GIFT, rank=RANK, sketch=0, damping_candidates=CANDS, refresh_interval=1)
    state = GiftState(cfg, torch.device("cpu"))
    params = []
    for i, (name, (d_out, d_in, out, sketch)) in enumerate(LAYERS.items()):
        gp = GiftParam(name, Mode.GIFT, candidate=True)
        gp.input.stats, gp.input.groups = KFACStatistics(d_in, ema=0.0), [dp]
        if out is not None:
            gp.output = SideState(
                KFACStatistics(d_out, ema=0.0, sketch=sketch, seed=7 + i), [dp] if out == "dp" else [dp, tp]
            )
        params.append(gp)
        state.params[object()] = gp
    st = RefreshSync(state, side)
    every = [(gp, dp) for gp in params]
    st.assign_owners(every)

    reduces, real_reduce = [], dist.all_reduce
    scatters, real_scatter = [], refresh_mod._reduce_scatter
    gathers, real_gather = [], refresh_mod._all_gather
    remaps, seen, sums = [], [], []

    def remap(gp, old, new):
        seen.append((gp, new))

    real_sum = st.sum_statistics

    def spy(layers):  # each statistics' local EMA before the sum, and the sums this rank receives
        local = {
            (gp.name, side): torch.cat([t.reshape(-1).float() for t in refresh_mod._packed(s)]).clone()
            for gp, _ in layers
            for side, s in (("input", gp.input.stats), ("output", output_side(gp).stats))
            if s is not None
        }
        got = real_sum(layers)
        names = {id(gp): gp.name for gp, _ in layers}
        sums.append(
            dict(
                local=local,
                got={
                    (names[i], side): torch.cat([*(t.reshape(-1) for t in s.values()), tokens.reshape(1)]).clone()
                    for (i, side), (s, tokens) in got.items()
                },
            )
        )
        return got

    st.sum_statistics = spy
    dist.all_reduce = lambda t, *a, **k: reduces.append(k.get("group")) or real_reduce(t, *a, **k)
    refresh_mod._reduce_scatter = lambda *a, **k: scatters.append(k.get("group")) or real_scatter(*a, **k)
    refresh_mod._all_gather = lambda *a, **k: gathers.append(1) or real_gather(*a, **k)
    steps = []
    try:
        for step in range(STEPS):
            state.open_step()
            grads = []
            for i, gp in enumerate(params):
                x, y = _data(i, rank, step)
                gp.input.stats.accumulate(x)
                if output_side(gp).stats is not None and step > 0:  # the previous step's output gradients
                    output_side(gp).stats.accumulate(_data(i, rank, step - 1)[1])
                    if step == 3 and gp.name == "fc2" and rank == 0:
                        output_side(gp).stats.sums["xtx"][0, 0] = float("nan")
                    output_side(gp).stats.fold()
                grads.append(y.T @ x)
            if step == 2:  # the held-out gate on pairs: a bad T_out in qkv's held-out pair (it mixes rows)
                qkv = params[0]
                if qkv.owner == dp.rank() and qkv.input.held_out is not None:
                    q, _ = torch.linalg.qr(
                        torch.randn(48, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
                    )
                    bad = LowRankWhitening.identity(48)
                    bad = LowRankWhitening.from_tensors(
                        {
                            **bad.tensors(),
                            "q": q.float(),
                            "c": torch.full((4,), -0.999),
                            "c_inv": torch.full((4,), 999.0),
                        }
                    )
                    qkv.output.held_out = bad
            held = {gp.name: (gp.input.held_out, output_side(gp).held_out) for gp in params if gp.owner == dp.rank()}
            waits, n_reduce, n_scatter, n_gather = st.host_waits, len(reduces), len(scatters), len(gathers)
            san = SyncSanitizer()
            with san:
                st.at_sync([(gp, dp, g) for gp, g in zip(params, grads)], remap)
                st.after_reductions()
                st.close_step([])
                st.install(remap)
            counts = san.counts()
            remaps.extend(
                (
                    gp.name,
                    type(new).__name__,
                    isinstance(new, TwoSidedWhitening) and new.output_side is output_side(gp).whitening,
                )
                for gp, new in seen
            )
            seen.clear()
            is_wait = lambda k: k.endswith("(HostCopy.wait)")  # noqa: E731
            ranks_of = lambda groups: [sorted(dist.get_process_group_ranks(g)) for g in groups]  # noqa: E731
            rec = dict(
                waits=st.host_waits - waits,
                reduces=ranks_of(reduces[n_reduce:]),
                scatters=ranks_of(scatters[n_scatter:]),
                gathers=len(gathers) - n_gather,
                layers={},
                seen_waits=sum(v for k, v in counts.items() if is_wait(k)),
                syncs={k: v for k, v in counts.items() if not is_wait(k)},
                sums=sums.pop(),
            )
            for i, gp in enumerate(params):
                flat = lambda w: None if w is None else torch.cat([t.flatten().double() for t in w.tensors().values()])  # noqa: E731
                f = output_side(gp).factor
                info = dict(
                    owner=gp.owner,
                    damping=gp.input.damping,
                    whitening=flat(gp.input.whitening),
                    output=flat(output_side(gp).whitening),
                    out_factor=None
                    if f is None
                    else torch.cat([f.d, f.v.flatten(), f.lam, torch.tensor([float(f.trace_a), f.damping])]),
                    out_damping=output_side(gp).damping,
                    has_factor=gp.input.factor is not None,
                    out_tokens=None if output_side(gp).stats is None else float(output_side(gp).stats.ema_tokens),
                )
                if gp.owner == dp.rank():  # the reference, from every rank's raw data
                    a, b = _mean_gram(i, dp_ranks, step, 0), None
                    if (
                        output_side(gp).stats is not None and step > 0 and not (step == 3 and gp.name == "fc2")
                    ):  # NaN at 3: no B
                        b = _mean_gram(i, dp_ranks if LAYERS[gp.name][2] == "dp" else all_ranks, step - 1, 1)
                    info["b"] = b
                    info["ref"] = _reference(a, b, grads[i], side, cfg.wire.codec)
                    info["held_out"] = gp.input.held_out.dense() if gp.input.held_out is not None else None
                    info["out_held_out"] = (
                        output_side(gp).held_out.dense() if output_side(gp).held_out is not None else None
                    )
                    h_in, h_out = held[gp.name]  # the previous build's best pair, checked on this gradient
                    if h_in is not None:
                        info["ref_held"] = _ref_error(grads[i], _dense(h_in), _dense(h_out), cfg.wire.codec)
                        info["ref_held_in"] = _ref_error(grads[i], _dense(h_in), None, cfg.wire.codec)
                    else:
                        info["ref_held"] = info["ref_held_in"] = None
                rec["layers"][gp.name] = info
            steps.append(rec)
    finally:
        dist.all_reduce, refresh_mod._all_gather, refresh_mod._reduce_scatter = real_reduce, real_gather, real_scatter
    return dict(steps=steps, remaps=remaps, dp_rank=dp.rank())


@pytest.fixture(scope="module", params=["auto", "both"])
def runs(request):
    return request.param, run_on_ranks(_worker, 4, request.param, timeout=600)


def test_every_rank_installs_the_owners_bits_in_three_host_waits(runs):
    """Per refresh: 3 host waits and no other host synchronisation of the plugin's (the sanitizer); the
    statistics in two calls whatever the number of layers: the row-parallel B (summed over DP and TP)
    all-reduced over TP, then every statistics reduce-scattered over DP onto its owner; one
    all-gather. Every rank of a DP group installs the same bits of ``T_in``, ``T_out`` and both
    dampings, the factors on the owner alone (catches a rank that rebuilds or reads another slot, the
    output record outside the layer's slot, or a factor left on a rank that did not build it)."""
    _, res = runs
    for r, per_rank in enumerate(res):
        dp = [r % 2, r % 2 + 2]
        for s in per_rank["steps"]:
            assert s["waits"] == 3 == s["seen_waits"] and s["syncs"] == {} and s["gathers"] == 1, s["syncs"]
            assert s["reduces"] == [[2 * (r // 2), 2 * (r // 2) + 1]] and s["scatters"] == [dp], (
                s["reduces"],
                s["scatters"],
            )
    for r in (0, 1):
        for s0, s1 in zip(res[r]["steps"], res[r + 2]["steps"]):
            for name in LAYERS:
                a, b = s0["layers"][name], s1["layers"][name]
                for k in ("whitening", "output"):
                    assert (a[k] is None) == (b[k] is None) and (a[k] is None or torch.equal(a[k], b[k])), (name, k)
                assert a["damping"] == b["damping"] and a["out_damping"] == b["out_damping"]
                for info, dp_rank in ((a, 0), (b, 1)):  # s0: DP rank 0 of the group, s1: DP rank 1
                    owner = info["owner"] == dp_rank
                    assert info["has_factor"] == owner and (owner or info["out_factor"] is None), (name, dp_rank)
    # the output side was built and used somewhere, so the comparison above is not vacuous
    assert any(s["layers"][n]["output"] is not None for p in res for s in p["steps"] for n in ("qkv", "fc2", "fc1"))


def _added(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b  # one FP32 addition, as a two-rank sum does (commutative: the same bits in either order)


def test_statistics_reach_their_owner_exactly_summed(runs):
    """Each owner receives, for each of its layers' statistics, exactly (bit for bit) the FP32 sum of
    every rank's local EMA over the statistics' groups, computed here by hand in the collectives'
    grouping: over the layer's DP group for ``A`` and column-parallel ``B``, for the row-parallel
    ``B`` (fc2) the TP pairs' sums first, then over DP; every other rank receives nothing. Catches a
    slot read at another owner's offset, a layer packed under the wrong owner, the TP sum lost or
    taken twice, padding that spills into a neighbour."""
    _, res = runs
    checked = 0
    for step in range(STEPS):
        local = [p["steps"][step]["sums"]["local"] for p in res]
        for r, per_rank in enumerate(res):
            s = per_rank["steps"][step]
            dp = [r % 2, r % 2 + 2]
            mine = {
                (n, side)
                for n, (_, _, out, _) in LAYERS.items()
                for side in ("input", "output")
                if s["layers"][n]["owner"] == per_rank["dp_rank"] and (side == "input" or out is not None)
            }
            assert set(s["sums"]["got"]) == mine, (r, step)
            for (name, side), got in s["sums"]["got"].items():
                if side == "output" and LAYERS[name][2] == "dp+tp":  # TP pairs {0, 1}, {2, 3} first, then DP
                    ref = _added(
                        _added(local[0][name, side], local[1][name, side]),
                        _added(local[2][name, side], local[3][name, side]),
                    )
                else:
                    ref = _added(local[dp[0]][name, side], local[dp[1]][name, side])
                same = (got == ref) | (got.isnan() & ref.isnan())  # fc2's B at step 3 holds a NaN
                assert got.shape == ref.shape and bool(same.all()), (r, step, name, side)
                checked += 1
    assert checked == STEPS * 2 * (len(LAYERS) + sum(out is not None for _, _, out, _ in LAYERS.values()))


def test_no_output_tokens_yet_means_the_input_side_alone(runs):
    """Step 0: ``B`` has no tokens yet (folded a step late): no output side is installed, the input
    side's factor is (catches a refresh that stalls or builds ``T_out`` from an empty ``B``)."""
    _, res = runs
    for per_rank in res:
        first = per_rank["steps"][0]["layers"]
        for name, (_, _, _out, _) in LAYERS.items():
            assert first[name]["output"] is None and first[name]["out_factor"] is None, name
            assert first[name]["whitening"] is not None  # T = I (no held-out check passed yet), factor built


def test_output_statistics_are_summed_over_their_groups(runs):
    """``tr B`` and ``B``'s top eigenvalues of the installed output factor equal the FP64 reference
    summed over DP (column-parallel) or DP and TP (row-parallel with SP): catches ``B`` summed over the
    input side's groups only, or not at all. Bound: FP32 sums of ``TOKENS·4`` products (relative
    ``TOKENS·4·eps32`` on each entry of ``B``; an eigenvalue moves by at most ``‖ΔB‖₂ ≤ d·max|ΔB|``)
    and FP64 eigh."""
    _, res = runs
    for per_rank in res:
        for s in per_rank["steps"][1:]:
            for name in ("qkv", "fc2"):
                info = s["layers"][name]
                if info["owner"] != per_rank["dp_rank"] or info["b"] is None:  # fc2 at step 3: a NaN in B
                    continue
                d_out = LAYERS[name][0]
                f = info["out_factor"]
                b = info["b"]
                tr = f[-2]
                lam = f[d_out + d_out * RANK : d_out + d_out * RANK + RANK]
                tol = TOKENS * 4 * torch.finfo(torch.float32).eps
                assert abs(float(tr) - float(torch.trace(b))) <= tol * float(torch.trace(b)), name
                ref = torch.linalg.eigvalsh(b)[-RANK:]
                assert (lam.sort().values - ref).abs().max() <= tol * float(ref.max()) * d_out, name


def test_non_finite_output_statistics_leave_the_input_side_alone(runs):
    """Step 3: a NaN in rank 0's ``B`` of fc2 (summed over DP and TP: every rank sees it): on every
    rank fc2 is installed without an output side, its input side built, its output EMA restarted, its
    output factor the previous one (catches a whole layer skipped, or a NaN ``T_out`` installed)."""
    _, res = runs
    for per_rank in res:
        before, after = per_rank["steps"][2]["layers"]["fc2"], per_rank["steps"][3]["layers"]["fc2"]
        assert after["output"] is None and after["whitening"] is not None and after["out_tokens"] == 0.0
        assert (
            (after["out_factor"] is None) == (before["out_factor"] is None) == (after["owner"] != per_rank["dp_rank"])
        )
        assert after["out_factor"] is None or torch.equal(after["out_factor"], before["out_factor"])
        assert not torch.equal(after["whitening"], before["whitening"]) or after["damping"] is None


def _plugin_choice(info):
    """The installed choice as ``(δ_in, δ_out or None)``, None for Euclidean."""
    if info["damping"] is None:
        return None
    return (info["damping"], info["out_damping"] if info["output"] is not None else None)


def test_joint_choice_equals_the_brute_force_reference_behind_the_held_out_gate(runs):
    """At every refresh, every owner's installed choice is the brute-force reference: the candidate
    with the smallest FP8 error (``input``-side pairs only in ``auto``, grid x grid, ``(δ, I)`` when
    ``B`` is empty), or Euclidean unless the previous build's best pair beat Euclidean on this gradient
    (the held-out gate, on the pair: qkv's held-out ``T_out`` is replaced by a bad one at step 2, so
    Euclidean there though its input side alone would pass). Catches swapped δ_in/δ_out, a candidate
    set that ignores the side, a gate that checks ``T_in`` alone, a ``T_out`` kept for an input-only
    choice. Exact agreement where the reference's margins exceed ``MARGIN`` (module analysis); the
    test's premise requires it for most cases."""
    side, res = runs
    checked, outputs, gated = 0, 0, 0
    for per_rank in res:
        for step, s in enumerate(per_rank["steps"]):
            for name, info in s["layers"].items():
                if (
                    info["owner"] != per_rank["dp_rank"] or name == "fc1"
                ):  # fc1: a sketched B (Nyström), no dense reference
                    continue
                ref = info["ref"]
                ranked = sorted(ref["pairs"].items(), key=lambda kv: kv[1])
                (best, e_best), (_, e_next) = ranked[0], ranked[1]
                if side == "both" and info["b"] is not None:
                    assert all(do is not None for _, do in ref["pairs"])
                held, eu = info["ref_held"], ref["euclidean"]
                if e_next - e_best <= MARGIN * e_best or abs(e_best - eu) <= MARGIN * eu:
                    continue  # too close to call from outside (module analysis)
                if held is not None and abs(held - eu) <= MARGIN * eu:
                    continue
                expected = None if held is None or held >= eu or e_best >= eu else best
                got = _plugin_choice(info)
                assert got == expected, (side, step, name, got, expected, ref, held)
                checked += 1
                outputs += expected is not None and expected[1] is not None
                gated += held is not None and held >= eu
                # the owner keeps the best pair for the next gate, T_out only if the pair has one
                assert (info["out_held_out"] is not None) == (best[1] is not None), (step, name)
                if step == 2 and name == "qkv":  # the bad held-out T_out closed the gate its T_in alone passes
                    assert held > eu and info["ref_held_in"] < eu and got is None
    assert checked >= 8 and outputs >= 1 and gated >= 1, (checked, outputs, gated)


def test_remap_gets_the_two_sided_map_when_an_output_side_is_installed(runs):
    """The residual's remap receives ``TwoSidedWhitening`` exactly when the new choice has ``T_out``
    (its output side the installed one), a ``LowRankWhitening`` otherwise: catches a residual carried
    over into input-only coordinates while the reduction sends two-sided ones."""
    _, res = runs
    kinds = {new for p in res for _, new, _ in p["remaps"]}
    assert "TwoSidedWhitening" in kinds and "LowRankWhitening" in kinds
    assert all(same for p in res for _, new, same in p["remaps"] if new == "TwoSidedWhitening")


# --------------------------------------------------------------------------- one process


def _owned(out_tokens: float, out_nan: bool = False):
    """proj's exact statistics (24 x 24) with an output side whose ``B`` has ``out_tokens`` tokens."""
    x, y = _data(2, 0, 0)
    sb = {"xtx": (y.T @ y).float()}
    if out_nan:
        sb["xtx"][0, 0] = float("nan")
    return OwnedLayer(
        "proj",
        FactorSide(RANK, {"xtx": (x.T @ x).float()}, torch.tensor(float(TOKENS), dtype=torch.float64), None),
        FactorSide(RANK, sb, torch.tensor(out_tokens, dtype=torch.float64), None),
        grad=y.T @ x,
    )


@pytest.mark.parametrize("status", [BuildStatus.SKIPPED, BuildStatus.NONFINITE])
def test_a_skipped_output_side_says_so_and_the_input_side_goes_on(status):
    """An output side marked skipped or non-finite (as ``RefreshSync`` does from the summed
    statistics) builds nothing, its header says so with no choice and no held-out ``T_out``; the
    input side's record is what an input-only build writes (catches a whole layer dropped, or an
    output ``choice`` of 0 read as a damping)."""
    lay = _owned(0.0 if status is BuildStatus.SKIPPED else float(TOKENS), status is BuildStatus.NONFINITE)
    plain = OwnedLayer("proj", FactorSide(RANK, lay.input.sums, lay.input.tokens, None), grad=lay.grad)
    recs = []
    for layer, kinds in ((lay, ("input", "both")), (plain, ("input",))):
        build = FactorBuild([layer], CANDS, True, CodecConfig(), 12, kinds)
        parts = build.grams()
        if layer.output is not None:
            layer.output.status = status
        parts = build.whitening_cores(build.whitening_grams(build.cores(parts)))
        buf = torch.zeros(layer.layout.nbytes, dtype=torch.uint8)
        build.finish(parts, [layer.layout.views(buf)])
        recs.append(layer.layout.views(buf))
    two, one = recs
    head = dict(zip(HEADER, two["output"]["header"].tolist()))
    assert head["status"] == status and head["choice"] == -1 and head["held_out"] == 0 and head["rank"] == 0
    assert list(one) == ["input"]
    for k, t in one["input"].items():
        assert torch.equal(two["input"][k], t), k


def test_fixed_damping_on_the_auto_side_chooses_the_better_of_input_and_pair():
    """``--gift-damping x`` with ``auto``: the better of ``(x, I)`` and ``(x, x)`` by the reference's FP8
    error, never Euclidean once the held-out check passed (catches the one-candidate shortcut taken
    with two candidates, or an output side kept when ``(x, I)`` wins)."""
    from megatron_gift.numerics.whitening import approximate_factor

    codec = CodecConfig()
    for layer in range(3):
        x, y = _data(layer, 0, 0)
        a, b, g = (x.T @ x).double() / TOKENS, (y.T @ y).double() / TOKENS, y.T @ x
        tokens = torch.tensor(float(TOKENS), dtype=torch.float64)
        lay = OwnedLayer(
            "w",
            FactorSide(
                RANK, {"xtx": (x.T @ x).float()}, tokens, None, LowRankWhitening(approximate_factor(a, RANK, 1.0))
            ),
            FactorSide(RANK, {"xtx": (y.T @ y).float()}, tokens, None),
            grad=g,
        )
        build = FactorBuild([lay], (1.0,), False, codec, 12, ("input", "both"))
        parts = build.whitening_cores(build.whitening_grams(build.cores(build.grams())))
        buf = torch.zeros(lay.layout.nbytes, dtype=torch.uint8)
        rec = lay.layout.views(buf)
        build.finish(parts, [rec])
        t_in = _ref_t(a, 1.0)
        e_in, e_both = _ref_error(g, t_in, None, codec), _ref_error(g, t_in, _ref_t(b, 1.0), codec)
        eu, held = _ref_error(g, None, None, codec), _ref_error(g, _dense(lay.input.held_out), None, codec)
        assert (
            abs(e_in - e_both) > MARGIN * min(e_in, e_both) and held < (1 - MARGIN) * eu
        )  # the premise: clear winner, gate open
        head, out_head = rec["input"]["header"].tolist(), dict(zip(HEADER, rec["output"]["header"].tolist()))
        assert head[2] == 1.0 and out_head["choice"] == (1.0 if e_both < e_in else -1.0), (layer, e_in, e_both)
        assert out_head["held_out"] == (1.0 if e_both < e_in else 0.0) and out_head["status"] == BuildStatus.OK


def test_two_sided_record_layout_views_are_disjoint_and_aligned():
    """The output side's fields follow the input side's in each part (headers, then ``T``s: no factor),
    each in its own bytes, records 8-aligned; without an output side the layout is the input-only one
    (catches overlapping views)."""
    from megatron_gift.numerics.refresh import RecordLayout

    lay = RecordLayout(37, 5, 23, 3)
    assert lay.nbytes % 8 == 0 and RecordLayout(37, 5, 0, 0) == RecordLayout(37, 5)
    buf = torch.zeros(2 * lay.nbytes, dtype=torch.uint8)

    def fields(j):  # every field of record j, each side's in order
        views = lay.views(buf[j * lay.nbytes : (j + 1) * lay.nbytes])
        return views, [t for side in views.values() for t in side.values()]

    for j in range(2):
        for i, t in enumerate(fields(j)[1]):
            t.fill_(100 * j + i + 1)
    for j in range(2):
        views, every = fields(j)
        assert len(every) == 12 and all(torch.all(t == 100 * j + i + 1) for i, t in enumerate(every))
    assert list(views) == ["input", "output"]
    for side in views.values():
        assert list(side) == ["header", "d_inv_sqrt", "d_sqrt", "q", "c", "c_inv"]
        assert side["header"].numel() == len(HEADER) and side["header"].dtype == torch.float64
    assert views["output"]["q"].shape == (23, 3) and views["input"]["q"].shape == (37, 5)
    # the FP64 headers first (input, output), then each side's FP32 fields: the header bytes stay 8-aligned
    assert views["output"]["header"].data_ptr() - views["input"]["header"].data_ptr() == 8 * len(HEADER)


def test_an_indefinite_output_core_offers_no_output_candidate():
    """A sketched ``B`` whose Nyström core never becomes positive definite: the output header says
    INDEFINITE with rank 0, nothing chosen or held out on that side (a diagonal ``T_out`` gains nothing
    and the reduction would skip it), the input side chosen as without output statistics."""
    x, y = _data(3, 0, 0)
    sb = KFACStatistics(40, sketch=8, seed=1)
    sb.accumulate(y)
    sb.fold()
    sb.ema_sums["y"].fill_(float("nan"))
    tokens = torch.tensor(float(TOKENS), dtype=torch.float64)
    recs = []
    for out in (FactorSide(RANK, dict(sb.ema_sums), sb.ema_tokens, sb.omega), None):
        lay = OwnedLayer("fc1", FactorSide(RANK, {"xtx": (x.T @ x).float()}, tokens, None), out, grad=y.T @ x)
        build = FactorBuild([lay], CANDS, True, CodecConfig(), 12, ("input", "both"))
        parts = build.whitening_cores(build.whitening_grams(build.cores(build.grams())))
        buf = torch.zeros(lay.layout.nbytes, dtype=torch.uint8)
        build.finish(parts, [lay.layout.views(buf)])
        recs.append(lay.layout.views(buf))
    head = dict(zip(HEADER, recs[0]["output"]["header"].tolist()))
    assert (
        head["status"] == BuildStatus.INDEFINITE
        and head["rank"] == 0
        and head["choice"] == -1
        and head["held_out"] == 0
    )
    assert list(recs[1]) == ["input"] and all(torch.equal(recs[0]["input"][k], t) for k, t in recs[1]["input"].items())


# --------------------------------------------------------------------------- checkpoint


def _two_sided_state():
    from megatron_gift.numerics.whitening import approximate_factor
    from megatron_gift.state import GiftParam, GiftState, SideState

    state = GiftState(GiftConfig.build(mode=Mode.GIFT, rank=RANK, sketch=0), torch.device("cpu"))
    gp = GiftParam("qkv", Mode.GIFT, candidate=True)
    gp.input.stats, gp.output = KFACStatistics(32, ema=0.5), SideState(KFACStatistics(48, ema=0.5, sketch=16, seed=3))
    return state, gp, approximate_factor


def test_checkpoint_round_trip_is_bit_exact_on_both_sides():
    """Statistics, ``T_out`` and its damping, output factor and held-out ``T_out`` of a two-sided layer
    come back bit for bit through Megatron checkpoints' split (``B``, both factors and the held-out
    ``T_out`` in the per-rank part, with their input-side twins: only their owner holds them), an older
    checkpoint without the output side's keys loads without error with the output side fresh, a
    ``T_out`` saved for a layer now without output statistics stays until the next refresh (the
    residual's coordinates), and another data-parallel layout restores no factor; ``--gift-rotation
    auto``'s choice comes back with its ``T``. Catches an output side dropped or mixed with the input's,
    a factor restored on a rank that did not build it, or the rotation choice lost at a resume."""
    state, gp, approximate_factor = _two_sided_state()
    x, y = _data(0, 0, 0)
    for _ in range(2):
        gp.input.stats.accumulate(x)
        gp.input.stats.fold()
        gp.output.stats.accumulate(y)
        gp.output.stats.fold()
    gp.output.stats.accumulate(y[:5])  # a step's accumulators in flight
    a, b = (x.T @ x).double() / TOKENS, (y.T @ y).double() / TOKENS
    gp.input.factor, gp.output.factor = approximate_factor(a, RANK, 1.0), approximate_factor(b, RANK, 3.0)
    gp.input.whitening, gp.input.damping = LowRankWhitening(gp.input.factor), 1.0
    gp.output.whitening, gp.output.damping = LowRankWhitening(gp.output.factor), 3.0
    gp.input.rotate = True  # --gift-rotation auto's choice
    gp.input.held_out, gp.output.held_out = (
        LowRankWhitening(gp.input.factor.with_damping(0.3)),
        LowRankWhitening(gp.output.factor.with_damping(10.0)),
    )
    state.params[object()] = gp
    residual = torch.randn(48, 32)
    saved = state.state_dict([(residual, gp)])

    # through Megatron checkpoints' split into replicated and per-rank parts: B's statistics and the
    # held-out T_out go with the per-rank part (another rank's would replace them otherwise)
    from types import SimpleNamespace

    from megatron_gift.megatron.checkpoint import merge_state, split_state

    parts = split_state(SimpleNamespace(gift_params={None: gp}), saved)
    for side in ("input", "output"):
        assert {"stats", "held_out", "factor"} == parts["local"]["qkv"][side].keys()
        assert {"stats", "held_out", "factor"}.isdisjoint(parts["dense"]["params"]["qkv"]["sides"][side])
    fresh, gq, _ = _two_sided_state()
    fresh.params[object()] = gq
    back = torch.zeros(48, 32)
    assert fresh.load_state_dict(merge_state(parts), [(back, gq)], torch.device("cpu")) == [] and torch.equal(
        back, residual
    )

    def same(u, v):
        return u.tensors().keys() == v.tensors().keys() and all(
            torch.equal(u.tensors()[k], t) for k, t in v.tensors().items()
        )

    for w, v in (
        (gp.input.whitening, gq.input.whitening),
        (gp.output.whitening, gq.output.whitening),
        (gp.input.held_out, gq.input.held_out),
        (gp.output.held_out, gq.output.held_out),
    ):
        assert v is not None and same(w, v)
    for f, h in ((gp.input.factor, gq.input.factor), (gp.output.factor, gq.output.factor)):
        assert all(torch.equal(s, t) for s, t in ((f.d, h.d), (f.v, h.v), (f.lam, h.lam)))
        assert (f.trace_a, f.damping) == (h.trace_a, h.damping)
    for s, t in ((gp.input.stats, gq.input.stats), (gp.output.stats, gq.output.stats)):
        assert all(
            torch.equal(s.state_dict()[k][n], t.state_dict()[k][n]) for k in ("sums", "ema_sums") for n in s.sums
        )
        assert torch.equal(s.tokens, t.tokens) and torch.equal(s.ema_tokens, t.ema_tokens) and s.folds == t.folds
    assert gq.input.damping == 1.0 and gq.output.damping == 3.0
    assert gq.input.rotate is True and gq.output.rotate is False  # the rotation choice with its T

    # a checkpoint saved with the input side alone: no output side's keys
    entry = saved["params"]["qkv"]
    assert {"stats", "held_out", "factor", "whitening", "damping"} <= entry["sides"]["output"].keys()
    old_input = {k: v for k, v in entry["sides"]["input"].items() if k != "rotate"}  # before --gift-rotation auto
    old = {**entry, "sides": {"input": old_input}}
    old = {"step": saved["step"], "params": {"qkv": old}}
    older, go, _ = _two_sided_state()
    older.params[object()] = go
    assert older.load_state_dict(old, [(torch.zeros(48, 32), go)], torch.device("cpu")) == []
    assert (
        go.output.whitening is None
        and go.output.factor is None
        and go.output.held_out is None
        and float(go.output.stats.ema_tokens) == 0
    )
    assert go.output.damping is None and torch.equal(go.input.factor.v, gp.input.factor.v)
    assert go.input.rotate is False  # an older checkpoint: no rotation chosen yet
    assert same(go.input.whitening, gp.input.whitening)

    # saved two-sided, restored without output statistics: T_out kept with T_in until the next refresh
    nout, gn, _ = _two_sided_state()
    gn.output = None
    nout.params[object()] = gn
    assert nout.load_state_dict(saved, [(torch.zeros(48, 32), gn)], torch.device("cpu")) == []
    assert same(gn.output.whitening, gp.output.whitening) and gn.output.factor is None and gn.output.damping == 3.0

    # another data-parallel layout (``local=False``): the owner's factors are per rank, none restored
    other, gl, _ = _two_sided_state()
    other.params[object()] = gl
    assert other.load_state_dict(saved, [(torch.zeros(48, 32), gl)], torch.device("cpu"), local=False) == []
    assert gl.input.factor is None and gl.output.factor is None and same(gl.output.whitening, gp.output.whitening)


def test_a_version_1_checkpoint_loads_into_both_sides():
    """``tests/data/gift-state-v1.pt`` was written by megatron-gift before ``SideState`` (a0ccaeb; checkpoint
    format 1: the output side's state beside the input side's, nested as ``"out"``, the per-rank ``T`` and
    factors under ``#held_out`` / ``#factor``), for a two-sided layer and a Euclidean one, with the values
    each side held. Loaded through Megatron checkpoints' merge of version 1's parts and straight from its
    state dict, every value comes back on its own side bit for bit. Catches a version 1 checkpoint read
    as fresh, or an output side's value put on the input side (or lost)."""
    from types import SimpleNamespace

    from megatron_gift.megatron.checkpoint import merge_state, misfit
    from megatron_gift.state import GiftParam, GiftState, SideState

    data = torch.load(Path(__file__).parents[1] / "data" / "gift-state-v1.pt", weights_only=False)
    want = data["expected"]
    for state in (merge_state(data["parts"], version=1), data["state"]):
        gs = GiftState(GiftConfig.build(mode=Mode.GIFT, rank=4, sketch=0), torch.device("cpu"))
        gp = GiftParam("qkv", Mode.GIFT, candidate=True)
        gp.input.stats = KFACStatistics(12, ema=0.5)
        gp.output = SideState(KFACStatistics(16, ema=0.5, sketch=8, seed=3))
        eu = GiftParam("emb", Mode.EUCLIDEAN)
        gs.params[object()], gs.params[object()] = gp, eu
        residual = torch.zeros(16, 12)
        ddp = SimpleNamespace(gift_params={torch.zeros(16, 12): gp, torch.zeros(3): eu})
        assert misfit(ddp, data["parts"], version=1) is None
        assert gs.load_state_dict(state, [(residual, gp)], torch.device("cpu")) == []
        assert gs.step == want["step"] and torch.equal(residual, want["residual"])
        assert eu.output is None and eu.input.whitening is None and eu.input.stats is None
        for side in ("input", "output"):
            s = getattr(gp, side)
            stats = s.stats.state_dict()
            for key in ("sums", "ema_sums"):
                assert stats[key].keys() == want[f"{side}.stats"][key].keys()
                assert all(torch.equal(t, want[f"{side}.stats"][key][k]) for k, t in stats[key].items()), side
            assert torch.equal(stats["ema_tokens"], want[f"{side}.stats"]["ema_tokens"]), side
            for key in ("whitening", "held_out"):
                got = getattr(s, key).tensors()
                assert got.keys() == want[f"{side}.{key}"].keys()
                assert all(torch.equal(t, want[f"{side}.{key}"][k]) for k, t in got.items()), (side, key)
            assert s.damping == want[f"{side}.damping"]
            f, g = s.factor, want[f"{side}.factor"]
            assert torch.equal(f.d, g["d"]) and torch.equal(f.v, g["v"]) and torch.equal(f.lam, g["lam"])
            assert (f.trace_a, f.damping) == (g["trace_a"], g["damping"])


def test_a_garbled_entry_inside_a_part_is_a_misfit_not_an_exception():
    """A per-rank entry of another shape (bytes, or a side that is not a dict) makes ``misfit`` name
    the state garbled, so the load starts GIFT fresh with a message. Bug caught: the merge raising
    out of Megatron's checkpoint load (a load must never fail for GIFT's state)."""
    from types import SimpleNamespace

    from megatron_gift.megatron.checkpoint import misfit
    from megatron_gift.state import GiftParam

    gp = GiftParam("w", Mode.GIFT, candidate=True)
    gp.input.stats = KFACStatistics(4)
    ddp = SimpleNamespace(gift_params={torch.zeros(3, 4): gp})
    dense = {"step": 1, "params": {"w": {"mode": "gift"}}}
    for local in ({"w": b"junk"}, {"w": {"input": 3}}):
        assert "garbled" in misfit(ddp, {"dense": dense, "local": local}), local


def test_input_side_with_output_statistics_is_refused_at_start_up():
    """A layer with output statistics under ``side='input'`` (an adapter bug) is a clear error when the
    owners are assigned, not a silently unused ``T_out``; an unknown side too."""
    from megatron_gift.refresh_sync import RefreshSync

    state, gp, _ = _two_sided_state()

    class Group:
        def size(self):
            return 2

    with pytest.raises(ValueError, match="output-gradient statistics"):
        RefreshSync(state).assign_owners([(gp, Group())])
    with pytest.raises(ValueError, match="side must be"):
        RefreshSync(state, "output")


# --------------------------------------------------------------------------- the statistics' collectives


def _sum_worker(rank, world):
    """``sum_statistics`` over 4 ranks in two distributed-optimizer instances ({0, 1}, {2, 3}: the
    owners' reduction groups), for every combination of statistics groups the adapter builds: the
    whole data-parallel group (several instances), the instance itself, another object over the
    instance's ranks, the instance and TP ({0, 2}, {1, 3}: sequence parallelism); an output side too.
    Returns each rank's local EMAs, what it received, and the collectives' groups in call order."""
    import torch.distributed as dist

    import megatron_gift.refresh_sync as refresh_mod
    from megatron_gift.refresh_sync import RefreshSync
    from megatron_gift.state import GiftParam, GiftState, SideState

    everyone = dist.new_group([0, 1, 2, 3])
    inst = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    alias = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    me, own = inst[rank // 2], alias[rank // 2]
    groups = {"all": [everyone], "instance": [me], "alias": [own], "instance+tp": [me, tp[rank % 2]]}
    state = GiftState(GiftConfig.build(mode=Mode.GIFT, rank=RANK, sketch=0), torch.device("cpu"))
    gen = torch.Generator().manual_seed(rank)
    every, local = [], {}
    for i, (name, g) in enumerate(groups.items()):
        gp = GiftParam(name, Mode.GIFT, candidate=True)
        gp.input.stats, gp.input.groups, gp.owner = KFACStatistics(6 + i, sketch=3 if i % 2 else 0, seed=i), g, i % 2
        if name == "instance+tp":
            gp.output = SideState(KFACStatistics(5, seed=9), [tp[rank % 2], me])  # the owners' group second
        for side, st in (("input", gp.input.stats), ("output", output_side(gp).stats)):
            if st is not None:
                for t in st.ema_sums.values():
                    t.copy_(torch.randn(t.shape, generator=gen))
                st.ema_tokens.fill_(10.0 + rank)
                local[name, side] = torch.cat([t.reshape(-1).float() for t in refresh_mod._packed(st)])
        every.append((gp, me))
    calls, real_reduce, real_scatter = [], dist.all_reduce, refresh_mod._reduce_scatter
    seen = lambda name, k: calls.append((name, sorted(dist.get_process_group_ranks(k["group"]))))  # noqa: E731
    dist.all_reduce = lambda t, *a, **k: seen("all_reduce", k) or real_reduce(t, *a, **k)
    refresh_mod._reduce_scatter = lambda *a, **k: seen("reduce_scatter", k) or real_scatter(*a, **k)
    try:
        got = RefreshSync(state, "both").sum_statistics(every)
    finally:
        dist.all_reduce, refresh_mod._reduce_scatter = real_reduce, real_scatter
    names = {id(gp): gp.name for gp, _ in every}
    return dict(
        local=local,
        calls=calls,
        got={
            (names[i], side): torch.cat([*(t.reshape(-1) for t in s.values()), n.reshape(1)])
            for (i, side), (s, n) in got.items()
        },
    )


def test_statistics_reach_their_owners_for_every_group_combination():
    """Every owner receives its statistics summed over exactly their groups: over all 4 ranks (several
    instances: all-reduced, the owner reads its share), over its instance (reduce-scattered, also when
    the statistics' group is another object over the same ranks), over its instance and TP (all-reduced
    over TP first, whichever order the groups are listed in); non-owners receive nothing. Two-rank sums
    are one FP32 addition (the same bits in either order): exact; the 4-rank all-reduce's order is
    gloo's: within 3 FP32 roundings of ``Σ|x|``. Collectives: one all-reduce per group of each distinct
    tuple of other groups (all ranks; TP), one reduce-scatter over the instance. Catches a statistics
    reduce-scattered over a group that is only part of its groups (the sum of one instance), a TP sum
    lost, a slot read at another owner's offset."""
    res = run_on_ranks(_sum_worker, 4, timeout=600)
    eps = torch.finfo(torch.float32).eps
    for r, per_rank in enumerate(res):
        inst, tp = [2 * (r // 2), 2 * (r // 2) + 1], [r % 2, r % 2 + 2]
        assert per_rank["calls"] == [("all_reduce", [0, 1, 2, 3]), ("all_reduce", tp), ("reduce_scatter", inst)], (
            per_rank["calls"]
        )
        owned = {
            (n, s)
            for i, n in enumerate(("all", "instance", "alias", "instance+tp"))
            for s in ("input", "output")
            if i % 2 == r % 2 and (s == "input" or n == "instance+tp")
        }
        assert set(per_rank["got"]) == owned, (r, per_rank["got"].keys())
        for (name, side), got in per_rank["got"].items():
            x = [p["local"][name, side] for p in res]
            if name == "all":
                ref = sum(t.double() for t in x)
                assert ((got.double() - ref).abs() <= 3 * eps * sum(t.double().abs() for t in x)).all(), (r, name)
                continue
            if name == "instance+tp":  # TP pairs ({0, 2}, {1, 3}) first, then the instance
                ref = _added(_added(x[inst[0]], x[(inst[0] + 2) % 4]), _added(x[inst[1]], x[(inst[1] + 2) % 4]))
            else:
                ref = _added(x[inst[0]], x[inst[1]])
            assert torch.equal(got, ref), (r, name, side)


def _few_layers_worker(rank, world):
    """One layer (both sides) owned by rank 0 of a 4-rank group: ``sum_statistics``'s collectives and result."""
    import torch.distributed as dist

    import megatron_gift.refresh_sync as refresh_mod
    from megatron_gift.refresh_sync import RefreshSync
    from megatron_gift.state import GiftParam, GiftState, SideState

    group = dist.new_group([0, 1, 2, 3])
    state = GiftState(GiftConfig.build(mode=Mode.GIFT, rank=RANK, sketch=0), torch.device("cpu"))
    gp = GiftParam("w", Mode.GIFT, candidate=True)
    gp.input.stats, gp.input.groups = KFACStatistics(7, sketch=3, seed=1), [group]
    gp.output = SideState(KFACStatistics(5, seed=2), [group])
    gen, local = torch.Generator().manual_seed(rank), {}
    for side, st in (("input", gp.input.stats), ("output", output_side(gp).stats)):
        for t in st.ema_sums.values():
            t.copy_(torch.randn(t.shape, generator=gen))
        st.ema_tokens.fill_(10.0 + rank)
        local[side] = torch.cat([t.reshape(-1).float() for t in refresh_mod._packed(st)])
    calls, real_reduce, real_scatter = [], dist.all_reduce, refresh_mod._reduce_scatter
    dist.all_reduce = lambda t, *a, **k: calls.append("all_reduce") or real_reduce(t, *a, **k)
    refresh_mod._reduce_scatter = lambda *a, **k: calls.append("reduce_scatter") or real_scatter(*a, **k)
    try:
        got = RefreshSync(state, "both").sum_statistics([(gp, group)])
    finally:
        dist.all_reduce, refresh_mod._reduce_scatter = real_reduce, real_scatter
    return dict(
        local=local,
        calls=calls,
        bytes=dict(state.ledger.as_dict()),
        got={
            side: torch.cat([*(t.reshape(-1) for t in s.values()), n.reshape(1)]) for (_, side), (s, n) in got.items()
        },
    )


def test_statistics_all_reduced_where_equal_slots_would_send_more():
    """More ranks than layers to own: reduce-scattered in equal slots (the largest owner's share) a
    rank would send ``(R-1)·slot``, here 3x the statistics where a ring all-reduce sends 1.5x: the
    group's statistics are all-reduced instead (one call, its bytes in the ledger), and the owner
    still reads exactly its layer's sums (gloo's 4-rank order: within 3 FP32 roundings of ``Σ|x|``),
    the others nothing. Catches the padded reduce-scatter kept at any group size (what the planner
    priced as 459 MB per rank per refresh at 600M on 512 ranks, against 57 MB all-reduced)."""
    res = run_on_ranks(_few_layers_worker, 4, timeout=600)
    eps = torch.finfo(torch.float32).eps
    for r, per_rank in enumerate(res):
        assert per_rank["calls"] == ["all_reduce"], (r, per_rank["calls"])
        assert any(k.startswith("all_reduce") for k in per_rank["bytes"]), per_rank["bytes"]
        assert set(per_rank["got"]) == ({"input", "output"} if r == 0 else set()), (r, per_rank["got"].keys())
        for side, got in per_rank["got"].items():
            x = [p["local"][side].double() for p in res]
            assert ((got.double() - sum(x)).abs() <= 3 * eps * sum(t.abs() for t in x)).all(), side
