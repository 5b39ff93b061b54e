"""Offline sm_90a (or sm_100a) compile report of the Triton kernels (issue 35 item 8), no GPU needed.

Each case (kernel, constexprs as the launchers and kernel tests use them) is compiled with
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (Triton names that ``sm_90a``; ``--arch 100``:
``GPUTarget("cuda", 100, 32)``, ``sm_100a``, Blackwell), with its
integer arguments typed i32 and again i64 (a size above 2^31), and reported with registers,
spills, shared memory and the 32-bit multiplies (``mul.lo.s32``/``mul.wide.s32``) in the PTX.
The cases: every specialisation the kernel tests launch under the interpreter, as recorded in
``bench/results/kernel-specs.json`` (``testing.kernel_log.SPECS``; the interpreter runs fail where they
launch one it lacks: tests/conftest.py), launch options as the launchers derive them from the constexprs.
``CASES`` (hand-picked) are the subset the slow test compiles in CI.
Run: ``python -m megatron_gift_tools.bench.compile --out bench/results/compile-sm90-cpu.json`` (``--arch 100
--out bench/results/compile-sm100-cpu.json`` for Blackwell).
"""

import argparse
import json
import platform
import re
import time

from megatron_gift.testing.kernel_log import (
    E4M3,
    E5M2_MX,
    GROUPS,
    IN_ORDER,
    ORDERED,
    ROW_BLOCKS,
    ROW_GROUPS,
    ROWS_AT,
    UNPLACED,
)

TILE = {"UNIT_W": 128, "W": 128, "BU": 16, "BLOCK_R": 16, "BLOCK_C": 128}
# the FP4 encode's passes without and with the Hadamard rotation in registers (64-element chunks)
UNROTATED, ROTATED = dict(RB=0, RLOG=0, RSCALE=1.0), dict(RB=64, RLOG=6, RSCALE=0.125)
PROJECT_128_32 = dict(BM=128, BK=32, BR=32, BO=16)  # the sender's G Q program shape

