"""One rank's factor refresh over a few GIFT layers of exact statistics on the whole world, the setup
that the refresh's multi-rank tests share (``test_refresh_gather_bound``, ``test_refresh_memory``)."""

import torch

from megatron_gift.config import GiftConfig, Mode
from megatron_gift.numerics import KFACStatistics

LAYERS = {"big": (24, 48), "small": (16, 8)}  # name: (d_out, d_in)


def refresh_of(layers: dict = LAYERS):
    """``(state, RefreshSync, params, group)``: a GIFT layer per entry of ``layers`` (rank 4, no sketch, a
    refresh every step) whose statistics are summed over the world, owners assigned."""
    import torch.distributed as dist

    from megatron_gift.refresh_sync import RefreshSync
    from megatron_gift.state import GiftParam, GiftState

    group = dist.group.WORLD
    cfg = GiftConfig.build(mode=Mode.GIFT, rank=4, sketch=0, refresh_interval=1)
    state = GiftState(cfg, torch.device("cpu"))
    params = []
    for name, (_, d_in) in layers.items():
        gp = GiftParam(name, Mode.GIFT, candidate=True)
        gp.input.stats, gp.input.groups = KFACStatistics(d_in, ema=0.0), [group]
        params.append(gp)
        state.params[object()] = gp
    st = RefreshSync(state)
    st.assign_owners([(gp, group) for gp in params])
    return state, st, params, group
