"""``python -m megatron_gift_tools.bench.scales`` on a small matrix: JSON, bytes per element, and the
bias it exists to show (BF16 scales rounded up decode block maxima too large; FP32 ones do not)."""

import json

import pytest

from megatron_gift_tools.bench import scales


def test_bench_scales_small(tmp_path, capsys):
    path = tmp_path / "scales.json"
    assert scales.main(["--rows", "128", "--cols", "256", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["command"] == f"python -m megatron_gift_tools.bench.scales --rows 128 --cols 256 --json {path}"
    assert {"platform", "processor", "torch"} <= set(doc["machine"])
    rows = {(r["data"], r["variant"]): r for r in doc["results"]}
    assert len(rows) == 3 * 4
    bytes_per_element = {"bf16-up": 1 + 2 / 128, "bf16-rne": 1 + 2 / 128, "e8m0": 1 + 1 / 128, "fp32": 1 + 4 / 128}
    for (_data, variant), r in rows.items():
        assert r["bytes_per_element"] == bytes_per_element[variant]
        if variant == "fp32":  # two FP32 roundings
            assert r["max_largest_abs_rel_err"] <= (1 + 2.0**-24) ** 2 - 1, r
        if variant == "bf16-up":  # never too small, at most 2^-7 too large, about 2^-8 on average
            assert 2.0**-10 < r["max_mean_signed_rel_err"] < 2.0**-7, r
        assert 0 < r["rel_l2"] < 2.0**-4
    assert rows[("massive-activations", "fp32")]["rel_l2"] < rows[("massive-activations", "bf16-up")]["rel_l2"]
    assert "| massive-activations | fp32 |" in capsys.readouterr().out


def test_cols_must_be_whole_blocks():
    with pytest.raises(SystemExit):
        scales.main(["--cols", "200"])
