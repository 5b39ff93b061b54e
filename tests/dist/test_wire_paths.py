"""Each reduction path of ``GiftDistributedDataParallel``, read from what was sent (``testing.wire``),
not from the DDP's own state: 4 gloo ranks as 2 simulated nodes x 2, a small MLP
(``tests/layout_cases.py``) under GIFT, Euclidean and BF16, the flat and the two-level exchange,
reduce-scatter (distributed optimizer) and all-reduce, the intra-node stage in FP8, BF16 and FP32.

For every case and rank: each weight was sent in the mode the test asked for (GIFT: every sender
call of its values given ``T``; Euclidean: FP8 without ``T``; BF16: plain BF16 values), biases in
the bucket's FP32; the stages that ran are the path's (flat: one ``_send``; two-level: ``_intra``
then ``_node_sums``; all-reduce: a gather stage); the two-level intra-node stage carried the coded
values in the configured dtype (FP8 codes, or BF16 / FP32 casts of ``G T``) and the ledger counted its
bytes under that dtype; every reduced gradient is within ``tests/bounds.py``'s bound for the mode
it was sent in (as the record saw it) and the path taken."""

import pytest

from megatron_gift.testing import run_on_ranks
from tests.layout_cases import Case, check_case, reduce_case

pytestmark = pytest.mark.cpu_harness
WORLD, NODE = 4, 2


def _case(mode="gift", dist_opt=True, two_level=False, intra="bf16"):
    # rows of 40 and 24 columns, one bucket: shard boundaries cut GIFT rows
    return Case(
        widths=(24, 40, 20),
        biases=(True, False),
        bucket_size=10**6,
        mode=mode,
        distributed_optimizer=dist_opt,
        ranks_per_node=NODE if two_level else None,
        layers=r"weight$",
        intra=intra,
    )


CASES = {
    "flat-reduce-scatter": _case(),
    "flat-all-reduce": _case(dist_opt=False),
    "two-level-reduce-scatter-fp8": _case(two_level=True, intra="fp8"),
    "two-level-reduce-scatter-bf16": _case(two_level=True, intra="bf16"),
    "two-level-all-reduce-fp32": _case(dist_opt=False, two_level=True, intra="fp32"),
    "two-level-all-reduce-fp8": _case(dist_opt=False, two_level=True, intra="fp8"),
    "euclidean-two-level": _case(mode="euclidean", two_level=True, intra="bf16"),
    "bf16-flat": _case(mode="bf16", dist_opt=False),
}


def _worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    try:
        return {name: reduce_case(case, rank) for name, case in CASES.items()}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, WORLD, cpu_harness=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_path_asked_for_is_the_path_sent(results, name):
    """Bugs caught: GIFT weights sent without ``T`` on one path (the flat reduce-scatter or all-reduce,
    the two-level sender), ``--gift-intra-node`` ignored (BF16 sent where FP8 or FP32 was asked),
    the two-level exchange silently flat (or the reverse), Euclidean weights whitened, BF16 sent as
    FP8, a gradient outside the bound of what was actually sent."""
    case = CASES[name]
    check_case(case, [r[name] for r in results])
    two_level = case.ranks_per_node is not None
    coded = {"fp8": ("encode", "fp8"), "bf16": ("cast", "bf16"), "fp32": ("cast", "fp32")}
    for rank, res in enumerate(r[name] for r in results):
        weights = {n for n in res["sent"] if n.endswith("weight")}
        assert weights and all(res["sent"][n] == case.mode for n in weights), (name, rank, res["sent"])
        assert all(m == "off" for n, m in res["sent"].items() if n not in weights), (name, rank, res["sent"])
        stages = res["stages"]
        assert ({"_intra", "_node_sums"} <= stages) == two_level and ("_send" in stages) != two_level, (name, stages)
        if case.mode in (
            "gift",
            "euclidean",
        ):  # the gather stage re-encodes the coded sums (plain ones: no hooked call)
            gathered = bool(stages & {"_gather", "_gather_inter"})
            assert gathered == (not case.distributed_optimizer), (name, stages)
            first = ("_intra", *coded[case.intra]) if two_level else ("_send", "encode", "fp8")
            for n in weights:
                assert res["calls"][n] == {(*first, case.mode == "gift")}, (name, rank, n, res["calls"][n])
            if two_level:  # the ledger names the intra-node bytes by the dtype that was sent
                label = "fp8+scales" if case.intra == "fp8" else case.intra
                assert res["ledger"].get(("all_to_all", label), 0) > 0, (name, res["ledger"])
