"""Block-scale formats of the E4M3 1x128 codec: bias of the block maxima, RelL2 and bytes.

Each variant stores the dequantization scale ``s`` of a block differently::

    bf16-up    s = bf16 rounded up (amax / 448)     2 B/block   (the codec before docs/codec.md)
    bf16-rne   s = bf16 rounded to nearest          2 B/block   (the maximum may saturate)
    e8m0       s = 2^ceil(log2(amax / 448))         1 B/block   (power of two, OCP MX style)
    fp32       s = amax / 448                       4 B/block   (the codec now)

and is run through the codec itself: ``fp8.encode`` with the per-block ``amax`` overridden by
``448 · s`` (exact in FP32: ``s`` has at most 8 significant bits), so ``s`` is the variant's scale.
For each data set: ``rel_l2 = ‖x̂ − x‖ / ‖x‖``, the signed relative error of each block's
largest element ``(|x̂_max| − |x_max|) / |x_max|`` (mean and largest magnitude) and bytes per
element on the wire. Run: ``python -m megatron_gift_tools.bench.scales --json bench/results/scales-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from megatron_gift.numerics import fp8
from megatron_gift.numerics.fp8 import CodecConfig

CFG = CodecConfig("e4m3", "block")
FMAX = CFG.fmt.max
TINY = torch.finfo(torch.float32).tiny


def _bf16_up(s: torch.Tensor) -> torch.Tensor:
    b = s.to(torch.bfloat16)
    return torch.where(b.float() < s, torch.nextafter(b, torch.full_like(b, float("inf"))), b).float()


VARIANTS = {  # name -> (scale from the exact FP32 scale, bytes per block)
    "bf16-up": (_bf16_up, 2),
    "bf16-rne": (lambda s: s.to(torch.bfloat16).float(), 2),
    "e8m0": (lambda s: torch.exp2(torch.ceil(torch.log2(s))), 1),
    "fp32": (lambda s: s, 4),
}


def datasets(rows: int, cols: int, seed: int) -> dict[str, torch.Tensor]:
    """Gaussian; log-normal magnitudes (heavy tails); a weight gradient whose input has two
    "massive activation" channels (300x), which dominate the blocks they fall in."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, cols, generator=gen)
    massive = g.clone()
    massive[:, [5, cols // 2 + 60]] *= 300.0
    return {
        "gaussian": g,
        "lognormal": torch.randn(rows, cols, generator=gen) * torch.exp(2 * torch.randn(rows, cols, generator=gen)),
        "massive-activations": massive,
    }


def measure(x: torch.Tensor, variant: str) -> dict:
    """RelL2 and the block maxima's signed relative error of one variant on ``x [rows, cols]``."""
    to_scale, scale_bytes = VARIANTS[variant]
    rows, cols = x.shape
    blocks = x.view(rows, cols // CFG.block, CFG.block)
    amax = blocks.abs().amax(-1)
    s = to_scale((amax / FMAX).clamp_min(TINY))
    y = fp8.decode(fp8.encode(x, CFG, amax=FMAX * s), CFG).view_as(blocks)
    idx = blocks.abs().argmax(-1, keepdim=True)
    xmax, ymax = blocks.gather(-1, idx).double(), y.gather(-1, idx).double()
    signed = (ymax.abs() - xmax.abs()) / xmax.abs()
    return dict(
        variant=variant,
        bytes_per_element=1 + scale_bytes / CFG.block,
        rel_l2=((y - blocks).norm() / blocks.norm()).item(),
        max_mean_signed_rel_err=signed.mean().item(),
        max_largest_abs_rel_err=signed.abs().max().item(),
    )


def run(rows: int, cols: int, seed: int) -> list[dict]:
    return [
        dict(data=name, **measure(x, variant)) for name, x in datasets(rows, cols, seed).items() for variant in VARIANTS
    ]


COLUMNS = {  # JSON field -> (table heading, format)
    "data": ("data", "{}"),
    "variant": ("scale", "{}"),
    "bytes_per_element": ("B/element", "{:.4f}"),
    "rel_l2": ("RelL2", "{:.3e}"),
    "max_mean_signed_rel_err": ("mean signed err. of block max", "{:+.2e}"),
    "max_largest_abs_rel_err": ("largest abs. err. of block max", "{:.2e}"),
}


def format_table(results: list[dict]) -> str:
    def row(cells) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = [row(h for h, _ in COLUMNS.values()), "|---" * len(COLUMNS) + "|"]
    lines += [row(fmt.format(r[k]) for k, (_, fmt) in COLUMNS.items()) for r in results]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=1024, help="a multiple of 128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results here")
    a = p.parse_args(argv)
    if a.cols % CFG.block:
        p.error(f"--cols must be a multiple of {CFG.block}")
    results = run(a.rows, a.cols, a.seed)
    print(format_table(results), end="")
    if a.json:
        doc = dict(
            command="python -m megatron_gift_tools.bench.scales "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            machine=dict(
                platform=platform.platform(),
                processor=platform.processor() or platform.machine(),
                torch=torch.__version__,
            ),
            spec=dict(rows=a.rows, cols=a.cols, seed=a.seed, codec=CFG.name, block=CFG.block),
            results=results,
        )
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
