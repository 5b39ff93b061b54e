"""The kernel specialisations the interpreter runs launch, against the list the offline sm_90a and sm_100a compile
reports compile (``testing.kernel_log``, tests/conftest.py, tools ``bench/compile.py``; issue 35 item 8)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_gift.testing import kernel_log
from megatron_gift.testing.limits import wall_limit

ROOT = Path(__file__).resolve().parents[2]

# A placed cast from BF16 to FP32 without whitening: a variant no launcher of the plugin makes (the wires are
# the bucket's dtype or BF16), so it is not in the committed list.
VARIANT = """
import torch
from megatron_gift import kernels
from megatron_gift.kernels.placement import Placement


def test_cast():
    out = torch.zeros(32)
    kernels.whiten_place(torch.ones(4, 8, dtype=torch.bfloat16), None, Placement([32], [0], "cpu").at(out, 0))
    assert (out == 1).all()
"""

# The same variant launched by two gloo ranks that a test of an ordinary session spawns under the interpreter
# (as tests/dist's kernel cases do).
SPAWNED = """
import torch
from megatron_gift.testing import run_on_ranks


def _rank(rank, world):
    from megatron_gift import kernels
    from megatron_gift.kernels.placement import Placement

    out = torch.zeros(32)
    kernels.whiten_place(torch.ones(4, 8, dtype=torch.bfloat16), None, Placement([32], [0], "cpu").at(out, 0))
    return bool((out == 1).all())


def test_ranks(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks' processes inherit it
    assert run_on_ranks(_rank, 2) == [True, True]
"""


def _run(test: Path, specs: str | None, interpret: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (kernel_log.SPECS_ENV, "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(test.parent), env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if specs is not None:
        env[kernel_log.SPECS_ENV] = specs
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(test)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=wall_limit(300))


def test_a_variant_missing_from_the_compile_list_fails_the_interpreter_run(tmp_path):
    """An interpreter run that launches a specialisation missing from ``bench/results/kernel-specs.json``
    fails, naming it, although its tests pass; recording (``GIFT_KERNEL_SPECS``) adds it instead. Bugs
    caught: a new kernel variant (a constexpr a launcher adds) that the compile report never compiles, so
    nobody learns whether it compiles for sm_90a or spills; a recorder that misses the constexprs."""
    test = tmp_path / "test_variant.py"
    test.write_text(textwrap.dedent(VARIANT))
    proc = _run(test, None)
    assert proc.returncode != 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "place._place_kernel" in proc.stdout and '"CAST": 1' in proc.stdout, proc.stdout[-3000:]
    specs = tmp_path / "specs.json"
    proc = _run(test, str(specs))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recorded = kernel_log.load_specs(str(specs))
    assert [(m, k, f) for m, k, _, f in recorded] == [("place", "_place_kernel", True)]
    assert '"CAST": 1' in next(iter(recorded))[2] and '"WHITEN": false' in next(iter(recorded))[2]


def test_a_variant_only_spawned_ranks_launch_is_checked_too(tmp_path):
    """The same check for the ranks a test spawns under the interpreter from an ordinary session. Bug caught:
    their launches went unrecorded (53 specialisations that only such ranks launch, in tests/dist's kernel cases
    and the kernel tests' multi-rank ones, were in no list, so the compile report never compiled them)."""
    test = tmp_path / "test_spawned_variant.py"
    test.write_text(textwrap.dedent(SPAWNED))
    proc = _run(test, None, interpret=False)
    assert proc.returncode != 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "place._place_kernel" in proc.stdout and '"CAST": 1' in proc.stdout, proc.stdout[-3000:]
    specs = tmp_path / "specs.json"
    proc = _run(test, str(specs), interpret=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(m, k, f) for m, k, _, f in kernel_log.load_specs(str(specs))] == [("place", "_place_kernel", True)]


@pytest.mark.parametrize("report,arch", [("compile-sm90-cpu.json", "sm_90a"), ("compile-sm100-cpu.json", "sm_100a")])
def test_the_compile_report_covers_every_recorded_specialisation(report, arch):
    """The committed sm_90a and sm_100a reports (``bench/results/compile-sm{90,100}-cpu.json``) have every
    specialisation of ``kernel-specs.json`` compiled with i32 and i64 sizes for their architecture, none
    spilling registers and no 32-bit multiply in an i64 build. Bugs caught: a recorded variant not compiled
    (a report regenerated from an older list), one that fails to compile or spills (issue 35's target: 100%
    compile, none spills)."""
    import json

    with open(ROOT / "bench/results" / report) as f:
        rows = json.load(f)["rows"]
    assert {r["arch"] for r in rows} == {arch}
    compiled = {}
    for r in rows:
        key = (r["module"], r["kernel"], json.dumps(r["constexprs"], sort_keys=True))
        compiled.setdefault(key, {})[r["ints"]] = r
    for m, k, c, _ in sorted(kernel_log.load_specs(str(ROOT / kernel_log.SPECS))):
        got = compiled.get((m, k, c), {})
        assert set(got) == {"i32", "i64"}, (m, k, c)
        for ints, r in got.items():
            assert r["compiled"], (m, k, c, ints, r.get("error"))
            assert r["n_spills"] == 0 and r["spill_loads"] == 0, (m, k, c, ints, r["n_spills"])
        assert got["i64"]["mul_lo_s32"] == 0 and got["i64"]["mul_wide_s32"] == 0, (m, k, c)
