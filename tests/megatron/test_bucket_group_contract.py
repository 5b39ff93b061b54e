"""``GiftBucketGroup`` keeps Megatron's bucket-group contract in every state, on 4 gloo ranks (one
spawn), following the call pattern of Megatron-Core's own DDP tests: every gradient buffer filled
with ones, one ``register_grad_ready`` per parameter (the first batch seeds the counts, ``reset``
ends it), then one at a time with ``finish_grad_sync()`` after each, whether the group has started
(all its parameters ready), has not, or has already finished.

The bug caught: with several distributed-optimizer instances Megatron's ``finish_grad_sync`` of a
group not yet started returns (it only makes the current stream wait for its communication
stream); the plugin's raised an ``AttributeError`` on the missing handle, then left the group's
later reduction unwaited. Each step's outcome (the exception type raised, if any, and the whole
gradient buffer) is compared with stock Megatron's ``DistributedDataParallel`` under the same
calls: bitwise, since ones scaled by a power of two code exactly in FP8. Configurations: the
distributed optimizer or not, overlapped or not, averaging in the collective or not, 1 or 2
instances, dense and expert (``allreduce=False``) parameters with expert-parallel size 1 and 2,
Euclidean and GIFT (no statistics yet: ``T = I``); at parameter positions (the plugin leaves the
padding between parameters as it was). The forced all-reduce (``force_all_reduce``)
with two instances also matches Megatron's (its shard is all-reduced across the instances too).
"""

import itertools

import pytest
import torch

from megatron_gift.testing import run_on_ranks

pytestmark = pytest.mark.cpu_harness

FLAGS = [
    (dist_opt, overlap, average, instances)
    for dist_opt, overlap, average, instances in itertools.product((False, True), (False, True), (False, True), (1, 2))
    if dist_opt or instances == 1
]


class _Model(torch.nn.Module):
    """Three dense linears then two experts' (``allreduce=False``: Megatron's expert buffer), BF16."""

    def __init__(self):
        super().__init__()
        self.dense = torch.nn.ModuleList([torch.nn.Linear(48, 48) for _ in range(3)])
        self.experts = torch.nn.ModuleList([torch.nn.Linear(48, 48) for _ in range(2)])
        for p in self.experts.parameters():
            p.allreduce = False

    def forward(self, x):
        for layer in self.dense:
            x = layer(x)
        return sum(e(x) for e in self.experts)


def _model():
    torch.manual_seed(0)
    return _Model().bfloat16()


def _ddp(kind, dist_opt, overlap, average, instances):
    """Stock Megatron's DDP (``kind`` "stock") or the plugin's in mode ``kind``, of ``_model``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_gift.config import GiftConfig, Mode
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=dist_opt,
        overlap_grad_reduce=overlap,
        average_in_collective=average,
        num_distributed_optimizer_instances=instances,
    )
    config = TransformerConfig(num_attention_heads=1, num_layers=1)
    if kind == "stock":
        return DistributedDataParallel(config, cfg, _model())
    return GiftDistributedDataParallel(config, cfg, _model(), gift_config=GiftConfig(mode=Mode(kind), layers=(".*",)))


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the outcome itself is compared with Megatron's
        return type(e).__name__
    return "ok"


def _calls(ddp, force_all_reduce=False) -> list:
    """Megatron's call pattern; after each call, its outcome and every gradient buffer."""
    groups = {p: bg for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups for p in bg.params}
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    for b in buffers:
        b.grad_data.fill_(1.0)
    params = list(ddp.module.parameters())
    log = []

    # parameter positions only: the plugin neither sends nor writes the padding between parameters
    # (Megatron keeps it zero, nothing reads it), which this call pattern fills with ones too
    used = [torch.zeros(b.grad_data.numel(), dtype=torch.bool) for b in buffers]
    for b, mask in zip(buffers, used):
        for start, end, _ in b.param_index_map.values():
            mask[start:end] = True

    def snap(what, outcome):
        log.append((what, outcome, torch.cat([b.grad_data[mask] for b, mask in zip(buffers, used)])))

    overlap = ddp.ddp_config.overlap_grad_reduce
    for p in params:  # the first batch seeds the ready counts
        snap("seed", _outcome(lambda: groups[p].register_grad_ready(p)))
    for p in params:
        groups[p].reset()
    for p in params:
        snap("ready", _outcome(lambda: groups[p].register_grad_ready(p, force_all_reduce=force_all_reduce)))
        snap("finish", _outcome(lambda: groups[p].finish_grad_sync(force_all_reduce=force_all_reduce)))
        if not overlap:
            for b in buffers:
                b.grad_data.fill_(1.0)
    for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:  # finished: a second finish is a no-op
        snap("again", _outcome(lambda: bg.finish_grad_sync(force_all_reduce=force_all_reduce)))
    return log


