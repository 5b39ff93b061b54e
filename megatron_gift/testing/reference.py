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
        g = p_ref.grad.double().flatten() if p_ref.grad is not None else torch.zeros(p.numel(), dtype=torch.float64)
        out[p] = all_gather_rows(g, group_of(p))
    return out


def all_gather_rows(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[ranks, *x.shape]``: ``x`` of every rank of ``group``, in group rank order."""
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, x.contiguous(), group=group)
    return torch.stack(gathered)
