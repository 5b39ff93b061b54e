"""Hand-made FP64 references for multi-rank reduction tests: each rank's local gradients, gathered.

The bounds the tests hold a reduction to (from these gradients and each layer's ``T``) are in
``tests/bounds.py``.
"""

import torch
import torch.distributed as dist


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
        grad = p_ref.grad.double().flatten() if p_ref.grad is not None else torch.zeros(p.numel(), dtype=torch.float64)
        out[p] = all_gather_rows(grad, group_of(p))
    return out


def shard_pieces(ddp, rank: int, world: int):
    """``(bucket, param, GiftParam, a, lo, hi)`` for every plugin parameter (``ddp.gift_params``) of
    the DDP's dense bucket groups that meets rank ``rank``'s equal ``1/world`` shard of its bucket:
    the parameter holds bucket elements ``[a, ...)``, the shard its elements ``[lo, hi)``."""
    for bg in ddp.bucket_groups:
        for bucket in bg.buckets:
            n = bucket.grad_data.numel()
            start, stop = rank * n // world, (rank + 1) * n // world
            for p, (a, b) in bucket.param_to_index.items():
                g = ddp.gift_params.get(p)
                if g is not None and max(a, start) < min(b, stop):
                    yield bucket, p, g, a, max(a, start), min(b, stop)


def all_gather_rows(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[ranks, *x.shape]``: ``x`` of every rank of ``group``, in group rank order."""
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, x.contiguous(), group=group)
    return torch.stack(gathered)


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
                gbuf, _, b = opt.model_param_gbuf_map[p]
                bucket = opt.buffers[gbuf].buckets[b]
                if bucket not in out:
                    group = opt.buffers[gbuf].data_parallel_group
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
