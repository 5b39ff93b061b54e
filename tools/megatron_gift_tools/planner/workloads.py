"""Workloads: a Llama-style model, its batch and its TP/PP layout, and the presets.

The presets and each layer's linear shapes are ``megatron_gift.testing.shapes``' (the runtime's tests use
them too): the paper's Llama-300M/600M, a Llama-shaped 1.35B, Llama-2-7B and Llama-3-8B.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from megatron_gift.testing.shapes import PRESETS, layer_shapes

LINEAR_KINDS = ("qkv", "proj", "fc1", "fc2")
ROW_PARALLEL = ("proj", "fc2")  # TP shards their inputs (columns); qkv and fc1 shard their outputs (rows)
GIFT_KINDS = ("fc2",)  # the paper's and the recipes' selection: the MLP down projections
DIMS = ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab")
OPTIONAL_DIMS = ("kv_heads",)  # grouped-query attention; absent: one key-value head per query head


@dataclass(frozen=True)
class Workload:
    """A Llama-style model (SwiGLU, RMSNorm, no biases; ``kv_heads`` key-value heads, 0: one per query
    head), its batch and its TP/PP layout; ``untied``: separate output layer."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    micro_batch: int
    global_batch: int
    vocab: int
    untied: bool = True
    tp: int = 1
    pp: int = 1
    kv_heads: int = 0

    def __post_init__(self):
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        for k in (
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "ffn",
            "seq",
            "micro_batch",
            "global_batch",
            "vocab",
            "tp",
            "pp",
        ):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        for k in ("heads", "kv_heads", "ffn", "vocab"):
            if getattr(self, k) % self.tp:
                raise ValueError(f"tensor parallelism {self.tp} must divide {k} ({getattr(self, k)})")
        if self.heads % self.kv_heads or self.hidden % self.heads:
            raise ValueError(
                f"kv_heads ({self.kv_heads}) must divide heads ({self.heads}), heads the hidden size ({self.hidden})"
            )
        if self.layers % self.pp:
            raise ValueError(f"pipeline parallelism {self.pp} must divide layers ({self.layers})")

    def parameters(self) -> list[tuple[str, tuple[int, int], float]]:
        """``(name, (rows, cols), fwd+bwd FLOPs per token)`` of one rank (its TP shard of the first pipeline
        stage), in Megatron's ``model.parameters()`` order."""
        h, tp = self.hidden, self.tp
        out = [("embedding", (self.vocab // tp, h), 0.0)]
        shapes = layer_shapes(asdict(self))
        for i in range(self.layers // self.pp):
            out.append((f"layers.{i}.input_layernorm", (1, h), 0.0))
            for layer, (rows, cols) in shapes.items():
                rows, cols = (rows, cols // tp) if layer in ROW_PARALLEL else (rows // tp, cols)
                out.append((f"layers.{i}.{layer}", (rows, cols), 6.0 * rows * cols))
                if layer == "proj":  # attention scores and values (fwd+bwd), then the MLP's norm
                    out.append((f"layers.{i}.core_attention", (0, 0), 12.0 * self.seq * h / tp))
                    out.append((f"layers.{i}.pre_mlp_layernorm", (1, h), 0.0))
        if self.pp == 1:
            out.append(("final_layernorm", (1, h), 0.0))
            if self.untied:
                out.append(("output_layer", (self.vocab // tp, h), 6.0 * (self.vocab // tp) * h))
            else:  # the tied output layer costs its FLOPs on the embedding's gradient
                out[0] = ("embedding", (self.vocab // tp, h), 6.0 * (self.vocab // tp) * h)
        return out

    def numel(self) -> int:
        """Parameters of one rank (its TP shard of the first pipeline stage)."""
        return sum(r * c for _, (r, c), _ in self.parameters())

    def total_parameters(self) -> int:
        """Parameters of the whole model (every TP shard and pipeline stage)."""
        return replace(self, tp=1, pp=1).numel()


def is_kind(name: str, kinds: tuple[str, ...]) -> bool:
    """Whether parameter ``name`` is one of the linear-layer ``kinds``."""
    return any(name.endswith("." + k) for k in kinds)


def workload(model: str, micro_batch: int = 1, global_batch: int = 512, tp: int = 1, pp: int = 1, **dims) -> Workload:
    """A preset (``PRESETS``; ``llama-`` prefix allowed) with ``dims`` (``DIMS``) overriding its dimensions;
    ``model="custom"`` takes every dimension from ``dims`` (``kv_heads`` optional)."""
    name = model.removeprefix("llama-")
    if name != "custom" and name not in PRESETS:
        raise ValueError(f"unknown model {model!r}: one of {', '.join(PRESETS)} or custom with every dimension")
    base = dict(PRESETS.get(name, {}))
    base.update({k: v for k, v in dims.items() if v is not None})
    missing = set(DIMS) - set(OPTIONAL_DIMS) - set(base)
    if missing:
        raise ValueError(f"model {model!r} needs {', '.join(sorted(missing))}")
    return Workload(name=name, micro_batch=micro_batch, global_batch=global_batch, tp=tp, pp=pp, **base)
