"""One reduction of a small MLP under ``GiftDistributedDataParallel`` for any layout a test draws:
layer widths, biases, bucket size, mode, collective, exchange and schedule (``Case``), checked
against a hand-made FP64 reduction of the ranks' local gradients (``tests/bounds.py``), each
parameter's bound for the mode it was sent in as the wire record saw it (``testing.wire``).

Tiny buckets and odd widths make every kind of emptiness Megatron's layouts can have: a shard of
padding only (the distributed optimizer pads buckets to a multiple of the group size), a rank
whose own message is empty while its peers' are not, a segment with no part in a shard, a bucket
of plain (``off``) segments only next to coded ones, more ranks than a bucket has scaling blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gift.testing.reference import gathered_local_gradients
from megatron_gift.testing.wire import WireRecord
from tests.bounds import ReductionPath, reduction_errors


@dataclass(frozen=True)
class Case:
    """``widths``: the MLP's layer widths (``Linear(widths[i], widths[i+1])``), ``biases`` per layer;
    ``bucket_size``: Megatron's (1: every parameter its own bucket); ``layers``: the pattern of the
    parameters sent in ``mode`` (the rest ``off``); ``ranks_per_node``: two-level where set."""

    widths: tuple[int, ...]
    biases: tuple[bool, ...]
    bucket_size: int
    mode: str
    distributed_optimizer: bool
    schedule: str = "lagged"
    ranks_per_node: int | None = None
    layers: str = ".*"
    gift_steps: int = 2  # GIFT: the first step builds T, the second reduces with it (cut rows included)
    intra: str = "bf16"  # the two-level exchange's intra-node dtype


def build_mlp(case: Case) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(torch.nn.Linear(a, b, bias=bias) for a, b, bias in zip(case.widths, case.widths[1:], case.biases))
    )


def reduce_case(case: Case, rank: int) -> dict:
    """This rank's reduction of ``case`` over the data-parallel group of ``parallel_state``:
    ``errors`` (``reduction_errors``: name, mode, error, bound of each parameter part it holds),
    ``grads`` (every parameter's reduced gradient, meaningful everywhere with the all-reduce)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_gift.config import Exchange, GiftConfig, Mode
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    model, ref = build_mlp(case), build_mlp(case)
    config = TransformerConfig(num_layers=1, hidden_size=case.widths[0], num_attention_heads=1)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=case.distributed_optimizer,
        overlap_grad_reduce=True,
        bucket_size=case.bucket_size,
        grad_reduce_in_fp32=True,
    )
    gift = GiftConfig.build(
        mode=Mode(case.mode),
        layers=(case.layers,),
        rank=4,
        sketch=0,
        damping=1.0,
        refresh_interval=1,
        schedule=case.schedule,
        ranks_per_node=case.ranks_per_node,
        intra_node=case.intra,
        exchange=Exchange.AUTO if case.ranks_per_node else Exchange.FLAT,
    )
    ddp = GiftDistributedDataParallel(config, ddp_config, model, gift_config=gift)
    dp = ps.get_data_parallel_group()
    x = torch.randn(6, case.widths[0], generator=torch.Generator().manual_seed(100 + dp.rank()))

    def loss(m):
        return m(x).square().sum()

    with WireRecord() as wire:
        for _ in range(case.gift_steps if case.mode == "gift" else 1):
            wire.clear()  # the last step's
            ddp.zero_grad_buffer()
            loss(ddp).backward()
            ddp.finish_grad_sync()
    names = [s.name for b in ddp.gift_buckets() for s in b.layout.segments]
    sent = {n: wire.mode(n) for n in names}
    local = gathered_local_gradients(ref, model, loss, lambda p: dp)

    def owned(bg, bucket):
        size = bucket.grad_data.numel() // bg.intra_distributed_optimizer_instance_size
        r = bg.intra_distributed_optimizer_instance_rank
        return slice(r * size, (r + 1) * size)

    path = ReductionPath(
        all_reduce=not case.distributed_optimizer, ranks_per_node=case.ranks_per_node, intra=case.intra
    )
    errors = reduction_errors(
        ddp, local, lambda p: 1.0 / dp.size(), path, owned=owned if case.distributed_optimizer else None, sent=sent
    )
    grads = torch.cat([p.main_grad.flatten() for p in model.parameters()])
    return dict(
        errors=errors,
        grads=grads,
        converted=sum(1 for _ in ddp.gift_buckets()),
        sent=sent,
        calls={n: wire.sent(n) for n in names},
        stages=wire.stages(),
        ledger=dict(ddp.ledger.bytes),
    )


def check_case(case: Case, results: list[dict]) -> None:
    """Every rank's every parameter part within its bound; with the all-reduce, bit-identical."""
    for rank, res in enumerate(results):
        over = [e for e in res["errors"] if not e[2] <= e[3]]
        assert not over, (case, rank, over)
    assert sum(len(res["errors"]) for res in results), case  # something was checked
    if not case.distributed_optimizer:
        for rank, res in enumerate(results):
            assert torch.equal(res["grads"], results[0]["grads"]), (case, rank)
