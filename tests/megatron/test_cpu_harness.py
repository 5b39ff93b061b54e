"""The CPU harness runs real Megatron-Core GPTModel + DDP + optimizer training over gloo.

One 2-rank spawn covers all four DDP settings (distributed optimizer on/off x overlapped
grad reduce on/off) because process start-up costs far more than the tiny model.
"""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_gift.megatron import cpu_harness
from megatron_gift.testing import RankError, run_on_ranks
from megatron_gift.testing.gpt import build_tiny_gpt, hand_average, lm_loss, random_tokens

STEPS = 3
SETTINGS = [(dist_opt, overlap) for dist_opt in (True, False) for overlap in (True, False)]


def _check_reduced_grads(ddp_model, expected, rank, world_size, dist_opt):
    """Each bucket's reduced grads (the rank's shard with the distributed optimizer) match."""
    checked = 0
    for group in ddp_model.bucket_groups:
        for bucket in group.buckets:
            want = torch.zeros_like(bucket.grad_data, dtype=torch.float64)
            for param, (start, end) in bucket.param_to_index.items():
                want[start:end] = expected[param]
            size = bucket.grad_data.numel() // world_size
            region = slice(rank * size, (rank + 1) * size) if dist_opt else slice(None)
            torch.testing.assert_close(bucket.grad_data[region].double(), want[region], rtol=1e-6, atol=1e-8)
            checked += 1
    return checked


def _train_and_check(rank, world_size):
    """Rank body: 3 Adam steps per DDP setting, checking reduced grads against a hand average."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    parallel_state.initialize_model_parallel(1, 1)
    final_params = {}
    for dist_opt, overlap in SETTINGS:
        model = build_tiny_gpt()
        ref = build_tiny_gpt()  # copy.deepcopy(GPTModel) fails: it holds process groups
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            assert torch.equal(p_ref, p), "same seed must rebuild the same weights"
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt, overlap_grad_reduce=overlap, bucket_size=20000
        )
        ddp_model = DistributedDataParallel(model.config, ddp_config, model)
        num_buckets = sum(len(g.buckets) for g in ddp_model.bucket_groups)
        assert num_buckets >= 3 if overlap else num_buckets == 1  # no overlap: one bucket
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=dist_opt), [ddp_model]
        )
        start = [p.detach().clone() for p in model.parameters()]
        for step in range(STEPS):
            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            tokens = random_tokens(step, rank)
            lm_loss(ddp_model, tokens).backward()
            ddp_model.finish_grad_sync()
            expected = hand_average(ref, model, tokens)
            assert _check_reduced_grads(ddp_model, expected, rank, world_size, dist_opt) == num_buckets
            update_ok, grad_norm, _ = optimizer.step()
            assert update_ok and grad_norm > 0
        assert all(not torch.equal(a, p) for a, p in zip(start, model.parameters()))
        final_params[(dist_opt, overlap)] = torch.cat([p.detach().flatten() for p in model.parameters()])
    parallel_state.destroy_model_parallel()
    _check_uninstall_and_context_manager()
    return final_params


def _check_uninstall_and_context_manager():
    """uninstall() restores torch; ``with install():`` installs for the block only."""
    assert cpu_harness.installed()
    cpu_harness.uninstall()
    probe = torch.zeros(1)
    assert not cpu_harness.installed() and probe.type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.cuda.current_device()
    with cpu_harness.install():
        assert probe.type() == "torch.cuda.FloatTensor"
        assert torch.cuda.current_device() == torch.device("cpu")
    assert not cpu_harness.installed() and probe.type() == "torch.FloatTensor"


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_megatron_ddp_and_optimizer_train_on_cpu():
    per_rank = run_on_ranks(_train_and_check, 2, cpu_harness=True, timeout=240)
    assert set(per_rank[0]) == set(SETTINGS)
    for setting in SETTINGS:
        assert torch.equal(per_rank[0][setting], per_rank[1][setting]), setting


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # fails (or hangs) on rank 0 once rank 1 is gone; rank 1 must be blamed


def test_run_on_ranks_names_the_failing_rank():
    with pytest.raises(RankError, match=r"(?s)^rank 1 of 2 failed:.*ValueError: boom on purpose"):
        run_on_ranks(_fail_on_rank_one, 2, timeout=60)


def _waits_for_a_peer_that_never_comes(rank, world_size):
    if rank == 1:
        time.sleep(600)
    dist.barrier()


def test_a_hung_run_reports_where_each_rank_waits():
    """Catches a hang reported without the hung ranks' stacks (an intermittent CI hang is then
    undiagnosable): both ranks' frames, rank 1 asleep and rank 0 in its barrier, are in the error."""
    with pytest.raises(RankError, match=r"did not finish") as caught:
        run_on_ranks(_waits_for_a_peer_that_never_comes, 2, timeout=20)  # both ranks start and meet first
    text = str(caught.value)
    for rank in (0, 1):
        assert f"rank {rank}'s threads when it was stopped" in text
    rank0, rank1 = text.split("rank 1's threads")[0], text.split("rank 1's threads")[1]
    assert "barrier" in rank0 and "_waits_for_a_peer_that_never_comes" in rank0
    assert "_waits_for_a_peer_that_never_comes" in rank1


