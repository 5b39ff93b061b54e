"""FP4 schemes of ``bench pretrained`` (issue 36): each layer's gradients sent in NVFP4 or MXFP4, plain
(``euclidean``), rotated (``hadamard``: ``U = G R``), whitened (``gift``: ``U = G T``) or both
(``gift+hadamard``: ``U = (G T) R``); the receiver forms ``(Σ_r dec(enc(U_r))) Rᵀ T⁻¹`` in FP32.

``T`` is the input-side map the plugin sends at ``--gift-side input`` (``gift-chosen``'s: the damping
chosen on FP8 errors, gated by the cold-start rule); ``R`` the seeded block Hadamard (``numerics.rotation``,
block ``HADAMARD_BLOCK``). Each rank's gradient is one segment (one FP32 tensor scale for NVFP4). With
``blocks``, ``gift+hadamard@b`` measures the rotation at other block sizes on the same gradients; the scheme
``chosen`` is ``--gift-rotation auto``'s choice per layer (the function ``chosen``).
"""

from __future__ import annotations

import torch

from megatron_gift.numerics.fp4 import FP4_FORMATS, FP4Format, roundtrip_fp4
from megatron_gift.numerics.rotation import BlockHadamard

SCHEMES = ("euclidean", "hadamard", "gift", "gift+hadamard")
HADAMARD_BLOCK = 64
FORMATS = ("fp8", *FP4_FORMATS)


def parse_formats(text: str) -> tuple[str, ...]:
    """``"fp8,nvfp4"`` -> ("fp8", "nvfp4"); fp8 is always measured (its records come first)."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in FORMATS]
    if bad:
        raise ValueError(f"--formats: unknown {bad}, choose among {list(FORMATS)}")
    return ("fp8", *[v for v in FP4_FORMATS if v in names])


def fp4_sum(stack: torch.Tensor, fmt: FP4Format, t, rot: BlockHadamard | None) -> torch.Tensor:
    """``(Σ_r dec(enc(G_r T R))) Rᵀ T⁻¹`` (FP32; ``t``/``rot`` None: left out) of ``stack [ranks, d_out, d_in]``."""
    total = torch.zeros_like(stack[0])
    for g in stack:
        u = g if t is None else t.apply(g)
        u = u if rot is None else rot.apply(u)
        total += roundtrip_fp4(u.reshape(-1), fmt).view_as(u)
    total = total if rot is None else rot.inverse(total)
    return total if t is None else t.inverse(total)


def wire_roundtrip(fmt: FP4Format, rot: BlockHadamard | None):
    """``u -> dec(enc(u))`` in ``fmt`` of a matrix sent as one segment (rotated by ``rot`` and back)."""

    def roundtrip(u: torch.Tensor) -> torch.Tensor:
        v = u if rot is None else rot.apply(u)
        v = roundtrip_fp4(v.reshape(-1), fmt).view_as(v)
        return v if rot is None else rot.inverse(v)

    return roundtrip


def measure(
    stack, truth, t, formats, key: dict, noise, blocks: tuple[int, ...] = (), wire_t: dict | None = None
) -> list[dict]:
    """Records of every FP4 format in ``formats`` and scheme (``key``'s fields, ``format``, ``scheme``,
    ``rel_l2``, ``rel_l2_se``, ``ratio`` and ``euclid_se`` against the same format's ``euclidean``);
    ``noise(approx, truth) -> (rel_l2, se)``. A rotation whose block does not divide ``d_in`` is skipped.
    ``wire_t``: ``{(format, scheme): T}``, the ``T`` chosen on that wire's own errors
    (``plugin_sim.GiftLayer.quantizers``), measured as ``scheme/wire-damping``."""
    d_in = stack.shape[2]
    out = []
    for name in formats:
        if name not in FP4_FORMATS:
            continue
        fmt = FP4_FORMATS[name]
        if d_in % fmt.block:
            continue
        rows = []
        variants = [(s, t if "gift" in s else None, HADAMARD_BLOCK if "hadamard" in s else None) for s in SCHEMES]
        variants += [(f"gift+hadamard@{b}", t, b) for b in blocks]
        for scheme in ("gift", "gift+hadamard"):
            if wire_t is not None and (name, scheme) in wire_t:
                b = HADAMARD_BLOCK if "hadamard" in scheme else None
                variants.append((f"{scheme}/wire-damping", wire_t[(name, scheme)], b))
        for scheme, tt, b in variants:
            if b is not None and d_in % b:
                continue
            rel, se = noise(fp4_sum(stack, fmt, tt, BlockHadamard(b) if b else None), truth)
            rows.append({**key, "format": name, "scheme": scheme, "rel_l2": rel, "rel_l2_se": se})
        base = rows[0]
        for r in rows:
            r["ratio"] = r["rel_l2"] / base["rel_l2"]
            r["euclid_se"] = base["rel_l2_se"]
        out += rows
    return out


def chosen(records: list[dict], wire_error: dict) -> list[dict]:
    """``--gift-rotation auto``'s scheme (``chosen``) per FP4 format of one layer's ``records``: the last
    refresh measured the four-bit error of its damping choice with and without the rotation on the owner's
    gradient (``wire_error``: ``GiftLayer``'s, keyed ``input@(format, scheme)``) and sends the smaller, as
    the runtime's refresh does (``damping_wire``); the record is that ``scheme/wire-damping`` one's, with
    ``rotate``. None before the first refresh."""
    out = []
    for r in records:
        if r["scheme"] != "gift/wire-damping":
            continue
        plain, rotated = (wire_error.get(f"input@{(r['format'], s)}") for s in ("gift", "gift+hadamard"))
        if plain is None or rotated is None:
            continue
        rotate = rotated < plain
        pick = "gift+hadamard/wire-damping" if rotate else "gift/wire-damping"
        src = next((x for x in records if x["format"] == r["format"] and x["scheme"] == pick), None)
        if src is not None:
            out.append({**src, "scheme": "chosen", "rotate": rotate})
    return out


def block_choice(records: list[dict], cold_steps: int = 2) -> list[dict]:
    """Per FP4 format and model: the geometric-mean ratio (to the format's Euclidean, steps >= ``cold_steps``)
    of ``gift+hadamard`` at each measured block, over the layers where every block was measured, and the best."""
    import math
    from collections import defaultdict

    by = defaultdict(dict)  # (format, model) -> (step, layer) -> {block: ratio}
    for r in records:
        if r.get("format", "fp8") != "fp8" and r["step"] >= cold_steps and r["scheme"].startswith("gift+hadamard@"):
            by[(r["format"], r["model"])].setdefault((r["step"], r["layer"]), {})[int(r["scheme"].split("@")[1])] = r[
                "ratio"
            ]
    out = []
    for (fmt, model), cells in sorted(by.items()):
        blocks = sorted({b for c in cells.values() for b in c})
        full = [c for c in cells.values() if len(c) == len(blocks)]
        if not full:
            continue
        ratio = {b: math.exp(sum(math.log(c[b]) for c in full) / len(full)) for b in blocks}
        out.append(dict(format=fmt, model=model, records=len(full), ratio=ratio, best=min(ratio, key=ratio.get)))
    return out
