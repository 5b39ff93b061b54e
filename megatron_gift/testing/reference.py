"""Hand-made FP64 references for multi-rank reduction tests, and the Euclidean FP8 error bound.

The bound follows from the codec: block-scaled E4M3 rounds each element of each rank's
(pre-scaled) contribution ``g_r`` with relative error at most ``2**-4`` (3 mantissa bits) in the
normal range and absolute error at most ``2**-10 * amax / 448`` below it (``amax``: the block
maximum, at most ``max|g_r|``). The FP32 sum and the buffer's own rounding add ``u_buf``
relative (``2**-22`` for FP32, ``2**-8`` for BF16 buffers: local accumulation plus the final
rounding). For any slice of ``k`` elements, by the triangle inequality over ranks:
``‖got - c Σ_r g_r‖ <= c (Σ_r (2**-4 + u_buf) ‖g_r‖ + sqrt(k) 2**-10 / 448 max|g_r|)``
with ``c`` the scaling (``1/dp`` for an average, 1 for a sum).
"""

import torch
import torch.distributed as dist

U8 = 2.0**-4
SUBNORMAL = 2.0**-10 / 448
U_FP32, U_BF16 = 2.0**-22, 2.0**-8


def gathered_local_gradients(ref, model, loss_fn, group_of) -> dict:
    """Copy ``model``'s weights into ``ref`` (same architecture and layout), backprop
    ``loss_fn(ref)`` locally and all-gather each gradient over ``group_of(param of model)``.
    Returns ``{param of model: [ranks, numel] float64}``."""
    with torch.no_grad():
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            p_ref.copy_(p)
    ref.zero_grad()
    loss_fn(ref).backward()
    out = {}
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        g = p_ref.grad.double().flatten() if p_ref.grad is not None else torch.zeros(p.numel(), dtype=torch.float64)
        group = group_of(p)
        gathered = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, g, group=group)
        out[p] = torch.stack(gathered)
    return out


def fp8_error_bound(local: torch.Tensor, scale: float, u_buf: float = U_FP32) -> float:
    """The module doc's bound for ``local [ranks, k]`` (the ranks' unscaled gradients of one slice)."""
    k = local.shape[1]
    return scale * float((U8 + u_buf) * local.norm(dim=1).sum() + k**0.5 * SUBNORMAL * local.abs().amax(dim=1).sum())


def reduction_errors(ddp, local: dict, scale_of, u_buf: float = U_FP32, owned=None) -> list[tuple[str, float, float]]:
    """``(parameter name, ‖got - scale Σ_r g_r‖, bound)`` over each parameter's part of its bucket
    that this rank holds after the reduction: ``owned(bucket group, bucket) -> slice`` of
    ``grad_data`` (default: all of it), ``scale_of(param)`` its scaling, ``local`` from
    :func:`gathered_local_gradients`."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    out = []
    for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for bucket in bg.buckets:
            region = owned(bg, bucket) if owned is not None else slice(0, bucket.grad_data.numel())
            for p, (a, b) in bucket.param_to_index.items():
                lo, hi = max(a, region.start), min(b, region.stop)
                if lo >= hi:
                    continue
                g = local[p][:, lo - a : hi - a]
                got = bucket.grad_data[lo:hi].double()
                err = float((got - scale_of(p) * g.sum(0)).norm())
                out.append((names[p], err, fp8_error_bound(g, scale_of(p), u_buf)))
    return out


def stock_param_shards(optimizer) -> dict:
    """What stock Megatron's parameter all-gather would send from this rank after the last step of
    ``optimizer`` (a Megatron distributed optimizer, or a chain of them): ``{bucket: this rank's
    shard of bucket.param_data}`` with ``dtype(main)`` of the FP32 main parameters at every
    parameter position, the rest (padding) as in the buffer."""
    out = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for mains, params in zip(opt.shard_fp32_from_float16_groups, opt.model_float16_groups):
            for main, p in zip(mains, params):
                where = opt._get_model_param_range_map(p)["gbuf_world_in_bucket"]
                g, _, b = opt.model_param_gbuf_map[p]
                bucket = opt.buffers[g].buckets[b]
                if bucket not in out:
                    group = opt.buffers[g].data_parallel_group
                    s = bucket.param_data.numel() // group.size()
                    out[bucket] = (bucket.param_data.clone(), slice(group.rank() * s, (group.rank() + 1) * s))
                out[bucket][0][where.start : where.end] = main.detach().to(bucket.param_data.dtype)
    return {bucket: data[own] for bucket, (data, own) in out.items()}


def replicas_identical(buckets) -> bool:
    """Whether every rank of the default group holds the same bits in each bucket's ``param_data`` (collective)."""
    mine = torch.cat([b.param_data.view(torch.uint8) for b in buckets])  # bytes: gloo gathers no 16-bit ints
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(t, mine) for t in every)
