"""GIFT's statistics are of the input the weight multiplies, with Transformer Engine's layers too.

Megatron's default ``--transformer-impl transformer_engine`` builds ``linear_qkv`` / ``linear_fc1`` as
``TELayerNormColumnParallelLinear``, the norm inside the module: a forward pre-hook sees the input
before normalisation, and the plugin whitened those layers from the pre-norm statistics. Transformer
Engine does not install here, so a stand-in with its module path, class names, attributes and forward
(norm inside the linear), computed by Megatron's local-spec norm and linear modules, replaces each
norm + linear pair of a local-spec GPTModel; its statistics must equal the local model's, where the
norm and the linear are apart and the hook sees the normalised tensor.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gift.megatron import layer_inputs
from megatron_gift.testing import run_on_ranks

BATCH = 2
U = 2.0**-24  # FP32 unit roundoff


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


class LayerNormLinear(torch.nn.Module):
    """Stand-in for ``transformer_engine.pytorch.LayerNormLinear``: TE's attributes (``weight``,
    ``layer_norm_weight``, ``layer_norm_bias``, ``eps``, ``zero_centered_gamma``, ``normalization``,
    ``sequence_parallel``, ``tp_group``) and forward ``linear(norm(x))``, run by Megatron's local
    ``norm`` and ``linear`` modules (kept unregistered, so the parameters are this module's own).
    With ``zero_centered_gamma`` the stored ``layer_norm_weight`` is the norm's weight minus one,
    as in TE, while ``norm`` keeps the weight it multiplies by."""

    def __init__(self, norm, linear, zero_centered_gamma: bool = False):
        super().__init__()
        self.normalization = "RMSNorm" if isinstance(norm, torch.nn.RMSNorm) else "LayerNorm"
        self.eps, self.zero_centered_gamma = norm.eps, zero_centered_gamma
        self.sequence_parallel, self.tp_group = False, linear.tp_group
        self.in_features, self.out_features = linear.weight.shape[1], linear.weight.shape[0]
        self.weight = linear.weight
        self.layer_norm_weight = torch.nn.Parameter(norm.weight.detach() - 1.0) if zero_centered_gamma else norm.weight
        self.layer_norm_bias = getattr(norm, "bias", None)
        self._local = (norm, linear)

    def forward(self, x):
        norm, linear = self._local
        return linear(norm(x))


LayerNormLinear.__module__ = "transformer_engine.pytorch.module.layernorm_linear"


class TELayerNormColumnParallelLinear(LayerNormLinear):
    """Stand-in for Megatron's wrapper of it (``megatron.core.extensions.transformer_engine``)."""


TELayerNormColumnParallelLinear.__module__ = "megatron.core.extensions.transformer_engine"


def _build(normalization: str, seed: int = 7):
    """The tiny GPTModel with random norm weights (and biases): the same for the same arguments."""
    from megatron_gift.testing.gpt import build_tiny_gpt

    model = build_tiny_gpt(normalization=normalization)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.5 * torch.randn(p.shape, generator=gen))
    return model


def _fuse_norms(model, zero_centered_gamma: bool):
    """The Transformer Engine spec's layout: each layer's input norm inside ``linear_qkv`` and its
    pre-MLP norm inside ``linear_fc1``, the separate norms replaced by ``IdentityOp``."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in model.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        attn.linear_qkv = TELayerNormColumnParallelLinear(layer.input_layernorm, attn.linear_qkv, zero_centered_gamma)
        mlp.linear_fc1 = TELayerNormColumnParallelLinear(layer.pre_mlp_layernorm, mlp.linear_fc1, zero_centered_gamma)
        layer.input_layernorm, layer.pre_mlp_layernorm = IdentityOp(), IdentityOp()
    return model


def _statistics(model, tokens, raw=None) -> dict:
    """``{name: XᵀX}`` the plugin's hooks collected over one forward of ``tokens`` (exact: no sketch);
    ``raw`` (a dict) also gets the XᵀX of each fused layer's forward input (the pre-norm tensor)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.config import GiftConfig, Mode
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import lm_loss

    cfg = GiftConfig.build(mode=Mode.GIFT, rank=8, sketch=0, loopback=True)
    ddp = GiftDistributedDataParallel(model.config, DistributedDataParallelConfig(), model, gift_config=cfg)
    if raw is not None:
        for name, mod in model.named_modules():
            if isinstance(mod, LayerNormLinear):
                x2 = lambda a: a.detach().reshape(-1, a.shape[-1]).float()  # noqa: E731
                mod.register_forward_pre_hook(
                    lambda m, args, n=name: raw.__setitem__(n + ".weight", x2(args[0]).T @ x2(args[0]))
                )
    ddp.zero_grad_buffer()
    with torch.no_grad():
        lm_loss(ddp, tokens)
    return {
        gp.name: gp.input.stats.sums["xtx"].clone() for gp in ddp.gift_params.values() if gp.input.stats is not None
    }


def _case(normalization: str, zero_centered_gamma: bool) -> dict:
    from megatron_gift.testing.gpt import random_tokens

    tokens = random_tokens(0, 0, batch=BATCH)
    local = _statistics(_build(normalization), tokens)
    raw: dict = {}
    fused = _statistics(_fuse_norms(_build(normalization), zero_centered_gamma), tokens, raw)
    return dict(local=local, fused=fused, raw=raw)


