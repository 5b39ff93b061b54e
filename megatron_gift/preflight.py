"""Start-up checks of what Megatron would only find after the model is built (issue 37 item 2).

Each raises ``ValueError`` with one line naming the flag; :func:`megatron_gift.arguments.checked_gift_config`
calls :func:`check` after Megatron's ``validate_args`` (so derived sizes such as ``ffn_hidden_size`` and
``kv_channels`` are set), before any model exists, and :func:`~megatron_gift.arguments.startup_errors`
prints it once from rank 0. A namespace without Megatron's flags (a unit test's) is left alone.
"""

from __future__ import annotations

import importlib.util
import re

from .config import GiftConfig, Mode

# a dense GPT layer's linear weights (Megatron's names) and their input size on one tensor-parallel rank
_DENSE_INPUTS = {
    "decoder.layers.0.self_attention.linear_qkv.weight": lambda a, tp: a.hidden_size,
    "decoder.layers.0.self_attention.linear_proj.weight": lambda a, tp: a.kv_channels * a.num_attention_heads // tp,
    "decoder.layers.0.mlp.linear_fc1.weight": lambda a, tp: a.hidden_size,
    "decoder.layers.0.mlp.linear_fc2.weight": lambda a, tp: a.ffn_hidden_size // tp,
}


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check(args, cfg: GiftConfig | None) -> None:
    """The run's data, packages and ``--gift-rank`` against the flags, before the model build."""
    if not hasattr(args, "micro_batch_size"):  # not Megatron's namespace
        return
    _check_data(args)
    _check_packages(args)
    if cfg is not None and cfg.mode is Mode.GIFT:
        _check_rank(args, cfg)


def _check_data(args) -> None:
    """Megatron asserts on every rank after the model build when no data is given."""
    sources = ("data_path", "train_data_path", "data_args_path", "per_split_data_args_path", "mock_data")
    if getattr(args, "skip_train", False) or any(getattr(args, name, None) for name in sources):
        return
    raise ValueError(
        "no training data: give --data-path (a Megatron indexed dataset prefix; or --train-data-path, "
        "--data-args-path) or --mock-data for synthetic tokens"
    )


def _check_packages(args) -> None:
    """Packages Megatron imports only when it first needs them: Transformer Engine's layers, psutil's
    memory query at the first checkpoint save (found after training has run)."""
    te = getattr(args, "transformer_impl", None) == "transformer_engine" and not getattr(args, "spec", None)
    if te and not _importable("transformer_engine"):  # a --spec of its own may need no TE
        raise ValueError(
            "--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, which does "
            "not import here: install it or pass --transformer-impl local"
        )
    if (getattr(args, "save", None) or getattr(args, "load", None)) and not _importable("psutil"):
        raise ValueError(
            "Megatron's checkpointing (--save/--load) needs psutil, which is not installed: pip install psutil, "
            "or drop --save and --load"
        )


def _check_rank(args, cfg: GiftConfig) -> None:
    """``--gift-rank`` against the input size of each dense linear layer ``--gift-layers`` selects (the
    same check runs on the real shapes when the model is wrapped; MoE experts are left to it)."""
    tp, rank = getattr(args, "tensor_model_parallel_size", 1) or 1, cfg.whitening.rank
    narrow = []
    for name, d_in in _DENSE_INPUTS.items():
        if ".mlp." in name and getattr(args, "num_experts", None):  # MoE: experts' shapes, checked at wrap time
            continue
        try:
            size = d_in(args, tp)
        except (AttributeError, TypeError):  # a size Megatron did not derive: the wrap-time check has it
            continue
        if any(re.search(p, name) for p in cfg.layers) and size < rank:  # --gift-layers wins (param_modes)
            narrow.append((name.removeprefix("decoder.layers.0."), size))
    if narrow:
        listed = ", ".join(f"{n} (input size {d})" for n, d in narrow)
        raise ValueError(
            f"--gift-rank {rank} exceeds the input size of GIFT layer(s) {listed} on each tensor-parallel rank: "
            f"lower --gift-rank to at most {min(d for _, d in narrow)} or leave those layers out of --gift-layers"
        )
