"""``bench comm`` on 2 CPU ranks: schema, FP8 gradient bytes at most 0.26x FP32, ranks bit-identical."""

import pytest

from megatron_gift.bench import comm
from megatron_gift.cli import build_parser


@pytest.mark.slow
def test_bench_comm_quick(tmp_path):
    doc = comm.run(quick=True, json_path=str(tmp_path / "comm.json"), ranks=(2,))
    rows = doc["results"]
    assert {(r["mode"], r["distributed_optimizer"]) for r in rows} == {(m, d) for m in comm.MODES for d in (True, False)}
    for r in rows:
        assert set(r) >= {"mode", "ranks", "distributed_optimizer", "bytes_per_step", "bytes_ratio_vs_fp32",
                          "rel_l2_vs_fp32", "ranks_bitwise_identical"}
        assert r["ranks_bitwise_identical"], r
        if r["mode"] == "fp32":
            assert r["rel_l2_vs_fp32"] < 1e-6
        elif r["mode"] == "bf16":
            assert r["bytes_ratio_vs_fp32"] == pytest.approx(0.5, abs=0.01) and r["rel_l2_vs_fp32"] < 1e-2
        else:  # the FP8 gradient itself; GIFT adds its refreshes' statistics and factors, amortized
            fp32 = next(f["bytes_per_step"] for f in rows if f["mode"] == "fp32" and f["distributed_optimizer"] == r["distributed_optimizer"])
            assert r["grad_bytes_per_step"] <= 0.26 * fp32, r
            assert (r["refresh_bytes"] > 0) == r["mode"].startswith("gift"), r
            assert r["rel_l2_vs_fp32"] < 0.06, r
    assert (tmp_path / "comm.json").exists()


def test_cli_parses_bench_comm():
    args = build_parser().parse_args(["bench", "comm", "--quick", "--ranks", "2", "4", "--json", "x.json"])
    assert args.quick and args.ranks == [2, 4] and args.json == "x.json" and args.func.__name__ == "_bench_comm"