def _refused() -> list[str]:
    """What the DDP says when built around a linear class the plugin does not know, and around a
    layer inside Transformer Engine's fused MLP, each selected for GIFT."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.config import GiftConfig, Mode
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt

    class FancyLinear(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    unknown, fused_mlp = build_tiny_gpt(), build_tiny_gpt()
    unknown.decoder.layers[0].mlp.linear_fc1 = FancyLinear(unknown.decoder.layers[0].mlp.linear_fc1.weight)
    mlp = fused_mlp.decoder.layers[1].mlp  # as Megatron's TEFusedMLP: its layers run fused, hooks get no input
    mlp.__class__ = type("TEFusedMLP", (type(mlp),), {"__module__": "megatron.core.extensions.transformer_engine"})
    out = []
    for model in (unknown, fused_mlp):
        try:
            GiftDistributedDataParallel(
                model.config,
                DistributedDataParallelConfig(),
                model,
                gift_config=GiftConfig.build(mode=Mode.GIFT, rank=8, loopback=True),
            )
            out.append("accepted")
        except layer_inputs.UnknownInput as e:
            out.append(str(e))
    return out


def _worker(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    out = {(n, z): _case(n, z) for n, z in (("RMSNorm", False), ("LayerNorm", False), ("RMSNorm", True))}
    out["refused"] = _refused()
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 1, cpu_harness=True, timeout=300)[0]


@pytest.mark.cpu_harness
@pytest.mark.parametrize(
    "normalization, zero_centered_gamma", [("RMSNorm", False), ("LayerNorm", False), ("RMSNorm", True)]
)
def test_fused_norm_layers_measure_the_normalised_input(results, normalization, zero_centered_gamma):
    """The hook on a TE fused norm+linear read the pre-norm input (and ignored ``zero_centered_gamma``).

    Bound: the reference's norm (torch's module) and the plugin's FP32 recomputation are the same
    FP32 operations up to the order of the reductions over h = 64 features (``γ_h`` relative each:
    the mean of squares; LayerNorm's mean and variance, its mean's error relative to
    ``|x - mean| ~ σ`` for these O(1)-centred inputs) and the products by ``rsqrt`` and the weight
    (``u`` each): between the two ``|Δx_i| ≤ (4γ_h + 4u) |x_i|`` with margin. Each XᵀX over n tokens
    rounds by ``γ_n Σ|x_i||x_j| ≤ γ_n sqrt(A_ii A_jj)``, so ``|ΔA_ij| ≤ (2γ_n + 2(4γ_h + 4u))
    sqrt(A_ii A_jj)``. The pre-norm statistics differ by O(1) (checked: the test can fail)."""
    case = results[normalization, zero_centered_gamma]
    local, fused, raw = case["local"], case["fused"], case["raw"]
    fused_names = set(raw)
    assert fused_names and fused_names <= set(fused), (sorted(raw), sorted(fused))
    assert set(fused) == set(local)
    n, h = BATCH * 32, 64
    tol = 2 * _gamma(n) + 2 * (4 * _gamma(h) + 4 * U)
    for name in sorted(fused_names):
        want, got = local[name].double(), fused[name].double()
        scale = torch.outer(want.diagonal(), want.diagonal()).sqrt()
        err = ((got - want).abs() / scale).max().item()
        assert err <= tol, f"{name}: {err:.3g} > {tol:.3g}"
        wrong = ((raw[name].double() - want).abs() / scale).max().item()
        assert wrong > 1e3 * tol, f"{name}: the pre-norm statistics would pass too ({wrong:.3g})"
    for name in set(local) - fused_names:  # the layers without a norm inside: the same input, the same bits
        assert torch.equal(local[name], fused[name]), name


@pytest.mark.cpu_harness
def test_layers_of_unknown_input_are_refused_at_start_up(results):
    """A linear layer whose weight's input the plugin cannot tell was whitened from its forward input
    (or, inside TE's fused MLP, from nothing)."""
    unknown, fused_mlp = results["refused"]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in unknown and "FancyLinear" in unknown, unknown
    assert "decoder.layers.1.mlp.linear_fc1.weight" in fused_mlp and "TEFusedMLP" in fused_mlp, fused_mlp
    assert all("--gift-layers" in m for m in (unknown, fused_mlp))


def test_recognition_of_transformer_engine_classes():
    """TE's Linear is the forward input, LayerNormLinear its own norm (LayerNorm / RMSNorm only);
    a layer inside TE's fused MLP, whose pre-hooks get no input, is listed as opaque."""

    class Linear(torch.nn.Module):
        pass

    Linear.__module__, Linear.__qualname__ = "transformer_engine.pytorch.module.linear", "Linear"
    x = torch.randn(3, 4)
    assert torch.equal(layer_inputs.weight_input(Linear(), "w")(x), x)
    standin = LayerNormLinear.__new__(LayerNormLinear)
    torch.nn.Module.__init__(standin)
    standin.normalization = "L2Norm"
    with pytest.raises(layer_inputs.UnknownInput, match="L2Norm"):
        layer_inputs.weight_input(standin, "w")
    assert layer_inputs.weight_input(torch.nn.Embedding(4, 4), "w") is None

    class TEFusedMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_fc1 = torch.nn.Linear(4, 4)

    TEFusedMLP.__module__, TEFusedMLP.__qualname__ = "megatron.core.extensions.transformer_engine", "TEFusedMLP"
    root = torch.nn.Sequential(TEFusedMLP(), torch.nn.Linear(4, 4))
    opaque = layer_inputs.opaque_modules(root)
    assert set(opaque) == {root[0].linear_fc1} and opaque[root[0].linear_fc1] == "TEFusedMLP"
