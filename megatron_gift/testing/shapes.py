"""Llama-style model shapes that the runtime's tests and the tools' planner and benchmarks share.

Presets: ``300m``/``600m`` are the paper's Llama-300M/600M (arXiv 2607.07494; GPT-2 tokenizer,
50257 padded to 50304); ``1.3b`` a Llama-shaped 1.35B (24 x 2048, SwiGLU 5504, Llama's 32000
vocabulary); ``7b`` Llama-2-7B (Touvron et al. 2023: 32 x 4096, FFN 11008, 32 heads, vocabulary
32000, context 4096). ``bench overhead`` and the GPU check time their layers at these shapes.
"""

from __future__ import annotations

PRESETS = {
    "300m": dict(layers=24, hidden=1024, heads=16, ffn=2736, seq=4096, vocab=50304),
    "600m": dict(layers=32, hidden=1280, heads=20, ffn=3456, seq=2048, vocab=50304),
    "1.3b": dict(layers=24, hidden=2048, heads=16, ffn=5504, seq=2048, vocab=32000),
    "7b": dict(layers=32, hidden=4096, heads=32, ffn=11008, seq=4096, vocab=32000),
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=8192, vocab=128256),
}


def layer_shapes(m: dict) -> dict[str, tuple[int, int]]:
    """Weight-gradient shapes ``[d_out, d_in]`` of one transformer layer's linear layers (SwiGLU; ``qkv``:
    the queries plus ``kv_heads`` keys and values of ``hidden / heads`` each, Megatron's query groups;
    without ``kv_heads`` (or 0), one per query head)."""
    h, f = m["hidden"], m["ffn"]
    kv = 2 * m["kv_heads"] * (h // m["heads"]) if m.get("kv_heads") else 2 * h
    return {"qkv": (h + kv, h), "proj": (h, h), "fc1": (2 * f, h), "fc2": (h, f)}
