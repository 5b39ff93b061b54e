"""Triton kernels on a machine without a GPU: each launch logged as ``(kernel name, bound arguments and
grid)`` (how tests and ``bench param-gather`` check a kernel's launch count and its ``TRAFFIC`` entry on
real launches), and a kernel test file run again under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

from .limits import wall_limit


class Logged:
    """``kernel`` (a Triton JIT function) launched as ``kernel[grid](...)``, appending to ``log`` first."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, dict(zip(self.kernel.arg_names, args), **kwargs, grid=tuple(grid))))
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextmanager
def launches_of(module):
    """Within the block every kernel ``module.TRAFFIC`` names logs its launches into the yielded list."""
    log: list[tuple[str, dict]] = []
    kernels = {name: getattr(module, name) for name in module.TRAFFIC}
    for name, kernel in kernels.items():
        setattr(module, name, Logged(kernel, name, log))
    try:
        yield log
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)


SPECS = "bench/results/kernel-specs.json"
"""the specialisations the kernel tests launch (``launched_specialisations``), which ``bench/compile.py`` compiles."""
SPECS_ENV = "GIFT_KERNEL_SPECS"
"""set to a path: the interpreter sessions add the specialisations they launch to that JSON (tests/conftest.py)."""
SPAWNED: set = set()
"""the specialisations that ranks spawned by ``testing.spawn`` under the interpreter launched (tests/conftest.py)."""


def specialisation(fn, args: tuple, kwargs: dict) -> tuple[str, str, str, bool]:
    """``(module, kernel, constexprs as sorted JSON, FMA contraction)`` of one launch of the Triton function
    ``fn`` (its Python function): what an offline compile needs besides the argument types."""
    import inspect
    import json

    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters}).arguments
    constexprs = {
        name: getattr(value, "value", value)
        for name, value in bound.items()
        if str(sig.parameters[name].annotation).endswith("constexpr")
    }
    module = fn.__module__.rpartition(".")[2]
    return module, fn.__name__, json.dumps(constexprs, sort_keys=True), bool(kwargs.get("enable_fp_fusion", True))


@contextmanager
def launched_specialisations():
    """Within the block, every interpreted launch of a ``megatron_gift.kernels`` function adds its
    ``specialisation`` to the yielded set."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set = set()
    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("megatron_gift.kernels"):
            seen.add(specialisation(self.fn, args, kwargs))
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield seen
    finally:
        InterpretedFunction.run = real


def load_specs(path: str) -> set:
    """The recorded specialisations at ``path`` (an empty set where it does not exist)."""
    import json

    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {
            (r["module"], r["kernel"], json.dumps(r["constexprs"], sort_keys=True), r["fusion"]) for r in json.load(f)
        }


def save_specs(path: str, specs: set) -> None:
    """Write ``specs`` (``specialisation`` tuples) to ``path``, sorted: what ``load_specs`` reads."""
    import json

    rows = [dict(module=m, kernel=k, constexprs=json.loads(c), fusion=f) for m, k, c, f in sorted(specs)]
    with open(path, "w") as f:  # one specialisation per line
        f.write("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")


def assert_passes_under_interpreter(test_file: str, limit: float = 900.0) -> None:
    """Run ``test_file``'s tests in a fresh process with ``TRITON_INTERPRET=1`` (the interpreter must be on
    before the kernels are defined) and require every one to pass: none failed, skipped or deselected."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        env=env,
        capture_output=True,
        text=True,
        timeout=wall_limit(limit),
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary and "deselected" not in summary, summary


# Constexpr groups of the fused kernels as their launchers pass them, for offline compiles (the sm_90
# test, ``megatron_gift_tools.bench.compile``): a wire format's, a tiling's, and an encode's without
# placement, error feedback or an output side.
E4M3 = dict(MANT=3, BIAS=7, NO_INF=True, E8M0=False)
E5M2_MX = dict(MANT=2, BIAS=15, NO_INF=False, E8M0=True)
ROW_BLOCKS, GROUPS, ORDERED, ROW_GROUPS = (
    dict(LAYOUT=1, ONE_CHUNK=True),
    dict(LAYOUT=2, ONE_CHUNK=False),
    dict(LAYOUT=0, ONE_CHUNK=True),
    dict(LAYOUT=3, ONE_CHUNK=False),
)
UNPLACED = dict(PLACE=False, FEEDBACK=False, OUTPUT=False)
IN_ORDER, ROWS_AT = dict(ROW_INDEX=False), dict(ROW_INDEX=True)  # rows at i·cols, or where they lie (RowsAt)


def kernel_signature(kernel, constexprs: dict, int_type: str = "i32") -> dict:
    """Triton types of ``kernel``'s arguments as the launchers pass them, for an offline compile: codes
    uint8, scales E8M0 bytes or FP32, group ends, placement tables, row starts and matrices int64, a placed cast's
    output BF16, a BF16 output of the receive kernels int16 bits, other pointers FP32 (the delta kernels: their
    parameters in BF16 for ``MANT`` 7, else FP16; the FP4 kernels: segment maxima int32 bits, the
    rotation's block starts and sign rows int64, a source's flags int64 and values BF16 for ``SRC`` 2);
    integers ``int_type``; ``constexprs`` as given."""
    if "BB" in constexprs and "MANT" not in constexprs:  # kernels.fp4: maxima int32 bits, codes bytes
        types = {"amax_ptr": "*i32", "codes_ptr": "*u8", "scales_ptr": "*u8", "msg_ptr": "*u8"}
        types.update(starts_ptr="*i64", rows_ptr="*i64", rot_ptr="*i64")  # the rotation's starts and sign rows
        types.update(src_from_ptr="*i64", src_ptr="*bf16" if constexprs.get("SRC") == 2 else "*fp32")  # a Source

        def pointer(name):
            return "*i64" if "ends" in name or "delta" in name else types.get(name, "*fp32")

    elif "BB" in constexprs:  # kernels.delta
        dtype = "bf16" if constexprs["MANT"] == 7 else "fp16"
        types = {"codes_ptr": "*i8", "scales_ptr": "*u8", "msg_ptr": "*u8"}

        def pointer(name):
            return types.get(name, f"*{dtype}")

    else:

        def pointer(name):
            if name in ("ends_ptr", "table_ptr", "row_ptr", "mat_ptr") or name.endswith("delta_ptr"):
                return "*i64"
            if name == "out_ptr" and constexprs.get("CAST") == 2:
                return "*bf16"
            if name == "out_ptr" and constexprs.get("BF16"):
                return "*i16"
            if name.startswith("code"):
                return "*u8"
            if name.startswith("scale"):
                return "*u8" if constexprs.get("E8M0") and constexprs.get("PASS") != 2 else "*fp32"
            return "*fp32"

    return {
        a: "constexpr" if a in constexprs else pointer(a) if a.endswith("_ptr") else int_type for a in kernel.arg_names
    }
