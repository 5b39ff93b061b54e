"""``--gift-layers auto`` and telemetry inside GiftDistributedDataParallel (real Megatron DDP, 2 gloo ranks).

Every step profiles and logs, with error feedback on. Checked against quantities computed
independently of the plugin: each record's per-layer RelL2 and cosine equal those of the reduced
gradients against a hand-made FP64 sum of the local gradients; every reduced gradient is within
``tests/bounds.py``'s bound for the mode it was sent in, around that sum plus the error-feedback
residuals carried into the step (read from ``gift_state_dict`` and mapped to the gradient's
coordinates); every rank writes the same records; every decision is the one a fresh
``LayerPolicy`` takes from the record's own profiles, and the switches the profiles call for
(Euclidean → GIFT, FP8 → BF16, BF16 → FP8 after a restore) happen. ``set_mode`` carries a GIFT
layer's residual to plain coordinates and back (FP64 ``T⁻¹``/``T`` within FP32 rounding), and the
policy's decisions survive ``gift_state_dict`` / ``load_gift_state_dict`` into a fresh model. The
``auto`` run again with ``--gift-side both``: the same checks with the residuals in ``T_outᵀ G T_in``'s
coordinates, and each two-sided layer's profile measuring that map (an FP64 round trip by hand).
"""

import copy
import json
import math

import pytest
import torch
import torch.distributed as dist

from megatron_gift.config import GiftConfig, Mode, PolicyConfig, Side
from megatron_gift.numerics import CodecConfig
from megatron_gift.policy import LayerPolicy
from megatron_gift.telemetry import jsonable
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens
from megatron_gift.testing.reference import all_gather_rows, gathered_local_gradients, shard_pieces
from tests.bounds import ReductionPath, reduction_errors

pytestmark = pytest.mark.cpu_harness
STEPS = 4
EPS32 = 2.0**-24
RESTORED = PolicyConfig(hysteresis=1, profile_steps=2 * STEPS, margin=0.99, bf16_bound=10.0)


def _ddp(policy: PolicyConfig, side: Side = Side.INPUT):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    model = build_tiny_gpt(hidden_size=72, ffn_hidden_size=136)
    cfg = GiftConfig.build(
        mode=Mode.GIFT,
        codec=CodecConfig("e4m3", "block"),
        rank=8,
        refresh_interval=1,
        error_feedback=True,
        policy=policy,
        log_interval=1,
        side=side,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=6000
    )
    return model, GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=cfg)


def _residuals(ddp, group) -> dict:
    """Every rank's committed error-feedback residual of each FP8 parameter, in the gradient's own
    coordinates and scale (``ε = e T⁻¹`` for a GIFT layer's whitened ``e``, ``T_out⁻ᵀ e T⁻¹`` with an
    output side, times the group size that Megatron divided the bucket by before it was encoded):
    ``{param: [ranks, numel]}``."""
    from megatron_gift.megatron.bucket_group import sent_map

    state = ddp.gift_state_dict()  # closes the step: commits its residuals
    out = {}
    for p, g in ddp.gift_params.items():
        r = state["params"][g.name].get("residual")
        if r is None:
            continue
        if g.mode is Mode.GIFT and g.input.whitening is not None:
            r = sent_map(g).inverse(r)
        out[p] = all_gather_rows(r.double().flatten(), group) * group.size()
    return out


def _owned(rank, world):
    return lambda bg, bucket: slice(
        rank * bucket.grad_data.numel() // world, (rank + 1) * bucket.grad_data.numel() // world
    )


def _as_sent(ddp, rank, world) -> list:
    """This rank's reduced shard of each parameter sent in FP8 this step, with what the invariant
    of ``_feedback_invariant`` needs: ``(param, shard slice of the parameter, reduced values, dense
    |T| |T⁻¹| (None: Euclidean) and with an output side |T_out| |T_out⁻¹| after them, the terms the
    maps add (T's rank, plus T_out's and the rows with an output side))``."""
    from megatron_gift.megatron.bucket_group import output_side

    out = []
    for bucket, p, g, a, lo, hi in shard_pieces(ddp, rank, world):
        if g.mode not in (Mode.EUCLIDEAN, Mode.GIFT):
            continue
        w = g.input.whitening if g.mode is Mode.GIFT else None
        o = output_side(g) if w is not None else None
        mags = None if w is None else tuple(m.double().abs() for t in (w, o) if t is not None for m in t.dense())
        terms = 0 if w is None else w.rank + (o.rank + o.d_in if o is not None else 0)
        out.append((p, slice(lo - a, hi - a), bucket.grad_data[lo:hi].double().clone(), mags, terms))
    return out