# (module, kernel, constexprs, FMA contraction as the launcher sets it)
CASES = [
    (
        "fused",
        "_encode_kernel",
        dict(PASS=2, WHITEN=True, STORE_U=True, FMAX=448.0, **ROW_BLOCKS, **E4M3, **UNPLACED),
        True,
    ),
    (
        "fused",
        "_encode_kernel",
        dict(PASS=2, WHITEN=True, STORE_U=True, FMAX=448.0, **ROW_GROUPS, **E4M3, **UNPLACED),
        False,
    ),
    (
        "fused",
        "_encode_kernel",
        dict(PASS=0, WHITEN=True, STORE_U=False, FMAX=57344.0, **ROW_GROUPS, **E5M2_MX, **UNPLACED),
        False,
    ),
    (
        "fused",
        "_encode_kernel",
        dict(PASS=1, WHITEN=True, STORE_U=True, FMAX=57344.0, **ROW_GROUPS, **E5M2_MX, **UNPLACED),
        False,
    ),
    (
        "fused",
        "_encode_kernel",
        dict(
            PASS=2,
            WHITEN=True,
            STORE_U=False,
            FMAX=448.0,
            PLACE=True,
            FEEDBACK=False,
            OUTPUT=True,
            **ROW_GROUPS,
            **E4M3,
        ),
        False,
    ),
    ("fused", "_project_kernel", dict(SCALE_D=True, PROJECT=True, OUTPUT=False, **PROJECT_128_32, **IN_ORDER), True),
    ("fused", "_project_kernel", dict(SCALE_D=True, PROJECT=True, OUTPUT=False, **PROJECT_128_32, **ROWS_AT), True),
    (
        "fused",
        "_project_kernel",
        dict(SCALE_D=False, PROJECT=True, OUTPUT=False, BM=16, BK=64, BR=64, BO=16, **IN_ORDER),
        True,
    ),
    (
        "fused",
        "_project_kernel",
        dict(SCALE_D=True, PROJECT=True, OUTPUT=True, BM=64, BK=16, BR=32, BO=32, **IN_ORDER),
        True,
    ),
    (
        "fused",
        "_project_kernel",
        dict(SCALE_D=True, PROJECT=True, OUTPUT=True, BM=64, BK=16, BR=16, BO=16, **IN_ORDER),
        True,
    ),
    ("place", "_place_kernel", dict(WHITEN=True, OUTPUT=False, CAST=2, **IN_ORDER), True),
    ("place", "_place_kernel", dict(WHITEN=True, OUTPUT=False, CAST=0, **ROWS_AT), True),  # the summed-first rows
    ("place", "_place_kernel", dict(WHITEN=True, OUTPUT=True, CAST=2, **IN_ORDER), True),
    ("place", "_place_kernel", dict(WHITEN=False, OUTPUT=False, CAST=0, BLOCK_R=1, BLOCK_C=1024, **IN_ORDER), True),
    ("fused", "_decode_sum_kernel", dict(AVERAGE=True, BF16=False, **GROUPS, **E4M3), False),
    ("fused", "_decode_sum_kernel", dict(AVERAGE=False, BF16=True, **ORDERED, **E5M2_MX), False),
    ("receive", "_decode_placed_kernel", dict(BF16=True, **GROUPS, **E4M3), False),
    ("receive", "_decode_placed_kernel", dict(BF16=False, **ORDERED, **E5M2_MX), False),
    ("receive", "_sum_kernel", dict(AVERAGE=True, PLACE=2, BLOCK=1024, BF16=True), False),
    ("receive", "_sum_kernel", dict(AVERAGE=False, PLACE=1, BLOCK=1024, BF16=False), False),
    ("fused", "_unwhiten_kernel", dict(BF16=False), True),
    ("fused", "_unwhiten_kernel", dict(BF16=True), True),
    ("output", "_output_inverse_kernel", dict(BF16=True), True),
    ("delta", "_encode_kernel", dict(BB=4, MANT=7), False),
    ("delta", "_decode_kernel", dict(BB=4, MANT=7), False),
    ("delta", "_decode_kernel", dict(BB=4, MANT=10), False),
    ("fp4", "_fp4_amax_kernel", dict(BLOCK=16, BB=64, SRC=0, **UNROTATED), True),
    ("fp4", "_fp4_amax_kernel", dict(BLOCK=16, BB=64, SRC=0, **ROTATED), True),
    ("fp4", "_fp4_amax_kernel", dict(BLOCK=16, BB=64, SRC=2, **ROTATED), True),  # read in a BF16 bucket
    ("fp4", "_fp4_encode_kernel", dict(BLOCK=16, BB=64, NVFP4=True, SRC=0, **UNROTATED), True),
    ("fp4", "_fp4_encode_kernel", dict(BLOCK=16, BB=64, NVFP4=True, SRC=0, **ROTATED), True),
    ("fp4", "_fp4_encode_kernel", dict(BLOCK=16, BB=64, NVFP4=True, SRC=2, **ROTATED), True),
    ("fp4", "_fp4_encode_kernel", dict(BLOCK=32, BB=64, NVFP4=False, SRC=0, **UNROTATED), True),
    ("fp4", "_fp4_encode_kernel", dict(BLOCK=32, BB=64, NVFP4=False, SRC=0, **ROTATED), True),
    ("fp4", "_fp4_encode_kernel", dict(BLOCK=32, BB=64, NVFP4=False, SRC=1, **UNROTATED), True),  # spilled at 80
    ("fp4", "_fp4_decode_sum_kernel", dict(BLOCK=16, BB=64, NVFP4=True, **UNROTATED), True),
    ("fp4", "_fp4_decode_sum_kernel", dict(BLOCK=16, BB=64, NVFP4=True, **ROTATED), True),
    ("fp4", "_fp4_decode_sum_kernel", dict(BLOCK=32, BB=64, NVFP4=False, **UNROTATED), True),
    ("fp4", "_fp4_decode_sum_kernel", dict(BLOCK=32, BB=64, NVFP4=False, **ROTATED), True),
    ("fp4", "_rotate_kernel", dict(INVERSE=False, BLOCK=64, LOG=6, SCALE=0.125, BB=16), True),
    ("fp4", "_rotate_kernel", dict(INVERSE=True, BLOCK=64, LOG=6, SCALE=0.125, BB=16), True),
]


def signature(kernel, module, constexprs, int_type):
    """Triton types of ``kernel``'s arguments as the launchers pass them (``testing.kernel_log``'s table)."""
    from megatron_gift.testing.kernel_log import kernel_signature

    return kernel_signature(kernel, constexprs, int_type)


