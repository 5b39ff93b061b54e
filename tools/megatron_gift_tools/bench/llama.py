"""A small Llama-style decoder in pure PyTorch, plus gradient-measurement helpers.

The benchmarks need real per-rank weight gradients of transformer linear layers
without Megatron or a GPU. This model has the Llama architecture (RMSNorm, RoPE,
causal attention, SwiGLU MLP, no biases, untied embeddings) and names its linear
layers like Megatron-Core (``layers.{i}.self_attention.linear_qkv``, ``linear_proj``,
``layers.{i}.mlp.linear_fc1``, ``linear_fc2``), with Megatron's fused row layouts, so
the analysis code can treat its gradients exactly like Megatron's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_gift_tools.bench.corpus import TokenCorpus

_LAYER_TYPES = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2"}


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape. ``seq_len`` is the longest sequence RoPE tables are built for."""

    vocab_size: int = 8192
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    ffn_hidden: int = 688
    seq_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"hidden={self.hidden} must split into {self.heads} heads of even size")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x[..., t, d]`` (rotate-half convention, as Megatron's default)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class SelfAttention(nn.Module):
    """Causal multi-head attention with RoPE.

    ``linear_qkv.weight`` is ``[3*hidden, hidden]`` in Megatron's layout: per head,
    the rows of q, then k, then v (``[heads, 3*head_dim, hidden]`` flattened).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.linear_qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.linear_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        qkv = self.linear_qkv(x).view(b, t, self.heads, 3 * self.head_dim)
        q, k, v = (z.transpose(1, 2) for z in qkv.split(self.head_dim, dim=-1))  # [b, heads, t, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(out.transpose(1, 2).reshape(b, t, h))


class MLP(nn.Module):
    """SwiGLU MLP; ``linear_fc1.weight`` is ``[2*ffn, hidden]``, gate rows first (as Megatron)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden, 2 * cfg.ffn_hidden, bias=False)
        self.linear_fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.self_attention = SelfAttention(cfg)
        self.pre_mlp_layernorm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder-only LM mapping token ids ``[batch, t]`` to logits ``[batch, t, vocab]``.

    Initialization is a deterministic function of ``seed`` (the global RNG is not
    touched): N(0, 0.02) weights, output projections (``linear_proj``, ``linear_fc2``)
    scaled down by ``1/sqrt(2*layers)``, unit norm weights.
    """

    def __init__(self, config: LlamaConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.layers))
        self.final_layernorm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.output_layer = nn.Linear(config.hidden, config.vocab_size, bias=False)

        inv_freq = 1.0 / config.rope_base ** (torch.arange(0, config.head_dim, 2).double() / config.head_dim)
        angles = torch.outer(torch.arange(config.seq_len).double(), inv_freq).repeat(1, 2)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        out_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, p in self.named_parameters():
            if "layernorm" in name:
                p.fill_(1.0)
            else:
                std = out_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds config.seq_len={self.config.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output_layer(self.final_layernorm(x))


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens of the batch."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def layer_type(name: str) -> str:
    """``'qkv' | 'proj' | 'fc1' | 'fc2'`` from a module or parameter name.

    Accepts names of this model and Megatron-Core's alike, e.g.
    ``layers.0.mlp.linear_fc1`` or ``module.decoder.layers.3.self_attention.linear_qkv.weight``.
    """
    parts = name.split(".")
    if parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    if not parts or parts[-1] not in _LAYER_TYPES:
        raise ValueError(f"not a transformer linear layer name: {name!r}")
    return _LAYER_TYPES[parts[-1]]


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The transformer blocks' linear layers by module name, in model order.

    Embedding and ``output_layer`` are excluded: the benchmark studies the four
    per-layer weight types.
    """
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in _LAYER_TYPES
    }