def _feedback_invariant(sent, local, carried_in, carried_out, world) -> list[tuple[float, float]]:
    """``(‖got − Σ_r (G_r + ε_r − ε'_r) / R‖, tolerance)`` per FP8 parameter shard of one step, with
    ``ε_r`` the residual carried in and ``ε'_r`` the one carried out, in gradient coordinates.

    Error feedback sends ``Q(Ũ_r)``, ``Ũ_r = U_r + e_r``, and keeps ``e'_r = Ũ_r − dec(Q(Ũ_r))``, so
    the receiver's sum ``Σ_r dec(Q(Ũ_r)) = Σ_r (U_r + e_r − e'_r)`` holds exactly but for FP32: it is
    no bound on a rounding, an identity. Mapped by ``T⁻¹`` (``ε = e T⁻¹``; the bucket divided by ``R``
    first) it leaves only FP32 work, each step a sum of at most ``d + r + R + 6`` products
    (tests/bounds.py's accounting): ``G T``, ``U + e``, the rank sum, ``· T⁻¹`` in the runtime, the
    test's two maps of the residuals to gradient coordinates, and a refresh's or mode switch's
    ``T_old⁻¹ T_new`` carried on them: at most 7 such steps, each within ``(d + r + R + 6) 2^-24`` of
    ``Z |T| |T⁻¹|``, ``Z = Σ_r (|G_r| + |ε_r| + |ε'_r|)``. A residual never fed back leaves
    ``Σ_r ε_r / R`` (FP8's own error, ~2^-5 of the gradient) in the difference, hundreds of times
    the tolerance; one fed back in the wrong coordinates leaves the difference of its two maps."""
    out = []
    for p, region, got, mags, rank in sent:
        if p not in carried_out:  # dropped at the close (a switch to BF16): nothing to balance
            continue
        g = local[p].double()
        e_in = carried_in[p] if p in carried_in else torch.zeros_like(g)
        e_out = carried_out[p]
        want = (g + e_in - e_out).sum(0)[region] / world
        cols = p.numel() // (p.shape[0] if p.dim() > 1 else 1)  # as the bucket views it (tests/bounds.py)
        z = (g.abs() + e_in.abs() + e_out.abs()).sum(0).view(-1, cols)
        if mags is not None:
            z = z @ mags[0] @ mags[1]
        if mags is not None and len(mags) == 4:  # the output side: |T_out⁻ᵀ| |T_outᵀ| Z |T| |T⁻¹|
            z = mags[3].T @ mags[2].T @ z
        tol = 7 * (cols + rank + world + 6) * EPS32 * float(z.flatten()[region].norm()) / world
        out.append((float((got - want).norm()), tol))
    return out


def _train(model, ddp, steps, first_step=0):
    """``steps`` steps of plain SGD on the FP64 sum; per step the records' checks (RelL2 and cosine
    of each layer by hand) and the errors against tests/bounds.py."""
    from megatron.core import parallel_state

    ref = build_tiny_gpt(hidden_size=72, ffn_hidden_size=136)
    group = parallel_state.get_data_parallel_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    records, raw = [], []

    def sink(step, record):
        records.append(json.dumps(jsonable(record), sort_keys=True))
        raw.append(copy.deepcopy(record))

    ddp.monitor.sink = sink
    checks, errors, invariants, residuals, profiled = [], [], [], _residuals(ddp, group), []
    for step in range(first_step, first_step + steps):
        ddp.zero_grad_buffer()
        tokens = random_tokens(step, rank)
        lm_loss(ddp, tokens).backward()
        ddp.finish_grad_sync()
        local = gathered_local_gradients(ref, model, lambda m: lm_loss(m, tokens), lambda p: group)
        profiled.append(_two_sided_round_trips(ddp, local))
        errors.append(
            reduction_errors(
                ddp, local, lambda p: 1.0 / world, ReductionPath(), owned=_owned(rank, world), residuals=residuals
            )
        )
        sent = _as_sent(ddp, rank, world)  # before the close: its decisions may switch modes
        expected = {p: g.sum(0) / world for p, g in local.items()}
        # RelL2 / cosine of each parameter's reduced gradient (this rank's shard, summed over ranks)
        names = {p: g.name for p, g in ddp.gift_params.items()}
        sums = {}
        for bucket, p, _, a, lo, hi in shard_pieces(ddp, rank, world):
            got, want = bucket.grad_data[lo:hi].double(), expected[p][lo - a : hi - a]
            sums[names[p]] = torch.stack(
                [((got - want) ** 2).sum(), (want**2).sum(), (got * want).sum(), (got**2).sum()]
            )
        keys = sorted(names.values())
        total = torch.stack([sums.get(k, torch.zeros(4, dtype=torch.float64)) for k in keys])
        dist.all_reduce(total, group=group)
        checks.append({k: (math.sqrt(e / r), d / math.sqrt(g * r)) for k, (e, r, d, g) in zip(keys, total.tolist())})
        carried_in, residuals = residuals, _residuals(ddp, group)  # closes the step: its record goes out
        invariants.append(_feedback_invariant(sent, local, carried_in, residuals, world))
        with torch.no_grad():  # a plain SGD step on the FP64 average
            for p in model.parameters():
                p -= 1e-2 * expected[p].view_as(p).to(p.dtype)
    modes = {g.name: g.mode.value for g in ddp.gift_params.values()}
    return dict(
        records=records, raw=raw, checks=checks, errors=errors, invariants=invariants, modes=modes, profiled=profiled
    )


