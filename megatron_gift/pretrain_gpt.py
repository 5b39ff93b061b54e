"""Pretrain a GPT model with Megatron's training loop and GIFT's data-parallel gradient reduction.

``torchrun --nproc-per-node N -m megatron_gift.pretrain_gpt <Megatron flags> --gift-mode gift ...``

Does what Megatron-LM's ``pretrain_gpt.py`` (core_r0.19.0) does for plain pretraining, with
only Megatron-Core's wheel installed (no Megatron-LM checkout): flags parsed by Megatron's
``parse_and_validate_args`` (plus the ``--gift-*`` group), the model described by
``gpt_config_from_args`` and built by Megatron's ``GPTModelBuilder`` (GPTModel with the local or
Transformer Engine layer spec per ``--transformer-impl``, or ``--spec``), ``GPTDataset`` /
``MockGPTDataset`` built by ``BlendedMegatronDatasetBuilder`` from ``--data-path`` (or
``--mock-data``), the masked token-sum language-model loss, and ``megatron.training.pretrain``.
The one difference: inside :func:`megatron_gift.megatron.training.gift_ddp` the model chunks are
wrapped in :class:`GiftDistributedDataParallel` instead of Megatron's DDP (nothing changes with
``--gift-mode off``). Rank 0 prints which wrapper was used
(``megatron-gift: model wrapped in ...``).

Not covered (use Megatron-LM's script with :func:`~megatron_gift.megatron.training.gift_ddp`
around its ``pretrain`` call): ``--sft``, ``--fim-data``, ``--dataloader-inter-document-masking``
(packed sequences), ModelOpt, cached-logits distillation (``--logits-load-dir``),
``--inprocess-restart``.

Tokenizer: ``GPTDataset`` only needs the end-of-document id, so a pre-tokenized dataset needs no
tokenizer files: ``--tokenizer-type NullTokenizer --vocab-size V --null-tokenizer-eod-id E``
(``python -m megatron_gift_tools.bench.indexed_data`` writes the benchmark corpus and prints these flags).
Any other ``--tokenizer-type`` Megatron supports works as in Megatron-LM (``HuggingFaceTokenizer``
needs ``transformers``).

CPU (demos and tests only, gloo): ``--gift-cpu`` (or ``MEGATRON_GIFT_CPU=1``) redirects Megatron's
CUDA-only calls (:func:`megatron_gift.megatron.cpu_harness.install_for_training`) and puts the flags in
:data:`megatron_gift.megatron.cpu_harness.TRAINING_FLAGS` in front of the command line. It refuses to
run when CUDA is available.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

CPU_ENV = "MEGATRON_GIFT_CPU"

UNSUPPORTED = (
    ("sft", "--sft"),
    ("fim_data", "--fim-data"),
    ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
    ("logits_load_dir", "--logits-load-dir"),
    ("inprocess_restart", "--inprocess-restart"),
)


def refuse_unsupported_flags(args) -> None:
    """``ValueError`` naming the first flag of :data:`UNSUPPORTED` that ``args`` sets."""
    for attr, flag in UNSUPPORTED:
        if getattr(args, attr, None):
            raise ValueError(
                f"megatron_gift.pretrain_gpt does not support {flag}: use Megatron-LM's pretrain_gpt.py patched "
                "with patches/apply.sh (its module docstring lists what this launcher leaves out)"
            )


def _cpu_requested(argv: list[str]) -> bool:
    return "--gift-cpu" in argv or os.environ.get(CPU_ENV, "") not in ("", "0")


def add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--gift-cpu``: this launcher's own flag (acted on before Megatron parses anything)."""
    parser.add_argument(
        "--gift-cpu",
        action="store_true",
        help=f"megatron_gift.pretrain_gpt only: train on CPU over gloo (tests and demos; also {CPU_ENV}=1). "
        "Refused when CUDA is available.",
    )
    return parser


# --------------------------------------------------------------------------- batches and loss


