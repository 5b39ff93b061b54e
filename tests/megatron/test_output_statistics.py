"""``--gift-side both``: the statistics ``B = E[g gᵀ]`` of each GIFT layer's output gradients, as the
adapter collects them in Megatron-Core training on gloo ranks (one spawn per world size).

* 2 ranks, the tiny GPTModel, distributed optimizer with overlap, 2 micro-batches a step, the first
  layer recomputed in the backward: after each step the plugin's ``B`` (its accumulators and local
  EMA) equals the output gradients of the same model captured with ``torch.autograd.grad`` on a
  reference copy without recomputation, summed and folded by hand; ranks keep their own ``B``
  with the same sketch, a sketch that differs from the input side's; the reduced gradients of
  the first step are bitwise those of ``--gift-side input`` (the hooks change no gradient).
* 4 ranks, TP 2 x DP 2, with and without sequence parallelism: a column-parallel layer's ``B``
  is that of its own output columns (no TP sum), a row-parallel layer's is summed over TP under
  sequence parallelism (its output holds ``s/tp`` tokens) and not without, a column-parallel
  layer with ``gather_output`` keeps its own columns of the gathered output. Integer-valued data
  make every FP32 operation exact, so the check is equality with an FP64 reference of the whole
  (unsharded) layers.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_gift.config import GiftConfig, Mode, Side
from megatron_gift.numerics import CodecConfig
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

pytestmark = pytest.mark.cpu_harness
U = 2.0**-24  # FP32 unit roundoff
STEPS, MICRO, BATCH, SEQ = 3, 2, 2, 32
EMA, SKETCH = 0.9, 16


def _gift(side, **kw):
    return GiftConfig.build(
        mode=Mode.GIFT,
        codec=CodecConfig("e4m3", "block"),
        rank=8,
        sketch=SKETCH,
        ema=EMA,
        refresh_interval=1,
        side=side,
        **kw,
    )


def _outputs_of(model, names):
    """Forward hooks on ``model``'s modules ``names`` keeping each call's output (``(output, bias)``: the output)."""
    seen = []
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, out, n=n: seen.append((n, out[0] if isinstance(out, tuple) else out))
        )
        for n in names
    ]
    return seen, hooks


def _train(side, recompute=True):
    """STEPS steps of MICRO micro-batches; per step the plugin's B (after finish_grad_sync and after the
    close of the step) and the reference's output gradients of every GIFT layer, per micro-batch."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    rc = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1) if recompute else {}
    model, ref = build_tiny_gpt(**rc), build_tiny_gpt()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=6000
    )
    ddp = GiftDistributedDataParallel(model.config, ddp_config, model, gift_config=_gift(side))
    dp_rank = parallel_state.get_data_parallel_rank()
    layers = {gp.name[: -len(".weight")]: gp for gp in ddp.gift_params.values() if gp.candidate}
    steps, grads = [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        with torch.no_grad():  # the reference holds the weights of this step
            for p_ref, p in zip(ref.parameters(), model.parameters()):
                p_ref.copy_(p)
        outputs = {}
        for micro in range(MICRO):
            tokens = random_tokens(10 * step + micro, dp_rank, batch=BATCH)
            if micro < MICRO - 1:
                with ddp.no_sync():
                    (lm_loss(ddp, tokens) / MICRO).backward()
            else:
                (lm_loss(ddp, tokens) / MICRO).backward()
            seen, hooks = _outputs_of(ref, list(layers))
            loss = lm_loss(ref, tokens) / MICRO
            for h in hooks:
                h.remove()
            for (name, _), g in zip(seen, torch.autograd.grad(loss, [y for _, y in seen])):
                outputs.setdefault(name, []).append(g.detach().reshape(-1, g.shape[-1]).double())
        ddp.finish_grad_sync()
        if step == 0:
            grads = [b.grad.clone() for b in ddp.gift_buckets()]
        open_ = (
            {n: (float(gp.output.stats.tokens), float(gp.output.stats.ema_tokens)) for n, gp in layers.items()}
            if side is Side.BOTH
            else {}
        )
        ddp.gift_state_dict()  # closes the step (as the next zero_grad_buffer would)
        closed = (
            {
                n: {
                    k: t.double().clone()
                    for k, t in (
                        *gp.output.stats.ema_sums.items(),
                        ("tokens", gp.output.stats.ema_tokens),
                        ("step_tokens", gp.output.stats.tokens),
                    )
                }
                for n, gp in layers.items()
            }
            if side is Side.BOTH
            else {}
        )
        steps.append(dict(outputs={n: torch.cat(v) for n, v in outputs.items()}, open=open_, closed=closed))
    info = {}
    if side is Side.BOTH:
        info = {
            n: dict(
                omega=gp.output.stats.omega,
                in_omega=gp.input.stats.omega,
                groups=[dist.get_process_group_ranks(g) for g in gp.output.groups],
            )
            for n, gp in layers.items()
        }
    else:
        info = {n: gp.output for n, gp in layers.items()}
    return dict(steps=steps, grads=grads, info=info)


def _dp_worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    both, plain = _train(Side.BOTH), _train(Side.INPUT)
    parallel_state.destroy_model_parallel()
    return dict(both=both, input=plain)


@pytest.fixture(scope="module")
def dp_results():
    return run_on_ranks(_dp_worker, 2, cpu_harness=True, timeout=900)


@pytest.mark.slow
def test_output_statistics_equal_folded_output_gradients(dp_results):
    """``B``'s accumulators and local EMA equal the reference's output gradients, summed over the
    step's micro-batches and folded once per step at its close. Bugs caught: a micro-batch lost
    (only the last one's backward syncs) or counted twice (the recomputed forward of layer 0
    registering a second hook, or the no-grad first forward registering one), output statistics
    folded at the step's first sync (the layers whose gradients come later would be folded a step
    late, some layers not at all in that step), a tuple output hooked on its bias, a fold lost
    at the first step or repeated at ``zero_grad_buffer`` after a checkpoint closed the step.

    Bound, per entry of ``Y = Σ_t g_tᵀ (g_t Ω)`` and ``diag``: the FP32 products ``g Ω`` (``d_out``
    terms) and the sum over the step's ``T = MICRO·BATCH·SEQ`` tokens (one accumulator for all
    micro-batches) err by at most ``(d_out + T)·u`` times the same sums of absolute values
    (``|g|ᵀ(|g||Ω|)``), each fold at most ``2u`` of the absolute EMA (a scale and a scaled add),
    plus ``2u`` for the products and second-order terms; the output gradients are the reference's
    bit for bit (the same operations on the same values; checked here as ``diag`` would show any
    difference above that bound)."""
    for res in dp_results:
        r = res["both"]
        for name, info in r["info"].items():
            d = info["omega"].shape[0] if info["omega"] is not None else None
            ema_abs, ema_ref, ema_diag, ema_tokens = 0.0, 0.0, 0.0, 0.0
            for step, s in enumerate(r["steps"]):
                g = s["outputs"][name]
                assert g.shape[0] == MICRO * BATCH * SEQ, (name, g.shape)
                # while the step is open its gradients are in the accumulators, the EMA holds the steps before
                tokens, held = s["open"][name]
                assert tokens == g.shape[0] and abs(held - ema_tokens) <= 4 * step * 2.0**-53 * ema_tokens, (
                    name,
                    step,
                    tokens,
                    held,
                )
                omega = info["omega"].double()
                y, y_abs = g.T @ (g @ omega), g.abs().T @ (g.abs() @ omega.abs())
                ema_ref = EMA * ema_ref + (1 - EMA) * y
                ema_abs = EMA * ema_abs + (1 - EMA) * y_abs
                ema_diag = EMA * ema_diag + (1 - EMA) * (g * g).sum(0)
                ema_tokens = EMA * ema_tokens + (1 - EMA) * g.shape[0]
                got = s["closed"][name]
                bound = (d + g.shape[0] + 2 * (step + 1) + 2) * U * ema_abs
                assert ((got["y"] - ema_ref).abs() <= bound).all(), (
                    name,
                    step,
                    ((got["y"] - ema_ref).abs() / bound).max(),
                )
                assert ((got["diag"] - ema_diag).abs() <= (g.shape[0] + 2 * (step + 1) + 2) * U * ema_diag).all(), (
                    name,
                    step,
                )
                assert abs(float(got["tokens"]) - ema_tokens) <= 4 * (step + 1) * 2.0**-53 * ema_tokens, (name, step)
                assert float(got["step_tokens"]) == 0.0  # folded and cleared at the close
        # the hooks change no gradient: step 0 (no T yet) is bitwise the input-side run's
        assert all(torch.equal(a, b) for a, b in zip(r["grads"], res["input"]["grads"]))
        assert all(v is None for v in res["input"]["info"].values())  # --gift-side input: no output statistics


@pytest.mark.slow
def test_output_sketch_is_shared_by_ranks_and_not_the_input_sides(dp_results):
    """Each rank sums its own ``B``'s sketch ``Y = B Ω`` with the others' at a refresh: ``Ω`` must be the
    same on every rank; the output side's ``Ω`` (a different seed) must not repeat the input side's
    where the shapes agree (``linear_proj``: 64 x 64), and ``B`` is summed over the data-parallel
    group alone (TP 1)."""
    a, b = (res["both"]["info"] for res in dp_results)
    for name in a:
        assert torch.equal(a[name]["omega"], b[name]["omega"]), name
        assert a[name]["groups"] == [[0, 1]], a[name]["groups"]
    proj = [n for n in a if n.endswith("linear_proj")]
    assert proj and all(not torch.equal(a[n]["omega"], a[n]["in_omega"]) for n in proj)


# --------------------------------------------------------------------------- tensor parallelism
HIDDEN, MID, HEAD, S, B = 16, 24, 8, 8, 2


def _int_tensor(shape, seed, nonzero=0.35):
    """Entries in {-1, 0, 1} (mostly 0): every product and sum below stays an integer far below 2^24."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return (sign * (torch.rand(shape, generator=gen) < nonzero)).float()


def _tp_case(sequence_parallel: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    tp, tp_rank, dp_rank = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    full = dict(
        col=_int_tensor((MID, HIDDEN), 1), row=_int_tensor((HIDDEN, MID), 2), head=_int_tensor((HEAD, HIDDEN), 3)
    )

    class Net(MegatronModule):
        def __init__(self):
            super().__init__(config)
            init = torch.nn.init.zeros_
            self.col = ColumnParallelLinear(HIDDEN, MID, config=config, init_method=init, bias=False)
            self.row = RowParallelLinear(
                MID, HIDDEN, config=config, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=True
            )
            self.head = ColumnParallelLinear(
                HIDDEN, HEAD, config=config, init_method=init, bias=False, gather_output=True
            )
            with torch.no_grad():
                self.col.weight.copy_(full["col"].chunk(tp, 0)[tp_rank])
                self.row.weight.copy_(full["row"].chunk(tp, 1)[tp_rank])
                self.head.weight.copy_(full["head"].chunk(tp, 0)[tp_rank])

        def forward(self, x, r_row, r_head):
            y = self.row(self.col(x)[0])[0]
            return (y * r_row).sum() + (self.head(y)[0] * r_head).sum()  # linear: integer output gradients

    net = Net()
    gift = GiftConfig.build(
        mode=Mode.GIFT,
        layers=(r"(col|row|head)\.weight$",),
        rank=4,
        sketch=0,
        ema=0.0,
        refresh_interval=1,
        side=Side.BOTH,
    )
    ddp = GiftDistributedDataParallel(config, DistributedDataParallelConfig(), net, gift_config=gift)
    xs = [_int_tensor((S, B, HIDDEN), 10 + r, nonzero=0.5) for r in range(ps.get_data_parallel_world_size())]
    r_row, r_head = _int_tensor((S, B, HIDDEN), 20 + dp_rank, 0.5), _int_tensor((S, B, HEAD), 30 + dp_rank, 0.5)
    x = xs[dp_rank]
    if sequence_parallel:  # this TP rank's tokens of the sequence; the row-parallel output holds the same ones
        x, r_row = x.chunk(tp, 0)[tp_rank], r_row.chunk(tp, 0)[tp_rank]
    ddp.zero_grad_buffer()
    ddp(x, r_row, r_head).backward()
    ddp.finish_grad_sync()
    ddp.gift_state_dict()  # closes the step: B folded (ema 0: the step's own sums)

    # reference: the whole layers in FP64 on every data-parallel rank's tokens; the loss every TP rank's
    # autograd runs amounts to Σ y·r_row + Σ head(y)·r_head over the tokens (each weight block's own rank)
    want, bound = {"col": 0.0, "row": 0.0, "head": 0.0}, {"col": 0.0, "row": 0.0, "head": 0.0}
    for r, xr in enumerate(xs):
        rr, rh = _int_tensor((S, B, HIDDEN), 20 + r, 0.5).double(), _int_tensor((S, B, HEAD), 30 + r, 0.5).double()
        h = xr.double() @ full["col"].double().T
        h.requires_grad_(True)
        y = h @ full["row"].double().T
        y.retain_grad()
        ((y * rr).sum() + ((y @ full["head"].double().T) * rh).sum()).backward()
        cols = MID // tp
        g = dict(
            col=h.grad[..., tp_rank * cols : (tp_rank + 1) * cols],
            row=y.grad,
            head=rh[..., tp_rank * HEAD // tp : (tp_rank + 1) * HEAD // tp],
        )
        for k, v in g.items():
            v = v.reshape(-1, v.shape[-1])
            want[k], bound[k] = want[k] + v.T @ v, bound[k] + v.abs().T @ v.abs()
    out = {}
    for k, mod in (("col", net.col), ("row", net.row), ("head", net.head)):
        gp = ddp.gift_params[mod.weight]
        sums, tokens = (
            gp.output.stats.ema_sums["xtx"].double().clone(),
            gp.output.stats.ema_tokens.double().reshape(1).clone(),
        )
        for group in gp.output.groups:  # as the refresh sums them (RefreshSync.sum_statistics)
            dist.all_reduce(sums, group=group)
            dist.all_reduce(tokens, group=group)
        # exact in FP32 whatever the order of the sums: the output gradients are integers (a linear loss of
        # integer weights), and every partial sum of B is an integer at most Σ|g_i||g_j| < 2^24
        assert bound[k].max() < 2**24, bound[k].max()
        out[k] = dict(got=sums, want=want[k], tokens=float(tokens), groups=len(gp.output.groups))
    return out


def _tp_worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(2, 1)
    out = {sp: _tp_case(sp) for sp in (False, True)}
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def tp_results():
    return run_on_ranks(_tp_worker, 4, cpu_harness=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_output_statistics(tp_results, sequence_parallel):
    """Summed over each layer's output side's ``groups``, ``B`` equals the reference's exactly (integer data):
    the column-parallel layers' own diagonal block (also of an output gathered over TP), the
    row-parallel layer's over all tokens. Bugs caught: the TP group missing for the row-parallel
    layer under sequence parallelism (half the tokens), added for it without (counted twice) or
    for a column-parallel layer (two different blocks summed), a gathered output's other columns."""
    for res in (r[sequence_parallel] for r in tp_results):
        for k, v in res.items():
            assert torch.equal(v["got"], v["want"]), (k, (v["got"] - v["want"]).abs().max())
            assert v["tokens"] == 2 * S * B, (k, v["tokens"])  # every token of both data-parallel ranks once
            assert v["groups"] == (2 if k == "row" and sequence_parallel else 1), (k, v["groups"])