def _two_sided_round_trips(ddp, local) -> dict:
    """``{name: (RelL2 through T_outᵀ G T_in, RelL2 through G T_in alone)}`` of the FP8 round trip of every
    rank's local gradient (FP64 dense maps; the codec's ``encode``/``decode``), summed over ranks as a
    profile is, for each layer with an output side in use: what its profile's GIFT RelL2 must be."""
    from megatron_gift.megatron.bucket_group import output_side
    from megatron_gift.numerics.fp8 import decode, encode

    cfg, out = ddp.gift_config.wire.codec, {}
    for p, g in ddp.gift_params.items():
        o = output_side(g)
        if o is None or g.input.whitening is None:
            continue
        (t, t_inv), (s, s_inv) = ((m.double() for m in w.dense()) for w in (g.input.whitening, o))
        grads = local[p].view(-1, *p.shape)
        err = {True: 0.0, False: 0.0}
        for two in err:
            a, a_inv = (s, s_inv) if two else (torch.eye(p.shape[0], dtype=torch.float64),) * 2
            for x in grads:
                u = (a.T @ x @ t).float()
                back = a_inv.T @ decode(encode(u, cfg), cfg, out_shape=u.shape).double() @ t_inv
                err[two] += float(((back - x) ** 2).sum())
        sq = float((grads**2).sum())
        out[g.name] = ((err[True] / sq) ** 0.5, (err[False] / sq) ** 0.5)
    return out


def _conversion(ddp):
    """``set_mode`` of one GIFT layer to Euclidean and back: its residual before and after each
    switch, its ``T`` (dense) and the condition number of its FP64 factor."""
    g = next(
        (
            g
            for g in ddp.gift_params.values()
            if g.mode is Mode.GIFT and g.input.whitening is not None and g.input.whitening.rank
        ),
        None,
    )
    if g is None:
        return None
    seen = [ddp.gift_state_dict()["params"][g.name]["residual"].double()]
    for mode in (Mode.EUCLIDEAN, Mode.GIFT):
        ddp.set_mode(g, mode)
        seen.append(ddp.gift_state_dict()["params"][g.name]["residual"].double())
    kappa = float(
        torch.linalg.cond(g.input.whitening.dense()[0].double())
    )  # κ(T) (Tᵀ Â T = I: κ(T)² = κ(Â)), on every rank
    return dict(
        name=g.name, residuals=seen, t=g.input.whitening.dense()[0].double(), kappa=kappa, rank=g.input.whitening.rank
    )


