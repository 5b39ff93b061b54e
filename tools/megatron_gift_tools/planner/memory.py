"""Whether a rank's training state fits its GPU: BF16 weights, FP32 gradients and Adam's FP32 state per
parameter of the rank (its TP shard of the first pipeline stage), with and without the distributed optimizer
(Megatron's own accounting, docs/user-guide "distributed optimizer": 18 B per parameter, or 6 + 12/DP).
Activations are not counted: the warning says "may not fit" from half the GPU's memory on."""

from __future__ import annotations

WEIGHT_BYTES = 2.0
"""BF16 weights (``--bf16``)."""
GRAD_BYTES = 4.0
"""Megatron's FP32 main-gradient buffer (``--bf16`` accumulates and reduces in FP32 unless
``--grad-reduce-in-bf16``)."""
OPTIMIZER_BYTES = 12.0
"""Adam's FP32 main weights, first and second moments; sharded over the data-parallel ranks by the distributed
optimizer."""
ACTIVATION_SHARE = 0.5
"""above this share of the GPU's memory in weights, gradients and optimizer state, the rest may not hold the
activations: the planner warns."""


def state_bytes(params: int, dp: int, distributed: bool) -> float:
    """One rank's weights, gradients and optimizer state for ``params`` parameters of its own."""
    return params * (WEIGHT_BYTES + GRAD_BYTES + OPTIMIZER_BYTES / (dp if distributed else 1))


def fit(params: int, dp: int, gpu_memory: float) -> dict:
    """The JSON's ``memory``: one rank's parameters and state bytes with and without the distributed optimizer."""
    return dict(
        parameters_per_gpu=params,
        state_bytes_distributed=state_bytes(params, dp, True),
        state_bytes_replicated=state_bytes(params, dp, False),
        gpu_memory=gpu_memory,
    )


def warning(m: dict, distributed: bool) -> str | None:
    """A line where the state of the run's optimizer (``distributed``: the distributed one) may not fit; None
    where it leaves more than half of the GPU's memory."""
    mine = m["state_bytes_distributed" if distributed else "state_bytes_replicated"]
    if mine <= ACTIVATION_SHARE * m["gpu_memory"]:
        return None
    gb = 1e9
    how = "with the distributed optimizer" if distributed else "without the distributed optimizer"
    other = "" if distributed else f" (with --use-distributed-optimizer: {m['state_bytes_distributed'] / gb:.1f} GB)"
    verdict = "does not fit" if mine > m["gpu_memory"] else "may not fit once activations are added"
    return (
        f"warning: {verdict}: {m['parameters_per_gpu'] / 1e9:.2f}B parameters per GPU need "
        f"{mine / gb:.1f} GB for weights, gradients and optimizer state {how}{other}, of the GPU's "
        f"{m['gpu_memory'] / gb:.0f} GB; consider --tp or --pp (activations not counted)"
    )
