"""The refresh's record exchange with more ranks than layers (issue 35 item 3): equal slots of the
largest owner's share would make every rank receive ``p x max_record``; each rank must receive at most
twice the records' bytes, and install the same bits as the equal-slot all-gather."""

import torch

from megatron_gift.testing import run_on_ranks
from tests.refresh_setup import LAYERS, refresh_of  # 2 layers on 4 ranks


def _worker(rank, world, bound):
    import torch.distributed as dist

    import megatron_gift.refresh_sync as refresh_mod
    from megatron_gift.refresh_sync import record_layout

    refresh_mod.GATHER_BOUND = bound
    state, st, params, group = refresh_of()
    cfg = state.config
    received = []
    real_broadcast, real_gather = dist.broadcast, refresh_mod._all_gather

    def broadcast(t, src, *a, **k):
        received.append(0 if src == rank else t.numel() * t.element_size())
        return real_broadcast(t, src, *a, **k)

    def gather(out, inp, *a, **k):
        received.append((out.numel() - inp.numel()) * out.element_size())
        return real_gather(out, inp, *a, **k)

    dist.broadcast, refresh_mod._all_gather = broadcast, gather
    installed = []
    for step in range(2):
        state.open_step()
        grads = []
        for i, (gp, (d_out, d_in)) in enumerate(zip(params, LAYERS.values())):
            gen = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
            gp.input.stats.accumulate(torch.randn(64, d_in, generator=gen) * torch.logspace(0, -2, d_in))
            grads.append(torch.randn(d_out, d_in, generator=gen))
        st.at_sync([(gp, group, g) for gp, g in zip(params, grads)], lambda *a: None)
        st.after_reductions()
        st.close_step([])
        st.install(lambda *a: None)
        installed.append({gp.name: {k: v.clone() for k, v in gp.input.whitening.tensors().items()} for gp in params})
    dist.broadcast, refresh_mod._all_gather = real_broadcast, real_gather
    records = sum(record_layout(gp, cfg.whitening.rank).nbytes for gp in params)
    return dict(installed=installed, received=sum(received) / 2, records=records)  # per refresh (2 refreshes)


def _run(bound):
    return run_on_ranks(_worker, 4, bound, timeout=300)


def test_the_record_exchange_is_bounded_and_installs_the_same_bits():
    """Catches the equal-slot all-gather with more ranks than layers (each rank receives 4 slots of
    the largest record: over twice the records) and a bounded exchange that moves or drops a record's
    bytes (other factors than the all-gather's, or ranks that disagree)."""
    bounded, gathered = _run(2), _run(float("inf"))
    for b, g in zip(bounded, gathered):
        assert 0 < b["received"] <= 2 * b["records"], (b["received"], b["records"])
        assert g["received"] > 2 * g["records"]  # the equal slots exceed the bound: the case is the one at issue
        for step_b, step_g in zip(b["installed"], g["installed"]):
            for name in LAYERS:
                assert step_b[name].keys() == step_g[name].keys()
                assert all(torch.equal(step_b[name][k], step_g[name][k]) for k in step_b[name]), name
    for r in bounded[1:]:  # every rank holds the owners' bits
        for step_r, step_0 in zip(r["installed"], bounded[0]["installed"]):
            assert all(torch.equal(step_r[n][k], step_0[n][k]) for n in LAYERS for k in step_0[n])