def _worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    # margin 0, one profile: a layer goes GIFT as soon as its GIFT profile beats Euclidean's
    auto = PolicyConfig(hysteresis=1, profile_steps=STEPS, margin=0.0)
    model, ddp = _ddp(auto)
    out["auto"] = _train(model, ddp, STEPS)
    out["auto"]["conversion"] = _conversion(ddp)
    # the same with --gift-side both: profiles, decisions and residuals through T_outᵀ G T_in
    model, ddp = _ddp(auto, Side.BOTH)
    out["auto_both"] = _train(model, ddp, STEPS)
    out["auto_both"]["two_sided"] = sum(
        g.output is not None and g.output.whitening is not None for g in ddp.gift_params.values()
    )
    # an unreachable FP8 bound: every candidate falls back to BF16 after two profiles
    model, ddp = _ddp(PolicyConfig(hysteresis=2, profile_steps=STEPS, bf16_bound=1e-4))
    out["bf16"] = _train(model, ddp, STEPS)
    state = ddp.gift_state_dict()
    # restored into a fresh model whose bound FP8 meets: BF16 -> FP8 at the first profile (back to
    # FP8 below bound x (1 - margin) = 0.1; GIFT needs 1% of Euclidean's error: Euclidean)
    restored = RESTORED
    model, fresh = _ddp(restored)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ddp.module.parameters()):
            p.copy_(q)
    fresh.load_gift_state_dict(state)
    out["restored_modes"] = {g.name: g.mode.value for g in fresh.gift_params.values()}
    out["restored_layouts"] = [
        [s.mode for s in a.segments] == [s.mode for s in b.segments]
        for a, b in zip((b.layout for b in ddp.gift_buckets()), (b.layout for b in fresh.gift_buckets()))
    ]
    out["restored_policy"] = state["policy"]
    out["restored"] = _train(model, fresh, 2, first_step=STEPS)
    parallel_state.destroy_model_parallel()
    return out


def _replay(raw, config: PolicyConfig, state=None) -> list[tuple]:
    """The decisions a fresh LayerPolicy takes from the records' own profiles, in record order."""
    policy = LayerPolicy(config)
    if state is not None:
        policy.load_state_dict(state)
    out = []
    for record in raw:
        for name in sorted(record["layers"]):
            d = policy.decide(name, record["layers"][name]["profile"])
            if d.changed:
                out.append((record["step"], name, d.previous.value, d.mode.value))
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 2, cpu_harness=True, timeout=600)


@pytest.mark.slow
def test_records_match_the_reduced_gradients(results):
    """Telemetry (RelL2, cosine) equals the reduced gradients' own against the FP64 sum, on every
    rank's same record; every parameter within its mode's bound at every step, the carried
    error-feedback residuals accounted for (bugs caught: a residual lost or left in the wrong
    coordinates at a refresh or a mode switch; a wrong T⁻¹); and every FP8 parameter's reduced shard
    is, to FP32 rounding, the sum of the gradients plus the residuals carried in minus those carried
    out (``_feedback_invariant``: an identity of error feedback, which a residual never fed back breaks
    by FP8's whole error)."""
    for name in ("auto", "auto_both", "bf16", "restored"):
        res, other = results[0][name], results[1][name]
        records = [json.loads(r) for r in res["records"]]
        mine = [{k: v for k, v in r.items() if k != "bytes"} for r in records]  # bytes: what each rank sent
        assert mine == [{k: v for k, v in json.loads(r).items() if k != "bytes"} for r in other["records"]], name
        first = STEPS + 1 if name == "restored" else 1
        assert [r["step"] for r in records] == list(range(first, first + len(res["checks"])))
        for r, check in zip(records, res["checks"]):
            assert set(r["layers"]) == set(check)
            for layer, (rel, cos) in check.items():
                got = r["layers"][layer]
                assert math.isclose(got["rel_l2"], rel, rel_tol=1e-4, abs_tol=1e-7), (
                    name,
                    r["step"],
                    layer,
                    got["rel_l2"],
                    rel,
                )
                assert math.isclose(got["cos"], cos, rel_tol=1e-6), (name, layer)
                assert got["profile"]["ranks"] == 2 and got["bytes"] > 0
        for rank_res in (res, other):
            for step, errors in enumerate(rank_res["errors"]):
                over = [e for e in errors if not e[2] <= e[3]]
                assert errors and not over, (name, step, over)
            # error feedback's identity, to FP32 rounding: a residual lost, not fed back or fed back in
            # other coordinates departs by FP8's error, not by 0.1% (``_feedback_invariant``)
            for step, inv in enumerate(rank_res["invariants"]):
                assert all(err <= tol for err, tol in inv), (name, step, [e for e in inv if e[0] > e[1]])
        if name in ("auto", "auto_both"):
            assert sum(len(inv) for inv in res["invariants"][1:]) > 0  # residuals carried in and balanced