def ptxas_usage(ptx, arch, capability=90):
    """Registers and spill bytes from ``ptxas -v`` (Triton's own ptxas): the compiled metadata has
    ``n_regs``/``n_spills`` only once a driver loads the cubin, which needs a GPU."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [get_ptxas(capability).path, "-v", f"-arch={arch}", path, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", out)
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out).groups()
    return {"n_regs": int(regs.group(1)), "n_spills": int(stores), "spill_loads": int(loads)}


def compile_case(module, name, constexprs, fusion, int_type, capability=90):
    """One offline compile (``capability`` 90: sm_90a, 100: sm_100a): its registers, spills, shared memory
    and 32-bit multiplies."""
    import importlib

    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(f"megatron_gift.kernels.{module}"), name)
    if module == "delta":
        from megatron_gift.kernels import delta

        constexprs = {**constexprs, "BB": delta.BB}
    constexprs = {**{k: v for k, v in TILE.items() if k in kernel.arg_names}, **constexprs}
    sig = signature(kernel, module, constexprs, int_type)
    src = ASTSource(kernel, sig, {(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    options = {"enable_fp_fusion": fusion}
    if (module, name) == ("place", "_place_kernel"):  # the registers its launcher allows
        from megatron_gift.kernels.place import PLACE_OPTIONS

        options.update(PLACE_OPTIONS)
    if (module, name) == ("fp4", "_fp4_amax_kernel"):  # the registers its launcher allows
        from megatron_gift.kernels.fp4 import AMAX_OPTIONS

        options.update(AMAX_OPTIONS)
    if (module, name) == ("fp4", "_fp4_encode_kernel"):  # the registers its launcher allows
        from megatron_gift.kernels.fp4 import ENCODE_OPTIONS

        options.update(ENCODE_OPTIONS)
    if (module, name) == ("fused", "_decode_sum_kernel"):  # the registers its launcher allows
        from megatron_gift.kernels.fused import DECODE_OPTIONS

        options.update(DECODE_OPTIONS)
    if (module, name) == ("fused", "_project_kernel"):  # the warps and registers its launchers pick
        from megatron_gift.kernels.fused import project_options

        options.update(project_options(constexprs["BM"], constexprs["BR"], constexprs["OUTPUT"], constexprs["BK"]))
    if (module, name) == ("fused", "_encode_kernel"):  # the warps and registers its launcher picks
        from megatron_gift.kernels.fused import encode_options

        options.update(encode_options(constexprs["WHITEN"] or constexprs["OUTPUT"], constexprs["LAYOUT"]))
    start = time.perf_counter()
    try:
        compiled = triton_compile(src, target=GPUTarget("cuda", capability, 32), options=options)
    except Exception as e:  # a failed compile is a result, reported
        return {"compiled": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    md, ptx = compiled.metadata, compiled.asm["ptx"]
    arch = re.search(r"\.target (\S+)", ptx).group(1)
    return {
        "compiled": True,
        "arch": arch,
        **ptxas_usage(ptx, arch, capability),
        "shared_bytes": md.shared,
        "num_warps": md.num_warps,
        "mul_lo_s32": ptx.count("mul.lo.s32"),
        "mul_wide_s32": ptx.count("mul.wide.s32"),
        "seconds": round(time.perf_counter() - start, 1),
    }


def report(cases=CASES, int_types=("i32", "i64"), capability=90):
    rows = []
    for module, name, constexprs, fusion in cases:
        for int_type in int_types:
            row = {"module": module, "kernel": name, "constexprs": constexprs, "ints": int_type}
            rows.append({**row, **compile_case(module, name, constexprs, fusion, int_type, capability)})
    return rows


def recorded_cases(path: str) -> list[tuple]:
    """``CASES``-shaped cases of the recorded specialisations at ``path`` (``kernel_log.SPECS``)."""
    from megatron_gift.testing.kernel_log import load_specs

    return [(m, k, json.loads(c), f) for m, k, c, f in sorted(load_specs(path))]


def main(argv=None):
    from megatron_gift.testing.kernel_log import SPECS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/compile-sm90-cpu.json")
    parser.add_argument("--specs", default=SPECS, help="the recorded specialisations (default: %(default)s)")
    parser.add_argument("--arch", type=int, choices=(90, 100), default=90, help="90: sm_90a (Hopper), 100: sm_100a")
    args = parser.parse_args(argv)
    import triton

    rows = report(recorded_cases(args.specs), capability=args.arch)
    arch = "" if args.arch == 90 else f" --arch {args.arch}"
    doc = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), offline compile, no GPU",
        "triton": triton.__version__,
        "target": f'GPUTarget("cuda", {args.arch}, 32)',
        "command": f"python -m megatron_gift_tools.bench.compile --out {args.out} --specs {args.specs}{arch}",
        "specs": args.specs,
        "compiled": f"{sum(r['compiled'] for r in rows)}/{len(rows)}",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for r in rows:
        spec = ",".join(f"{k}={v}" for k, v in r["constexprs"].items() if k in ("PASS", "BM", "LAYOUT", "CAST", "BF16"))
        print(r["module"], r["kernel"], spec, r["ints"], {k: r.get(k) for k in ("n_regs", "n_spills", "shared_bytes")})


if __name__ == "__main__":
    main()
