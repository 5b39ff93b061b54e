"""A tiny Llama-style Megatron GPTModel and batches for multi-rank tests (local spec, no TE)."""

import torch

VOCAB, SEQ = 128, 32


def build_tiny_gpt(seed: int = 1234, vocab: int = VOCAB, seq: int = SEQ, **overrides):
    """RoPE, SwiGLU, RMSNorm, no bias; the same seed (and parallel layout) gives the same weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)  # weights are drawn inside the tracker's fork()
    kwargs = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return GPTModel(TransformerConfig(**kwargs), get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope")


def lm_loss(model, step: int, seed: int, batch: int = 2, vocab: int = VOCAB, seq: int = SEQ):
    """Mean LM loss on random tokens drawn from ``(step, seed)`` (e.g. seed = data-parallel rank)."""
    gen = torch.Generator().manual_seed(1000 * step + seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    positions = torch.arange(seq).expand(batch, seq)
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