def _slow_to_start(seconds):
    """What unpickling a :class:`_SlowStart` runs in each rank, before it joins the group."""
    time.sleep(seconds)
    return _meets_once


def _meets_once(rank, world_size):
    dist.barrier()
    return rank


class _SlowStart:
    """A rank function whose ranks take ``seconds`` to start (the unpickling sleeps)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        return _slow_to_start, (self.seconds,)


def test_the_run_limit_counts_from_joining_the_group():
    """Catches the run's limit counting from the spawn, so ranks that start slowly (a fork server
    started afresh on a loaded machine) are reported hung before their function has run."""
    assert run_on_ranks(_SlowStart(4.0), 2, timeout=2) == [0, 1]


def _where(rank, world_size):
    import os

    return os.environ.get("GIFT_TEST_MARK"), os.environ["RANK"], os.getcwd(), torch.get_num_threads()


def test_ranks_start_from_the_callers_state_at_call_time(monkeypatch, tmp_path):
    """Catches ranks forked from the preloaded server with the environment or directory it started
    with (a test's monkeypatched variable or chdir lost) instead of the caller's at this call, more
    than one intra-op thread per rank, or a rank's variables left in the caller."""
    import os

    run_on_ranks(_where, 1)  # the server, if any, is running before the changes
    monkeypatch.setenv("GIFT_TEST_MARK", "seen")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    assert run_on_ranks(_where, 2) == [("seen", str(r), str(tmp_path), 1) for r in range(2)]
    assert "RANK" not in os.environ


@pytest.mark.cpu_harness
def test_install_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu_harness.install()
    assert not cpu_harness.installed()


def test_an_unmarked_test_cannot_start_the_harness():
    """tests/conftest.py: a test without the ``cpu_harness`` marker that starts ranks or the launcher
    through the harness fails at once (bug caught: a new test that would fail, not skip, on CUDA)."""
    from megatron_gift.megatron import cpu_harness
    from megatron_gift.testing import launch

    for start in (
        lambda: run_on_ranks(print, 1, cpu_harness=True),
        lambda: launch.run_launcher(2, "--help"),
        cpu_harness.check_host,
    ):
        with pytest.raises(pytest.fail.Exception, match="without @pytest.mark.cpu_harness"):
            start()


@pytest.mark.cpu_harness
def test_a_marked_test_can():
    from megatron_gift.megatron import cpu_harness

    cpu_harness.check_host()  # a CPU-only machine: no error


def _zero_grad_like_megatron(params):
    """As Megatron's ``_zero_grad_group_helper``: ``hasattr(param, "grad")`` on each (shard views included)."""
    return [hasattr(p, "grad") for p in params]


@pytest.mark.cpu_harness
def test_a_warning_inside_the_harness_names_its_caller():
    """Megatron's distributed optimizer reads ``.grad`` of non-leaf shard views (its own known warning):
    every CPU run printed it as coming from cpu_harness.py, as if the harness were at fault."""
    import warnings

    view = torch.nn.Parameter(torch.ones(4)).view(-1)[1:3]  # a non-leaf, as Megatron's fp32 shards
    with cpu_harness.install(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _zero_grad_like_megatron([view])
    where = [(w.filename, w.lineno) for w in caught if "not a leaf" in str(w.message)]
    line = _zero_grad_like_megatron.__code__.co_firstlineno + 2
    assert where == [(__file__, line)], where
