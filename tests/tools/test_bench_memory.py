"""``megatron-gift bench memory``: the byte tracker counts what it should, and a --quick run (2 ranks)
writes its table with ``off`` costing nothing over stock Megatron."""

import contextlib
import gc
import json

import pytest
import torch

from megatron_gift_tools.bench import memory


def test_live_bytes_tracks_allocations_views_and_frees():
    tracker = memory.LiveBytes()
    with tracker:
        a = torch.ones(1000)  # 4000 B
        b = a * 2  # 4000 B
        view = b[:10]  # no new storage
        a.add_(1)  # in place: no new storage
        del a
        c = torch.zeros(500, dtype=torch.bfloat16)  # 1000 B
        del b  # the view keeps its storage alive
        assert (tracker.live, tracker.peak) == (5000, 8000)
        del view
        assert tracker.live == 1000
    assert c.numel() == 500


def test_live_bytes_never_counts_a_storage_made_out_of_its_sight():
    """Bug caught: a storage the tracker never saw made (before it started, or inside a collective) counted
    when an op first returned a view of it or wrote it in place, and freed whenever its owner dropped it;
    or, the other way, ``torch.tensor(data)`` (filled out of sight, then lifted) not counted."""
    out_of_sight = torch.ones(1000)
    tracker = memory.LiveBytes()
    with tracker:
        parts = out_of_sight.split(100)  # views of the unseen storage
        out_of_sight.add_(1)  # returns its input
        new = parts[0] * 2  # 400 B, made here
        data = torch.tensor([0.5] * 100)  # 400 B, made here
        assert (tracker.live, tracker.peak) == (800, 800)
        del new, data
    assert tracker.live == 0


def _interpreted_double():
    """A kernel run by Triton's interpreter whatever ``TRITON_INTERPRET`` says: ``y = 2 x``."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n) * 2, mask=o < n)

    return InterpretedFunction(triton.jit(double).fn)


@pytest.mark.parametrize("collected", [False, True])
def test_an_interpreted_launch_leaves_its_dropped_output_counted_unless_collected(collected):
    """Catches fused tables that count a kernel's output past its last use (the interpreter's
    reference cycle holds every launch argument's storage until a collection, a CUDA launch none):
    with ``collected_launches`` the output is gone when dropped; without, it is not (so the test
    sees the artifact it removes)."""
    kernel, x = _interpreted_double(), torch.arange(256.0)
    was = gc.isenabled()
    gc.disable()  # a collection between the launch and the check would hide the artifact
    try:
        with memory.collected_launches() if collected else contextlib.nullcontext():
            tracker = memory.LiveBytes()
            with tracker:
                y = torch.empty(256)
                kernel[(2,)](x, y, 256, BLOCK=128)
                assert torch.equal(y, 2 * x)
                del y
                live = tracker.live
        assert live == (0 if collected else 1024)
        gc.collect()
    finally:
        if was:
            gc.enable()


def _reduce_scatter_live(rank: int, world: int) -> int:
    x, out = torch.ones(1 << 16), torch.empty((1 << 16) // world)
    tracker = memory.LiveBytes(x, out)
    with tracker:
        torch.distributed.reduce_scatter_tensor(out, x, async_op=True).wait()
        return tracker.live


@pytest.mark.slow
def test_gloo_reduce_scatter_buffers_do_not_count():
    """Bug caught: gloo's reduce-scatter copies its input inside the collective and splits the copy in
    ``wait()``; the tracker counted the copy there and lost it whenever gloo's worker thread dropped it,
    sometimes inside the next step's window: stock Megatron's steady step read 4 B/param low on one rank
    and every configuration 4.00 over it (docs/memory.md). A collective's own buffers do not count."""
    from megatron_gift.testing import run_on_ranks

    assert run_on_ranks(_reduce_scatter_live, 2) == [0, 0]


