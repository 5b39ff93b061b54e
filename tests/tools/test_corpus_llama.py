"""Tests for the Python-docs token corpus and the small Llama model used by the benchmarks.

The corpus fixture builds (or loads from cache) the real corpus; a cold build takes
well under a minute, a warm load a fraction of a second.
"""

import math
from pathlib import Path

import pytest
import torch

from megatron_gift_tools.bench.corpus import EOT, TokenCorpus, _train_tokenizer, build_token_corpus, load_documents
from megatron_gift_tools.bench.llama import (
    LlamaConfig,
    LlamaModel,
    Trainer,
    apply_rope,
    capture_inputs,
    layer_type,
    linear_layers,
    lm_loss,
    per_shard_grads,
)

TINY = dict(hidden=32, layers=2, heads=2, ffn_hidden=48, seq_len=16)


@pytest.fixture(scope="module")
def corpus() -> TokenCorpus:
    return build_token_corpus()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return load_documents()[0]


# --------------------------------------------------------------------------- corpus


def test_corpus_reloads_identically(corpus):
    again = build_token_corpus()
    assert again.manifest == corpus.manifest
    assert torch.equal(again.tokens, corpus.tokens)
    m = corpus.manifest
    assert m["num_tokens"] == corpus.tokens.numel() > 1_000_000
    assert len(m["sha256"]) == 64 and len(m["tokens_sha256"]) == 64
    assert any(v for k, v in m["packages"].items() if k.endswith("-doc"))
    assert corpus.tokens.dtype == torch.int32
    assert 0 <= int(corpus.tokens.min()) and int(corpus.tokens.max()) < corpus.vocab_size


def test_tokens_are_the_documents(corpus, docs):
    """Tokens start with the first document, losslessly, followed by EOT."""
    tok = corpus.tokenizer()
    ids = tok.encode(docs[0]).ids
    assert corpus.tokens[: len(ids)].tolist() == ids
    assert int(corpus.tokens[len(ids)]) == corpus.eot_id == tok.token_to_id(EOT)
    assert corpus.decode(corpus.tokens[: len(ids)]) == docs[0]
    assert int((corpus.tokens == corpus.eot_id).sum()) == len(docs)


def test_decoded_slice_is_english(corpus):
    text = corpus.decode(corpus.tokens[500_000:500_400])
    words = text.lower().split()
    assert len(words) > 50
    assert sum(w in {"the", "a", "of", "to", "is", "and", "in"} for w in words) >= 5, text


def test_bpe_training_is_deterministic(docs):
    a = _train_tokenizer(docs[:20], vocab_size=600).to_str()
    b = _train_tokenizer(docs[:20], vocab_size=600).to_str()
    assert a == b


def test_heldout_split_is_disjoint_document_tail(corpus):
    train, heldout = corpus.split()
    n = corpus.tokens.numel()
    assert train.numel() + heldout.numel() == n
    assert torch.equal(heldout, corpus.tokens[train.numel() :])
    assert int(train[-1]) == corpus.eot_id  # held-out starts at a document boundary
    assert 0.01 < heldout.numel() / n < 0.03


def test_batches_are_reproducible_and_respect_split():
    n = 1000
    toy = TokenCorpus(torch.arange(n, dtype=torch.int32), n, Path("unused.json"), {}, eot_id=-1, held_out_fraction=0.1)
    cut = toy.split()[0].numel()
    assert cut == 900
    first = [b for _, b in zip(range(3), toy.batches(seq_len=8, batch_size=4, seed=7))]
    again = [b for _, b in zip(range(3), toy.batches(seq_len=8, batch_size=4, seed=7))]
    other = next(toy.batches(seq_len=8, batch_size=4, seed=8))
    for (x, y), (x2, y2) in zip(first, again):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 8)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(y, x + 1)  # target is the next token
        assert int(y.max()) < cut
    assert not torch.equal(other[0], first[0][0])
    x, y = next(toy.batches(seq_len=8, batch_size=64, split="heldout"))
    assert int(x.min()) >= cut and int(y.max()) < n


# --------------------------------------------------------------------------- model


def test_shapes_names_and_layer_types():
    cfg = LlamaConfig(vocab_size=100, **TINY)
    model = LlamaModel(cfg)
    assert model(torch.randint(0, 100, (3, 10))).shape == (3, 10, 100)
    layers = linear_layers(model)
    assert list(layers)[:4] == [
        "layers.0.self_attention.linear_qkv",
        "layers.0.self_attention.linear_proj",
        "layers.0.mlp.linear_fc1",
        "layers.0.mlp.linear_fc2",
    ]
    assert len(layers) == 4 * cfg.layers
    h, f = cfg.hidden, cfg.ffn_hidden
    expected = {"qkv": (3 * h, h), "proj": (h, h), "fc1": (2 * f, h), "fc2": (h, f)}
    for name, lin in layers.items():
        assert lin.weight.shape == expected[layer_type(name)] and lin.bias is None
    assert layer_type("module.decoder.layers.3.self_attention.linear_qkv.weight") == "qkv"
    with pytest.raises(ValueError):
        layer_type("output_layer.weight")


