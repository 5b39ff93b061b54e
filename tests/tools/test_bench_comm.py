"""``bench comm`` on 2 CPU ranks: schema, FP8 gradient bytes a quarter of FP32's plus the scales, ranks
bit-identical."""

import pytest

from megatron_gift_tools.bench import comm
from megatron_gift_tools.cli import build_parser


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_bench_comm_quick(tmp_path):
    doc = comm.run(quick=True, json_path=str(tmp_path / "comm.json"), ranks=(2,))
    rows = doc["results"]
    assert {(r["mode"], r["distributed_optimizer"]) for r in rows} == {
        (m, d) for m in comm.MODES for d in (True, False)
    }
    for r in rows:
        assert set(r) >= {
            "mode",
            "ranks",
            "distributed_optimizer",
            "bytes_per_step",
            "bytes_ratio_vs_fp32",
            "rel_l2_vs_fp32",
            "ranks_bitwise_identical",
        }
        assert r["ranks_bitwise_identical"], r
        fp32 = next(f for f in rows if f["mode"] == "fp32" and f["distributed_optimizer"] == r["distributed_optimizer"])
        if r["mode"] == "fp32":
            assert r["rel_l2_vs_fp32"] < 1e-6
        elif r["mode"] == "bf16":
            assert r["bytes_ratio_vs_fp32"] == pytest.approx(0.5, abs=0.01)
            # tests/bounds.py: RelL2 ∝ u for the same gradients and path, BF16's u 2^-8 against E4M3's
            # 2^-4: 1/16 of Euclidean's (1/8 allows the two formats' different mantissa spreads)
            euclid = next(
                e
                for e in rows
                if e["mode"].startswith("euclidean") and e["distributed_optimizer"] == r["distributed_optimizer"]
            )
            assert r["rel_l2_vs_fp32"] < euclid["rel_l2_vs_fp32"] / 8, (r, euclid)
        else:
            # gradient bytes: 1 B per element plus a 4 B scale per group, against FP32's 4 B; the
            # narrowest group of the quick model is 96 wide (fc2: 352 = 2 x 128 + 96), 1% for padding
            assert r["grad_bytes_per_step"] <= (0.25 + 4 / (4 * 96)) * 1.01 * fp32["bytes_per_step"], r
            assert (r["refresh_bytes"] > 0) == r["mode"].startswith("gift"), r  # GIFT's refreshes, amortized
            assert 0 < r["rel_l2_vs_fp32"], r  # quantized (the bounds themselves: test_megatron_ddp.py, per layer)
    # Cold start: of --quick's 2 steps the first has no factor yet (installed a step late) and the second
    # one that no held-out check has passed (docs/fidelity.md#cold-start): GIFT sends plain FP8 on both,
    # so every linear layer's RelL2 equals Euclidean's at both steps (same batches, same weights)
    cmp = doc["gift_vs_euclidean"]
    assert {c["distributed_optimizer"] for c in cmp} == {True, False}
    for c in cmp:
        assert len(c["records"]) == 2 * 8 and c["losses_beyond_noise"] == 0, c  # 2 steps x 2 layers x 4 types
        assert all(r["ratio"] == 1.0 and r["noise"] > 0 for r in c["records"]), c["records"]
    assert (tmp_path / "comm.json").exists()


def test_cli_parses_bench_comm():
    args = build_parser().parse_args(["bench", "comm", "--quick", "--ranks", "2", "4", "--json", "x.json"])
    assert args.quick and args.ranks == [2, 4] and args.json == "x.json" and args.func.__name__ == "_bench_comm"