@contextmanager
def capture_inputs(model: nn.Module, names: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Record the inputs of the named linear layers during forwards inside the block.

    Yields a dict filled as forwards run: name -> detached fp32 ``[tokens, d_in]``
    (rows of several forwards are concatenated). ``X.T @ X`` of an entry is the
    layer's K-FAC input statistic.
    """
    modules = dict(model.named_modules())
    captured: dict[str, torch.Tensor] = {}

    def make_hook(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            captured[name] = torch.cat([captured[name], x]) if name in captured else x

        return hook

    handles = [modules[name].register_forward_pre_hook(make_hook(name)) for name in names]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture_output_grads(model: nn.Module, names: Iterable[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Record the gradients of the named linear layers' outputs during backwards of forwards run
    inside the block: name -> detached fp32 ``[tokens, d_out]``, rows of one forward aligned with
    ``capture_inputs``'; several forwards' blocks are concatenated in the order the backward reaches
    them (not necessarily forward order). ``GᵀG`` of an entry is the layer's K-FAC output statistic."""
    modules = dict(model.named_modules())
    captured: dict[str, torch.Tensor] = {}

    def make_hook(name: str):
        def store(grad: torch.Tensor) -> None:
            g = grad.detach().reshape(-1, grad.shape[-1]).float()
            captured[name] = torch.cat([captured[name], g]) if name in captured else g

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(store)

        return hook

    handles = [modules[name].register_forward_hook(make_hook(name)) for name in names]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class ShardGrads:
    """One simulated data-parallel rank's result: its loss, weight grads and (optionally) inputs."""

    loss: float
    grads: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor] | None = None


def per_shard_grads(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, shards: int, capture: bool = False
) -> list[ShardGrads]:
    """Split a batch into ``shards`` equal parts (simulated DP ranks) and take each one's gradients.

    Each shard's loss is the mean cross-entropy over its own tokens, as on a real
    rank, so the full-batch gradient is the *average* of the shard gradients. Grads
    are fp32 weight gradients of every layer in :func:`linear_layers`; with
    ``capture=True`` each shard also carries those layers' input activations.
    Parameters' ``.grad`` fields are left untouched.
    """
    if inputs.shape[0] % shards:
        raise ValueError(f"batch size {inputs.shape[0]} is not divisible by shards={shards}")
    layers = linear_layers(model)
    names = list(layers)
    weights = [layers[name].weight for name in names]
    results = []
    for x, y in zip(inputs.chunk(shards), targets.chunk(shards)):
        with capture_inputs(model, names if capture else ()) as acts:
            loss = lm_loss(model, x, y)
        grads = torch.autograd.grad(loss, weights)
        results.append(
            ShardGrads(
                loss=loss.item(),
                grads={name: g.float() for name, g in zip(names, grads)},
                inputs=acts if capture else None,
            )
        )
    return results


class Trainer:
    """Resumable fp32 AdamW training on corpus batches.

    Call :meth:`run` repeatedly to reach successive checkpoints; optimizer state,
    learning-rate warmup and the batch stream carry over between calls.
    """

    def __init__(
        self,
        model: nn.Module,
        corpus: TokenCorpus,
        lr: float = 3e-3,
        batch_size: int = 16,
        seq_len: int | None = None,
        seed: int = 0,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        grad_clip: float = 1.0,
    ):
        self.model = model
        self.grad_clip = grad_clip
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.95),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps))
        )
        self.batches = corpus.batches(seq_len or model.config.seq_len, batch_size, seed=seed)
        self.step = 0

    def run(self, steps: int) -> list[float]:
        """Take ``steps`` optimizer steps; returns the training loss before each step."""
        losses = []
        for _ in range(steps):
            x, y = next(self.batches)
            loss = lm_loss(self.model, x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            losses.append(loss.item())
        return losses


def train(
    model: nn.Module,
    corpus: TokenCorpus,
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 16,
    seq_len: int | None = None,
    seed: int = 0,
) -> list[float]:
    """Train ``model`` for ``steps`` AdamW steps from a fresh optimizer; returns the loss curve."""
    return Trainer(model, corpus, lr=lr, batch_size=batch_size, seq_len=seq_len, seed=seed).run(steps)