def test_init_is_deterministic_and_scaled():
    cfg = LlamaConfig(vocab_size=500, hidden=128, layers=4, heads=4, ffn_hidden=256, seq_len=8)
    a, b, c = LlamaModel(cfg, seed=1), LlamaModel(cfg, seed=1), LlamaModel(cfg, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert "layernorm" in name or not torch.equal(pa, pc), name
    assert abs(a.layers[0].mlp.linear_fc1.weight.std().item() - 0.02) < 2e-3
    assert abs(a.layers[0].mlp.linear_fc2.weight.std().item() - 0.02 / math.sqrt(8)) < 1e-3


def test_rope_scores_depend_only_on_relative_position():
    model = LlamaModel(LlamaConfig(vocab_size=10, hidden=32, layers=1, heads=1, ffn_hidden=8, seq_len=32))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 32, generator=gen)
    rot = lambda x: apply_rope(x.expand(32, 32), model.rope_cos, model.rope_sin)  # noqa: E731
    rq, rk = rot(q), rot(k)
    # FP32: a rotation and a d-term dot product each within d · eps of |q| |k| (d = 32), twice
    tol = 2 * 2 * 32 * torch.finfo(torch.float32).eps
    assert torch.allclose(rq[5] @ rk[2], rq[20] @ rk[17], rtol=0, atol=tol * float(q.norm() * k.norm()))
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(32), rtol=0, atol=tol * float(q.norm()))


def test_causal():
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=50, **TINY))
    tokens = torch.randint(0, 50, (2, 16))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 50
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:], atol=1e-4)


def test_shard_grads_average_to_full_batch_grad():
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, **TINY))
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    layers = linear_layers(model)
    full = torch.autograd.grad(lm_loss(model, x, y), [m.weight for m in layers.values()])
    shards = per_shard_grads(model, x, y, shards=4)
    assert len(shards) == 4 and all(s.inputs is None for s in shards)
    for name, g_full in zip(layers, full):
        mean = sum(s.grads[name] for s in shards) / 4
        assert shards[0].grads[name].dtype == torch.float32
        assert torch.allclose(mean, g_full, rtol=1e-4, atol=1e-7), name
    assert abs(sum(s.loss for s in shards) / 4 - lm_loss(model, x, y).item()) < 1e-5
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError):
        per_shard_grads(model, x, y, shards=3)


def test_capture_inputs_shapes_and_kfac_identity():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, **TINY)
    model = LlamaModel(cfg)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    names = list(linear_layers(model))
    with capture_inputs(model, names) as acts:
        model(x)
    d_in = {"qkv": cfg.hidden, "proj": cfg.hidden, "fc1": cfg.hidden, "fc2": cfg.ffn_hidden}
    assert set(acts) == set(names)
    for name, a in acts.items():
        assert a.shape == (4 * 16, d_in[layer_type(name)]) and a.dtype == torch.float32
        assert not a.requires_grad
    with capture_inputs(model, names[:1]) as later:
        pass
    model(x)
    assert later == {}  # hooks are gone after the block

    shard = per_shard_grads(model, x, y, shards=4, capture=True)[2]
    # Gradient rows lie in the row space of the shard's inputs (G = dY^T X), a proper
    # subspace here since the shard has fewer tokens (16) than fc2 has inputs (48).
    name = "layers.1.mlp.linear_fc2"
    xs = shard.inputs[name]
    assert xs.shape == (16, cfg.ffn_hidden)
    xs, g = xs.double(), shard.grads[name].double()
    residual = g - g @ torch.linalg.pinv(xs) @ xs
    # only G's FP32 rounding (16-term sums: 16 · eps relative) leaves the row space; the projection is FP64
    assert residual.norm() < 16 * torch.finfo(torch.float32).eps * g.norm()


def test_training_reduces_loss_on_real_text(corpus):
    model = LlamaModel(
        LlamaConfig(vocab_size=corpus.vocab_size, hidden=64, layers=2, heads=2, ffn_hidden=172, seq_len=32)
    )
    trainer = Trainer(model, corpus, lr=1e-2, batch_size=8, seed=0, warmup_steps=3)
    first = trainer.run(10)
    second = trainer.run(10)  # resumes: optimizer state and batch stream carry over
    assert trainer.step == 20
    assert abs(first[0] - math.log(corpus.vocab_size)) < 0.2
    assert sum(second[-5:]) / 5 < first[0] - 1.0