def get_batch(data_iterator, vp_stage=None):
    """``(tokens, labels, loss_mask, attention_mask, position_ids)`` of this rank's micro-batch.

    TP rank 0 reads the batch and broadcasts it over the tensor-parallel group; with context
    parallelism each rank keeps its part of the sequence. Middle pipeline stages get ``None``s."""
    from megatron.core import mpu
    from megatron.core.parallel_state import get_context_parallel_group
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = core_transformer_config_from_args(args)
    mtp_here = mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {k: (v.cuda(non_blocking=True) if v is not None else None) for k, v in batch.items()}
        batch.setdefault("attention_mask", None)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=get_context_parallel_group())
    return tuple(batch.get(k) for k in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"))


def loss_func(loss_mask, output_tensor):
    """Masked sum of per-token losses, the token count, and the ``lm loss`` report (Megatron's contract)."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if args.check_for_nan_in_loss_and_grad:
        rsm = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One micro-batch forward: the per-token losses and the loss function that reduces them."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage")
    )
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, functools.partial(loss_func, loss_mask)


# --------------------------------------------------------------------------- datasets


def _dataset_built_on_rank(vp_stage=None):
    from megatron.core import mpu
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    config = core_transformer_config_from_args(get_args())
    return is_first_or_last_pipeline_stage(vp_stage) or mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )


def gpt_dataset_config(args):
    """Megatron's ``GPTDatasetConfig`` from the parsed flags (blend, split, masks, cache path)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Train/validation/test ``GPTDataset`` (``MockGPTDataset`` with ``--mock-data``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset,
        train_val_test_num_samples,
        functools.partial(_dataset_built_on_rank, vp_stage=vp_stage),
        gpt_dataset_config(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its own (core datasets)


def get_embedding_ranks(pp_ranks):
    """First pipeline stage, plus the last with tied embeddings, plus multi-token-prediction stages."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        args = get_args()
        if not args.untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, core_transformer_config_from_args(args)))
    return sorted(ranks)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Parse Megatron's flags plus ``--gift-*``, build the model config, and run ``pretrain``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .megatron import training as gift_training

    if _cpu_requested(argv):
        from .megatron import cpu_harness

        cpu_harness.install_for_training()
        argv = [*cpu_harness.TRAINING_FLAGS, *argv]
        if "--gift-cpu" not in argv:
            argv.append("--gift-cpu")
    else:
        gift_training.shim_typing_override()
    gift_training.use_prebuilt_dataset_helpers()

    from megatron.core.enums import ModelType
    from megatron.training import pretrain, print_rank_0
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from .arguments import (
        add_gift_args,
        chain_args_providers,
        checked_gift_config,
        gift_flags_checked_first,
        startup_errors,
        telemetry_dir,
        validate_gift_args,
    )

    saved_argv = sys.argv
    sys.argv = [saved_argv[0], *argv]  # Megatron's parse_args reads sys.argv
    try:
        with gift_flags_checked_first():  # a refused --gift-* value: before Megatron's argument dump
            args = parse_and_validate_args(
                extra_args_provider=chain_args_providers(add_gift_args, add_launcher_args),
                args_defaults={"tokenizer_type": "GPT2BPETokenizer"},  # as Megatron-LM's pretrain_gpt.py
            )
    finally:
        sys.argv = saved_argv
    with startup_errors():  # one message from rank 0, exit status 2, no traceback
        refuse_unsupported_flags(args)
    gift_config = checked_gift_config(args)  # flag-level checks now; parameter-level ones when the model is wrapped

    model_cfg = gpt_config_from_args(args)

    def report_wrappers(model_chunks):
        print_rank_0(f"megatron-gift: model wrapped in {gift_training.describe_wrappers(model_chunks)}")
        return model_chunks

    model_cfg.post_wrap_hooks.append(report_wrappers)
    cfg = pretrain_cfg_container_from_args(args, model_cfg)

    # The whole model is on every rank only without pipeline parallelism: only then can each
    # --gift-layers pattern be required to match one of its parameters.
    whole_model = args.pipeline_model_parallel_size == 1 and args.virtual_pipeline_model_parallel_size is None
    validate = functools.partial(validate_gift_args, args) if whole_model else None
    with gift_training.gift_ddp(gift_config, validate=validate, telemetry_dir=telemetry_dir(args)):
        pretrain(
            cfg,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            get_embedding_ranks=get_embedding_ranks,
        )
    _destroy_process_groups()


def _destroy_process_groups() -> None:
    """The process groups torn down once training returned, not left to the interpreter's exit: a CPU run
    whose training had finished was once aborted there ("terminate called without an active exception",
    exit -6, rank 3 of 4; not reproduced since)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
