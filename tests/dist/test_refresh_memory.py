"""What the factor refresh holds between its first device stage and its host cores, i.e. through the
step's reductions (the refresh step's peak, docs/memory.md), counted by hand per layer a rank builds."""

import torch

from megatron_gift.testing import run_on_ranks
from tests.refresh_setup import LAYERS, refresh_of  # exact statistics (no sketch)


def _worker(rank, world):
    from megatron_gift.testing.dispatch import LiveBytes

    state, st, params, group = refresh_of()
    state.open_step()
    grads = []
    for i, (gp, (d_out, d_in)) in enumerate(zip(params, LAYERS.values())):
        gen = torch.Generator().manual_seed(10 * i + rank)
        gp.input.stats.accumulate(torch.randn(64, d_in, generator=gen) * torch.logspace(0, -2, d_in))
        grads.append(torch.randn(d_out, d_in, generator=gen))
    with LiveBytes(grads) as p:
        st.at_sync([(gp, group, g) for gp, g in zip(params, grads)], lambda *a: None)
        held = p.live
    st.after_reductions()
    st.close_step([])
    st.install(lambda *a: None)
    return dict(held=held, owned=[name for gp, name in zip(params, LAYERS) if gp.owner == rank])


def test_the_refresh_holds_no_second_copy_of_its_grams_through_the_reductions():
    """On each rank: the slot its summed statistics arrive in (FP32, the largest owner's share: here one
    layer's ``A`` and token count, d² + 1 values), then per layer it builds (``d_in`` = d, exact statistics)
    the host copy of its Gram (FP64, d², on a GPU in pinned host memory), ``diag(A)`` (FP64, d) and its
    local gradient's copy (FP32, d_out x d), plus 1 KB for the flags and tokens. Bugs caught: the Grams
    kept beside their host copy until the next stage (8 d² more) and ``diag(A)`` a view that holds the
    FP64 ``A`` (8 d² more): on the rank building the 48-wide layer 33 KB become 70."""
    slot = 4 * max(d * d + 1 for _, d in LAYERS.values())
    for r in run_on_ranks(_worker, 2, timeout=300):
        built = [LAYERS[name] for name in r["owned"]]
        want = slot + sum(8 * d * d + 8 * d + 4 * d_out * d for d_out, d in built)
        assert r["owned"] and r["held"] <= want + 1024, (r["owned"], r["held"], want)
