"""The offline sm_90a and sm_100a compile reports (tools ``bench/compile.py``) over a subset of their cases."""

import pytest

from megatron_gift_tools.bench import compile as report

SUBSET = [c for c in report.CASES if c[0] in ("delta", "place", "fp4") or c[1] == "_project_kernel"] + [
    next(c for c in report.CASES if c[1] == "_decode_sum_kernel")
]
# the bucket sender's whitened encodes (groups given by lengths, the _ROW_GROUPS tiling): they spilled at 4 warps
GROUPED = [c for c in report.CASES if c[1] == "_encode_kernel" and c[0] == "fused" and c[2]["LAYOUT"] == 3]
assert GROUPED


def _id(case) -> str:
    module, name, constexprs, _ = case
    keys = ("PASS", "OUTPUT", "BM", "BR", "RB", "SRC", "ROW_INDEX")
    return ".".join([module, name, *(f"{k}={constexprs[k]}" for k in keys if k in constexprs)])


@pytest.mark.slow
@pytest.mark.parametrize("case", SUBSET + GROUPED, ids=_id)
def test_kernels_compile_for_sm90a_without_spills(case):
    """Catches a kernel that no longer compiles for sm_90a, one that spills registers to local
    memory (``ptxas -v``'s spill bytes, issue 35 item 8) with sizes typed i32 or i64, and, with i64
    (a shard above 2^31), a 32-bit multiply left in the PTX (an offset that would wrap)."""
    for ints in ("i32", "i64"):
        row = report.compile_case(*case, ints)
        assert row["compiled"], row.get("error")
        assert row["arch"] == "sm_90a"
        assert 0 < row["n_regs"] <= 255 and row["n_spills"] == 0 and row["spill_loads"] == 0, (ints, row)
    assert row["mul_lo_s32"] == 0 and row["mul_wide_s32"] == 0, row


# the two-sided projection sm_100a's ptxas spilled (4 B at i64 sizes) until its launcher capped its registers
BLACKWELL = [
    (
        "fused",
        "_project_kernel",
        dict(BK=16, BM=64, BO=16, BR=16, OUTPUT=True, PROJECT=True, ROW_INDEX=False, SCALE_D=True),
        True,
    )
]


@pytest.mark.slow
@pytest.mark.parametrize("case", BLACKWELL, ids=_id)
def test_kernels_compile_for_sm100a_without_spills(case):
    """Catches a kernel that no longer compiles for sm_100a (Blackwell) or spills there with sizes typed i32
    or i64 (``bench/compile.py --arch 100``); the whole recorded list is in ``compile-sm100-cpu.json``."""
    for ints in ("i32", "i64"):
        row = report.compile_case(*case, ints, capability=100)
        assert row["compiled"], row.get("error")
        assert row["arch"] == "sm_100a"
        assert 0 < row["n_regs"] <= 255 and row["n_spills"] == 0 and row["spill_loads"] == 0, (ints, row)