@pytest.mark.slow
def test_decisions_follow_the_profiles(results):
    """Each decision is the one a fresh LayerPolicy takes from the same records' profiles, no more
    and no fewer; and the switches those profiles call for happen: Euclidean → GIFT (auto, margin 0),
    every candidate FP8 → BF16 after two profiles (an unreachable bound), BF16 → Euclidean at the
    first profile after a restore (the bound met, margin 0.99)."""
    for res in results:
        auto, bf16, restored = res["auto"], res["bf16"], res["restored"]
        got = lambda run: [(d["step"], d["param"], d["from"], d["to"]) for r in run["raw"] for d in r["decisions"]]  # noqa: E731
        for run in (auto, res["auto_both"]):  # --gift-side input and both
            assert sorted(got(run)) == sorted(
                _replay(run["raw"], PolicyConfig(hysteresis=1, profile_steps=STEPS, margin=0.0))
            )
            assert any(t == "gift" for _, _, _, t in got(run)), "no layer switched to GIFT: the auto run is vacuous"
            assert set(run["modes"].values()) <= {"euclidean", "gift"}
        assert res["auto_both"]["two_sided"] > 0, "no output side installed: the two-sided auto run is vacuous"

        assert sorted(got(bf16)) == sorted(
            _replay(bf16["raw"], PolicyConfig(hysteresis=2, profile_steps=STEPS, bf16_bound=1e-4))
        )
        assert {(s, t) for s, _, _, t in got(bf16)} == {(2, "bf16")} and len(got(bf16)) == len(bf16["modes"])
        assert set(bf16["modes"].values()) == {"bf16"}
        assert all(v["mode"] == "bf16" for r in bf16["raw"][1:] for v in r["layers"].values())
        # BF16 travels in the same messages, named by what they carry: FP8 codes before the switch, BF16
        # after it (issue 37 item 5: logged and reported as fp8+scales throughout)
        records = [json.loads(r) for r in bf16["records"]]
        assert all(("all_to_all/fp8+scales" in r["bytes"]) != ("all_to_all/bf16" in r["bytes"]) for r in records)
        assert "all_to_all/bf16" in records[-1]["bytes"] and "all_to_all/fp8+scales" in records[0]["bytes"]
        # the policy's state through a checkpoint: modes and layouts restored, then the switch back to FP8
        assert res["restored_modes"] == bf16["modes"] and all(res["restored_layouts"])
        replay = _replay(restored["raw"], RESTORED, res["restored_policy"])
        assert sorted(got(restored)) == sorted(replay)
        assert {(s, f, t) for s, _, f, t in got(restored)} == {(STEPS + 1, "bf16", "euclidean")}
        assert len(got(restored)) == len(bf16["modes"]) and set(restored["modes"].values()) == {"euclidean"}


@pytest.mark.slow
def test_set_mode_carries_the_residual_between_coordinates(results):
    """GIFT → Euclidean maps a layer's whitened residual ``e`` to plain coordinates ``ε`` with
    ``ε T = e``, Euclidean → GIFT back. Tolerance: FP32 transforms (``T⁻¹`` here, ``T`` in the dense
    matrix) of inner length at most ``d + r + 2``, amplified at most by ``κ(T)``, from the FP64 factor.
    Bugs caught: the residual dropped, or kept in whitened coordinates, when a layer changes mode."""
    for res in results:
        conv = res["auto"]["conversion"]
        assert conv is not None, "no GIFT layer with a whitening at the end of the auto run"
        d = conv["t"].shape[0]
        before, plain, back = (r.reshape(-1, d) for r in conv["residuals"])
        tol = 2 * (d + conv["rank"] + 2) * EPS32 * conv["kappa"] * float(before.norm())
        assert before.norm() > 0 and float((plain @ conv["t"] - before).norm()) <= tol, conv["name"]
        assert float((back - before).norm()) <= 2 * tol and not torch.equal(plain, before)


@pytest.mark.slow
def test_profiles_measure_the_two_sided_map(results):
    """With ``--gift-side both`` a layer's profile measures the map its gradient is sent through: its GIFT
    RelL2 is the FP8 round trip of ``T_outᵀ G T_in`` (an FP64 reference of every rank's gradient). Bug
    caught: the profile (and the policy's choice from it) measuring ``G T_in`` alone. Tolerance: the
    runtime's FP32 maps move an element across an FP8 rounding boundary with probability ~2^-20, so the
    two agree to far below 1e-3; the input-side map's RelL2 differs by more (checked)."""
    run = results[0]["auto_both"]
    seen = 0
    for record, refs in zip((json.loads(r) for r in run["records"]), run["profiled"]):
        for name, (two_sided, input_side) in refs.items():
            got = record["layers"][name]["profile"]["gift_rel_l2"]
            assert math.isclose(got, two_sided, rel_tol=1e-3), (record["step"], name, got, two_sided, input_side)
            seen += not math.isclose(got, input_side, rel_tol=1e-3)
    assert seen > 0, "no layer's two-sided RelL2 differs from its input side's: the test cannot fail"
