"""The two-sided benchmark (``bench.llama``'s captured statistics, ``bench.two_sided.measure_layer``; moved
from tests/unit/test_two_sided.py)."""

import pytest
import torch


def test_captured_statistics_rebuild_the_weight_gradient():
    """``capture_output_grads`` (the benchmark's source of ``B``) records per token the gradient of
    each layer's output, aligned with ``capture_inputs``' rows: ``Σ_t g_t a_tᵀ`` equals the weight
    gradient autograd gives. Bugs caught: a hook on the wrong tensor (the input's gradient, a
    reshaped or transposed output), rows misaligned or dropped. Bound: both sides
    are FP32 sums of ``tokens`` products, each within ``tokens·2^-24·Σ_t |g_t||a_t|`` elementwise."""
    from megatron_gift_tools.bench.llama import (
        LlamaConfig,
        LlamaModel,
        capture_inputs,
        capture_output_grads,
        linear_layers,
        lm_loss,
    )

    model = LlamaModel(LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=2, ffn_hidden=48, seq_len=16), seed=0)
    layers = linear_layers(model)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (6, 16), generator=gen), torch.randint(0, 64, (6, 16), generator=gen)
    with capture_inputs(model, layers) as acts, capture_output_grads(model, layers) as grads:
        weight_grads = torch.autograd.grad(lm_loss(model, x, y), [m.weight for m in layers.values()])
    for (name, m), want in zip(layers.items(), weight_grads):
        a, g = acts[name], grads[name]
        assert a.shape == (96, m.in_features) and g.shape == (96, m.out_features)
        bound = 96 * 2.0**-24 * (g.abs().T @ a.abs())
        assert ((g.T @ a - want).abs() <= 2 * bound).all(), name


def _kfac_stack(b: torch.Tensor, a: torch.Tensor, ranks: int, tokens: int, seed: int) -> torch.Tensor:
    """Per-rank gradients ``G_r = Σ_t g_t a_tᵀ`` with ``g ~ N(0, B)``, ``a ~ N(0, A)`` (FP64 draws, FP32 result)."""
    gen = torch.Generator().manual_seed(seed)
    lb, la = torch.linalg.cholesky(b), torch.linalg.cholesky(a)
    draw = lambda chol: torch.randn(tokens, chol.shape[0], generator=gen, dtype=torch.float64) @ chol.T
    return torch.stack([(draw(lb).T @ draw(la)).float() for _ in range(ranks)])


def _spiked(d: int, top: int, share: float, seed: int) -> torch.Tensor:
    """SPD with ``share`` of its trace in ``top`` equal eigenvalues, the rest flat."""
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    evals = torch.cat([torch.full((top,), share / top), torch.full((d - top,), (1 - share) / (d - top))])
    return (basis * evals) @ basis.T


@pytest.mark.parametrize("output_spiked", [True, False])
def test_benchmark_sees_output_side_anisotropy(output_spiked):
    """``bench.two_sided.measure_layer`` on gradients drawn from the K-FAC model ``Cov = B ⊗ A``
    with 90% of ``tr A`` in 8 directions: where ``B`` is spiked the same way the best two-sided
    variant beats the best input-side one clearly (the geometry model gives about 0.5 per spiked
    side, so about 0.5x; asserted ≤ 0.75x); where ``B = I`` no output map can gain (asserted ≥ 0.95x:
    an output side that seems to help isotropic rows means the benchmark compares unlike things).
    Each auto scheme's record is one of the variants its policy may choose, or Euclidean. Bugs
    caught: the output factor applied on the input axis or from the wrong statistics, an auto
    scheme choosing outside its policy (e.g. ``gift-input`` picking a two-sided variant)."""
    from megatron_gift.numerics.whitening import factors_by_rank
    from megatron_gift_tools.bench.two_sided import EUCLIDEAN, TwoSidedConfig, measure_layer

    a = _spiked(256, 8, 0.9, 0)
    b = _spiked(128, 8, 0.9, 1) if output_spiked else torch.eye(128, dtype=torch.float64)
    stack = _kfac_stack(b, a, ranks=4, tokens=256, seed=2)
    cfg = TwoSidedConfig(rank=8, out_ranks=(8,))
    recs = measure_layer(stack, factors_by_rank(a.float(), [8]), factors_by_rank(b.float(), [8]), cfg)
    best = {
        side: min(r["ratio"] for r in recs if r["scheme"] == "fixed" and r["side"] == side)
        for side in ("input", "output", "both")
    }
    if output_spiked:
        assert best["both"] <= 0.75 * best["input"] and best["output"] < 0.9
    else:
        assert best["both"] >= 0.95 * best["input"] and best["output"] >= 0.95
    allowed = {"gift-input": {"input"}, "gift-both-o8": {"both"}, "gift-auto-o8": {"input", "both"}}
    fixed = [r for r in recs if r["scheme"] == "fixed"]
    for r in recs:
        if r["scheme"] in allowed:
            assert r["side"] == EUCLIDEAN or (
                r["side"] in allowed[r["scheme"]]
                and any(f["rel_l2"] == r["rel_l2"] and f["side"] == r["side"] for f in fixed)
            )
