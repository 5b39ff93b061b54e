"""What each linear layer's weight multiplies: the input GIFT's statistics must be of.

A forward pre-hook sees a module's forward input. For most linear layers that is what the weight
multiplies; Transformer Engine's ``LayerNormLinear`` (Megatron's ``TELayerNormColumnParallelLinear``,
``linear_qkv`` and ``linear_fc1`` of the default ``--transformer-impl transformer_engine`` spec)
normalises its input inside the module first, so the hook's tensor is the pre-norm one.

Recognised, by a class in the module's MRO (by module path and name: Transformer Engine need not be
importable to read them):

* ``torch.nn.Linear``, Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` and Transformer
  Engine's ``Linear`` (Megatron's ``TELinear``, ``TEColumnParallelLinear``, ``TERowParallelLinear``):
  the forward input itself.
* Transformer Engine's ``LayerNormLinear``: the module's own norm applied again, in FP32, from its
  ``layer_norm_weight`` (plus one with ``zero_centered_gamma``), ``layer_norm_bias``, ``eps`` and
  ``normalization`` (``LayerNorm`` or ``RMSNorm``, the two Transformer Engine has). Megatron builds
  it with ``return_layernorm_output=False``, so the normalised tensor is not otherwise available.

Refused (:class:`UnknownInput`) rather than whitened from the wrong statistics: any other module
whose class name ends in ``Linear``, a ``LayerNormLinear`` with another normalisation, and a layer
inside Transformer Engine's fused MLP (Megatron's ``TEFusedMLP``, ``--use-transformer-engine-op-fuser``), which
runs its sub-layers' pre-hooks without their inputs.
"""

from __future__ import annotations

import functools

import torch

_PLAIN = {
    ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear"),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear"),
    ("transformer_engine.pytorch.module.linear", "Linear"),
}
_NORM_LINEAR = ("transformer_engine.pytorch.module.layernorm_linear", "LayerNormLinear")
_OPAQUE_PARENTS = {("megatron.core.extensions.transformer_engine", "TEFusedMLP")}


class UnknownInput(ValueError):
    """A linear layer whose weight's input the plugin cannot determine (a start-up error)."""


def _classes(module) -> set[tuple[str, str]]:
    return {(c.__module__, c.__qualname__) for c in type(module).__mro__}


def _looks_linear(module) -> bool:
    return any(c.__name__.endswith("Linear") for c in type(module).__mro__)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, b, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x², -1) + eps) * w`` (``x [..., h]``, ``w [h]``; no bias)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last dimension (``torch.nn.functional.layer_norm``)."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


_NORMS = {"RMSNorm": _rms_norm, "LayerNorm": _layer_norm}


def _normalised(module, norm, x: torch.Tensor) -> torch.Tensor:
    """The input of ``module``'s GEMM: its own norm of ``x``, in FP32, from its current parameters."""
    w = module.layer_norm_weight.float() + (1.0 if module.zero_centered_gamma else 0.0)
    bias = getattr(module, "layer_norm_bias", None)
    return norm(x.float(), w, None if bias is None else bias.float(), module.eps)


def weight_input(module, name: str):
    """``f(forward input) -> the tensor module.weight multiplies`` for a recognised linear layer
    (see the module doc), ``None`` for a module that is not a linear layer (its weight is not
    whitened); :class:`UnknownInput` naming the parameter ``name`` for a linear layer not recognised."""
    classes = _classes(module)
    if isinstance(module, torch.nn.Linear) or classes & _PLAIN:
        return lambda x: x
    if _NORM_LINEAR in classes:
        norm = _NORMS.get(getattr(module, "normalization", None))
        if norm is None:
            raise UnknownInput(
                f"megatron-gift: {name} belongs to a Transformer Engine LayerNormLinear with normalization "
                f"{getattr(module, 'normalization', None)!r} (only LayerNorm and RMSNorm are recomputed): "
                f"{_REMEDY}"
            )
        return functools.partial(_normalised, module, norm)
    if _looks_linear(module):
        raise UnknownInput(
            f"megatron-gift: {name} belongs to {type(module).__module__}.{type(module).__qualname__}, a linear layer "
            f"whose weight's input it cannot determine (recognised: torch.nn.Linear, Megatron's ColumnParallelLinear "
            f"and RowParallelLinear, Transformer Engine's Linear and LayerNormLinear): {_REMEDY}"
        )
    return None


def opaque_modules(root) -> dict[torch.nn.Module, str]:
    """Modules under ``root`` whose forward pre-hooks do not see their inputs -> the class of the
    parent that runs them so (Transformer Engine's fused MLP)."""
    out = {}
    for parent in root.modules():
        if _classes(parent) & _OPAQUE_PARENTS:
            for sub in parent.modules():
                if sub is not parent:
                    out[sub] = type(parent).__qualname__
    return out


def refuse_opaque(name: str, parent: str) -> UnknownInput:
    return UnknownInput(
        f"megatron-gift: {name} is inside {parent}, which runs its layers fused without handing their inputs "
        f"to forward hooks (drop --use-transformer-engine-op-fuser): {_REMEDY}"
    )


_REMEDY = "leave it out of --gift-layers (--gift-euclidean-layers sends it as plain FP8), or use --gift-mode euclidean"