def test_transient_is_each_ranks_own_peak_over_its_held():
    """Bug caught: the transient taken as the largest peak less the largest held, which come from different
    ranks where one holds more state (GIFT's statistics of the layers it owns) and another peaks higher: at
    8 ranks the table read "+ -0.52". Here, per parameter over stock's, rank 0 holds 6 B more and peaks 3
    higher, rank 1 holds 3 more and peaks 4 higher: not 4 - 6 = -2, but the larger of -3 and +1."""
    stock = dict(peak=100, held=50, params=10, arena=0)
    per_rank = [
        {"stock": stock, "x": dict(peak=130, held=110, params=10, arena=0)},
        {"stock": stock, "x": dict(peak=140, held=80, params=10, arena=0)},
    ]
    (_, row) = memory.summarize(per_rank, 2)
    assert (row["peak_extra_B_per_param"], row["held_extra_B_per_param"]) == (4.0, 6.0)
    assert row["transient_extra_B_per_param"] == 1.0


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_quick_run(tmp_path):
    path = tmp_path / "memory.json"
    doc = memory.run(quick=True, json_path=str(path))
    assert json.loads(path.read_text())["machine"]["cpu_count"] >= 1
    rows = {r["config"]: r for r in doc["results"]}
    assert set(rows) == set(memory.QUICK_CONFIGS) and all(r["ranks"] == 2 for r in rows.values())
    # off is Megatron's own reduction: nothing beyond a flag or two (bytes, not bytes per parameter)
    assert abs(rows["off"]["peak_extra_B_per_param"]) < 0.01 and abs(rows["off"]["held_extra_B_per_param"]) < 0.01
    # the reduction's buffers (send and receive of (p-1)/p each, the own message, chunk temporaries)
    # come to at most 2 bytes per parameter over stock Megatron's peak with the model's one bucket
    # (about 1.55 at 2 ranks: docs/memory.md); error feedback holds an FP32 residual per coded element
    assert rows["euclidean"]["peak_extra_B_per_param"] <= 2.0, rows["euclidean"]
    assert rows["gift+error-feedback"]["held_extra_B_per_param"] > rows["euclidean"]["held_extra_B_per_param"] + 1.0
    assert "| off |" in memory.format_table(doc["results"])


def test_at_scale_footprints_are_the_hand_count_of_the_messages():
    """Bug caught: a footprint that leaves out a buffer (the receive, the inter-node send) or counts
    one twice, so the arena's bound (and docs/memory.md's 8B / DP 512 figure) is wrong. By hand, per
    element of a BF16 bucket over p = 512 ranks in nodes of g = 8 (n = 64), FP8 codes with one FP32
    scale per 128 (1 + 4/128 bytes): flat, the send buffer holds every shard's message and the
    receive buffer p - 1 of the own one; two-level, BF16 intra-node send (2 B) and receive of the
    g - 1 peers' held shards, then the n held shards' FP8 messages out and n - 1 in. And a bucket over a
    stated bound in more sub-buckets than it needs, or in sub-buckets over half the bound."""
    doc = memory.at_scale()
    rows = {(r["reduction"], r["collective"]): r["footprint_B_per_element"] for r in doc["results"]}
    p, g = 512, 8
    n, fp8 = p // g, 1 + 4 / 128
    flat = fp8 + (p - 1) / p * fp8
    two_level = 2 + 2 * (g - 1) / g + fp8 / g + (n - 1) / p * fp8
    assert rows[("flat fp8", "reduce-scatter")] == pytest.approx(flat, abs=2e-3)
    assert rows[("two-level fp8 (bf16 intra-node)", "reduce-scatter")] == pytest.approx(two_level, abs=2e-3)
    # all-reduce adds the own message (1/p of the codes) and the gathered ones: p of them, twice on two levels
    assert rows[("flat fp8", "all-reduce")] == pytest.approx(flat + fp8 / p + fp8, abs=2e-3)
    assert rows[("two-level fp8 (bf16 intra-node)", "all-reduce")] == pytest.approx(
        two_level + fp8 / p + fp8 / g + fp8, abs=2e-3
    )
    assert all(r["arena_GiB"] == pytest.approx(2 * r["footprint_GiB"], rel=0.01) for r in doc["results"])
    # with --gift-inflight-mb 1024: a bucket over it in sub-buckets of at most half of it, as few as that allows
    # but a row's rounding (the shares are equal within a row: a handful of rounds at most); one under it whole
    half = doc["spec"]["stated_mib"] / 2 / 1024
    for r in doc["results"]:
        if r["footprint_GiB"] <= 2 * half:
            assert (r["sub_buckets"], r["sub_bucket_GiB"]) == (1, r["footprint_GiB"]), r
        else:
            assert r["sub_bucket_GiB"] <= half and -(-r["footprint_GiB"] // half) <= r["sub_buckets"], r
            assert r["sub_buckets"] <= -(-r["footprint_GiB"] // half) + 1, r
