"""Property: every layout Megatron can build reduces, within its bound, on every rank.

Hypothesis draws MLPs (1 to 3 layers of 1 to 24 units, biases or not), bucket sizes, the mode and
which parameters it applies to (the rest ``off``), the collective, the schedule, the data-parallel
size (2 or 4 of 4 gloo ranks) and the exchange (two-level as 2 nodes of 2); each drawn layout is
reduced by ``tests/layout_cases.reduce_case`` and checked by ``check_case`` (FP64 reduction by
hand, bit-identical all-reduce). The bug caught: layouts with empty parts (a shard of padding, an
empty own message, a bucket of plain values only) raising on one rank mid-reduction and hanging
its peers. One spawn of ranks serves every example: the ranks wait for cases on their queues.
"""

import multiprocessing
import pickle
import queue
import threading
import traceback

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.limits import wall_limit
from tests.layout_cases import Case, check_case, reduce_case

pytestmark = pytest.mark.cpu_harness
WORLD = 4
CASE_LIMIT_S = 120.0  # one case on every rank; a rank that raised leaves its peers waiting this long


def _serve(rank, world, inboxes, outbox):
    """Reduce each case from this rank's inbox (None: stop) and report ``(rank, ok, payload)``."""
    from megatron.core import parallel_state as ps

    tp = None
    while (item := inboxes[rank].get()) is not None:
        case, dp = item
        try:
            if tp != world // dp:
                if tp is not None:
                    ps.destroy_model_parallel()
                tp = world // dp
                ps.initialize_model_parallel(tp, 1)
            outbox.put((rank, True, pickle.dumps(reduce_case(case, rank))))
        except Exception:  # noqa: BLE001 -- reported to the test, which fails on it
            outbox.put((rank, False, traceback.format_exc()))
    return "done"


class Pool:
    """``WORLD`` spawned ranks serving cases (``_serve``); ``reduce`` runs one on all of them."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.inboxes, self.outbox = [ctx.Queue() for _ in range(WORLD)], ctx.Queue()
        self.broken = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            run_on_ranks(_serve, WORLD, self.inboxes, self.outbox, cpu_harness=True, timeout=3600)
        except Exception as e:  # noqa: BLE001 -- surfaces in the next reduce
            self.broken = f"the ranks stopped: {e}"

    def reduce(self, case: Case, dp: int) -> list[dict]:
        if self.broken:
            pytest.fail(self.broken)
        for inbox in self.inboxes:
            inbox.put((case, dp))
        got = {}
        try:
            while len(got) < WORLD:
                rank, ok, payload = self.outbox.get(timeout=wall_limit(CASE_LIMIT_S))
                if not ok and not self.broken:
                    self.broken = f"rank {rank} raised on {case}:\n{payload}"
                got[rank] = payload
        except queue.Empty:  # after the first raise (kept first: it is the cause) or a hang
            hung = f"ranks {sorted(set(range(WORLD)) - set(got))} did not finish {case}"
            self.broken = f"{self.broken}\n{hung}" if self.broken else hung
        if self.broken:
            pytest.fail(self.broken)
        return [pickle.loads(got[r]) for r in range(WORLD)]

    def close(self):
        for inbox in self.inboxes:
            inbox.put(None)
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def pool():
    p = Pool()
    yield p
    p.close()


@st.composite
def layouts(draw):
    layers = draw(st.integers(1, 3))
    widths = tuple(draw(st.lists(st.integers(1, 24), min_size=layers + 1, max_size=layers + 1)))
    dp = draw(st.sampled_from([2, 4]))
    case = Case(
        widths=widths,
        biases=tuple(draw(st.lists(st.booleans(), min_size=layers, max_size=layers))),
        bucket_size=draw(st.sampled_from([1, 7, 40, 130, 600, 10**6])),
        mode=draw(st.sampled_from(["euclidean", "gift", "bf16"])),
        distributed_optimizer=draw(st.booleans()),
        schedule=draw(st.sampled_from(["eager", "lagged"])),
        ranks_per_node=2 if dp == 4 and draw(st.booleans()) else None,
        layers=draw(st.sampled_from([".*", "weight", "bias"])),
    )
    return case, dp


@pytest.mark.slow
@settings(
    max_examples=24,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(layouts())
def test_every_layout_reduces(pool, drawn):
    case, dp = drawn
    results = pool.reduce(case, dp)
    if not any(res["converted"] for res in results):  # every parameter off (or a group of one): Megatron's
        return
    check_case(case, results)