def _worker(rank, world):
    from megatron.core import parallel_state as ps

    out = {}
    for ep, instances in itertools.product((1, 2), (1, 2)):
        ps.initialize_model_parallel(expert_model_parallel_size=ep, num_distributed_optimizer_instances=instances)
        for flags in (f for f in FLAGS if f[3] == instances):
            for kind in ("stock", "euclidean", "gift"):
                out[ep, flags, kind] = _calls(_ddp(kind, *flags))
        if instances == 2:  # the forced all-reduce, overlapped or not
            for overlap, kind in itertools.product((False, True), ("stock", "euclidean")):
                out[ep, "forced", overlap, kind] = _calls(_ddp(kind, True, overlap, False, 2), force_all_reduce=True)
            out[ep, "inter_calls"] = _inter_calls()
        ps.destroy_model_parallel()
    return out


def _inter_calls() -> list:
    """Each all-reduce across the instances during an overlapped step: ``(inside a stage of the
    plugin's queue, asynchronous)``. The bug caught: it ran synchronously, bucket by bucket, on the
    compute stream inside ``finish_grad_sync`` (Megatron overlaps it on its communication stream)."""
    import contextlib

    import torch.distributed as dist

    ddp = _ddp("euclidean", True, True, False, 2)
    inter = ddp.bucket_groups[0].inter_distributed_optimizer_instance_group
    calls, in_stage = [], []

    @contextlib.contextmanager
    def stage():
        in_stage.append(True)
        yield
        in_stage.pop()

    ddp.queue.probe = stage
    real = dist.all_reduce

    ours = [(b.grad.data_ptr(), b.grad.data_ptr() + b.grad.nbytes) for b in ddp.gift_buckets()]

    def record(tensor, *args, group=None, async_op=False, **kwargs):
        if group is inter and any(lo <= tensor.data_ptr() < hi for lo, hi in ours):  # not Megatron's own groups'
            calls.append((bool(in_stage), async_op))
        return real(tensor, *args, group=group, async_op=async_op, **kwargs)

    dist.all_reduce = record
    try:
        ddp.zero_grad_buffer()
        ddp(torch.ones(2, 48, dtype=torch.bfloat16)).float().sum().backward()
        ddp.finish_grad_sync()
    finally:
        dist.all_reduce = real
    return calls


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 4, cpu_harness=True, timeout=900)


def _same(stock, gift, key):
    """The same outcomes everywhere, the same buffers after each finish (after a ``ready`` that
    started the group, Megatron's collective may still be writing: not compared)."""
    assert [s[:2] for s in gift] == [s[:2] for s in stock], key
    for (what, _, want), (_, _, got) in zip(stock, gift):
        assert what == "ready" or torch.equal(got, want), (key, what)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "dist_opt{}-overlap{}-avg{}-inst{}".format(*map(int, f)))
@pytest.mark.parametrize("mode", ["euclidean", "gift"])
def test_register_and_finish_like_megatron(results, ep, flags, mode):
    for res in results:
        _same(res[ep, flags, "stock"], res[ep, flags, mode], (ep, flags, mode))


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
def test_forced_all_reduce_with_instances_like_megatron(results, ep, overlap):
    for res in results:
        _same(res[ep, "forced", overlap, "stock"], res[ep, "forced", overlap, "euclidean"], (ep, overlap))


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_instances_all_reduce_is_a_queued_async_stage(results, ep):
    for res in results:
        calls = res[ep, "inter_calls"]
        assert calls and all(c == (True, True) for c in calls), calls
