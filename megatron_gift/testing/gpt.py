"""A tiny Llama-style Megatron GPTModel, batches, and an FP32 hand-made gradient average,
for multi-rank tests and CPU benchmarks (local spec, no Transformer Engine)."""

import torch
import torch.distributed as dist

VOCAB, SEQ = 128, 32


def build_tiny_gpt(seed: int = 1234, vocab: int = VOCAB, seq: int = SEQ, **overrides):
    """RoPE, SwiGLU, RMSNorm, no bias; the same seed (and parallel layout) gives the same weights.
    ``pre_process`` / ``post_process`` (and ``vp_stage``) select a pipeline stage; other overrides go to the config."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)  # weights are drawn inside the tracker's fork()
    kwargs = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )
    stage = {k: overrides.pop(k) for k in ("pre_process", "post_process", "vp_stage") if k in overrides}
    kwargs.update(overrides)
    spec = get_gpt_layer_local_spec(num_experts=kwargs.get("num_moe_experts"), normalization="RMSNorm")
    return GPTModel(
        TransformerConfig(**kwargs),
        spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        position_embedding_type="rope",
        **stage,
    )


def random_tokens(step: int, seed: int, batch: int = 2, vocab: int = VOCAB, seq: int = SEQ) -> torch.Tensor:
    """``[batch, seq + 1]`` random tokens drawn from ``(step, seed)`` (e.g. seed = data-parallel rank)."""
    gen = torch.Generator().manual_seed(1000 * step + seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen)


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``tokens [batch, seq + 1]``."""
    batch, seq = tokens.shape[0], tokens.shape[1] - 1
    positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()


def hand_average(ref, model, tokens: torch.Tensor, group=None) -> dict:
    """FP32 reference for a data-parallel reduction: copy ``model``'s weights into ``ref``,
    backprop this rank's ``tokens`` locally, all-gather and average over ``group`` in FP64.
    Returns ``{param of model: averaged gradient (flat, float64)}``."""
    with torch.no_grad():
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            p_ref.copy_(p)
    ref.zero_grad()
    lm_loss(ref, tokens).backward()
    local = torch.cat([p.grad.flatten() for p in ref.parameters()])
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    avg = torch.stack(gathered).double().sum(0) / world
    return dict(zip(model.parameters(), avg.split([p.numel() for p in ref.parameters()])))


def reduced_regions(ddp, expected: dict, dp_rank: int, dp_size: int, dist_opt: bool):
    """Per bucket of ``ddp``: ``(reduced, want)``, the region this rank holds after the reduction
    (its shard with the distributed optimizer, else the whole bucket) and the same region of
    ``expected`` (``hand_average``'s output), both FP64."""
    for bg in ddp.bucket_groups:
        for bucket in bg.buckets:
            n = bucket.grad_data.numel()
            region = slice(dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size) if dist_opt else slice(None)
            want = torch.zeros(n, dtype=torch.float64)
            for p, (a, b) in bucket.param_to_index.items():
                want[a:b] = expected[p]
            yield bucket.grad_data[region].double(), want[region]
