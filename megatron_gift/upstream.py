"""What megatron-gift takes from Megatron-Core by name: every upstream function it re-implements,
wraps or replaces (:data:`UPSTREAM`) with the fingerprint of its source in each release the plugin
was checked against (:data:`KNOWN_GOOD`), and every Megatron attribute and private name it reads,
writes or rebinds (:data:`NAMES`).

``GiftBucketGroup.start_grad_sync`` and ``DeltaParamSync.start_param_sync`` re-implement Megatron's
methods, the checkpoint and training hooks wrap Megatron functions, and the CPU harness replaces
a few CUDA-only ones. A new Megatron-Core release can change any of them without an error, so
Megatron is accepted by the sources the plugin depends on, not by its version string:
:func:`check_upstream` fingerprints the installed functions at start-up and refuses, naming them,
those that differ from every known-good row (override: ``--gift-allow-untested-megatron`` or
``MEGATRON_GIFT_ALLOW_UNTESTED_MEGATRON=1``). ``tests/megatron/test_upstream_guard.py`` checks the installed
version's row and that every name in :data:`NAMES` is still defined where it was (:func:`defines`).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import inspect
import os
import sys
import textwrap

ALLOW_ENV = "MEGATRON_GIFT_ALLOW_UNTESTED_MEGATRON"

# "module:qualified name" -> where the plugin depends on it.
UPSTREAM = {
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync": (
        "re-implemented by megatron/bucket_group.py GiftBucketGroup.start_grad_sync"
    ),
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_grad_sync": (
        "waits on the handle GiftBucketGroup.start_grad_sync sets; extended by megatron/param_gather.py "
        "DeltaParamSync.finish_grad_sync"
    ),
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_param_sync": (
        "re-implemented (distributed-optimizer path) by megatron/param_gather.py DeltaParamSync.start_param_sync"
    ),
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_param_sync": (
        "waits on the handle DeltaParamSync.start_param_sync sets (which decodes)"
    ),
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.reset": (
        "extended by DeltaParamSync.reset (the first full parameter gather)"
    ),
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._copy_main_params_to_model_params": (
        "writes bf16(main) into each rank's own shard, the change the delta gather codes"
    ),
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.check_grads": (
        "called by megatron/bucket_group.py GiftBucketGroup._prepare_grads"
    ),
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.zero_grad_buffer": (
        "extended by GiftDistributedDataParallel.zero_grad_buffer (opens a step)"
    ),
    "megatron.training.models.dist_utils:_ddp_wrap": (
        "megatron/training.py rebinds the DistributedDataParallel it constructs"
    ),
    "megatron.training.training:get_model": "megatron/training.py rebinds the DDP it constructs",
    "megatron.training.training:training_log": "wrapped by megatron/training.py (logged loss to telemetry)",
    "megatron.training.checkpointing:generate_state_dict": "wrapped by megatron/checkpoint.py (GIFT ShardedObjects)",
    "megatron.training.checkpointing:_load_base_checkpoint": (
        "wrapped by megatron/checkpoint.py (gift_meta, GIFT state)"
    ),
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add": (
        "replaced on CPU by testing/cpu_harness.py _rng_add"
    ),
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork": (
        "replaced on CPU by testing/cpu_harness.py _rng_fork"
    ),
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict": (
        "wrapped on CPU by testing/cpu_harness.py"
    ),
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict": (
        "wrapped on CPU by testing/cpu_harness.py"
    ),
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._init_optimizer_states_with_dummy_values": (
        "called on CPU by testing/cpu_harness.py"
    ),
    "megatron.core.datasets.utils:compile_helpers": "replaced by megatron/training.py use_prebuilt_dataset_helpers",
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": (
        "replaced on CPU by testing/cpu_harness.py (activation recomputation)"
    ),
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": (
        "replaced on CPU by testing/cpu_harness.py (activation recomputation)"
    ),
    "megatron.core.tensor_parallel.random:CheckpointFunction.backward": (
        "run with the CPU redirections by testing/cpu_harness.py (recomputation)"
    ),
    "megatron.core.tensor_parallel.random:CheckpointWithoutOutput._recompute": (
        "run with the CPU redirections by testing/cpu_harness.py (recomputation)"
    ),
}

# sha256 (first 16 hex digits, :func:`fingerprint`) of each UPSTREAM entry's source in the megatron-core 0.19
# releases: 0.19.1 (Megatron-LM branch core_r0.19.0 at f8837c04) and 0.19.2 have the same source for every entry.
_CORE_R0_19 = {
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync": "62f8f12d579769ef",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_grad_sync": "caa9a2e7f33849c5",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_param_sync": "4f819373090bd530",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_param_sync": "2a5efb9825ec2c62",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.reset": "0d99908af6e95b40",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._copy_main_params_to_model_params": (
        "80e4f4d1fa99e747"
    ),
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.check_grads": "94e99add61f34256",
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.zero_grad_buffer": "6bbd2a84649f6c87",
    "megatron.training.models.dist_utils:_ddp_wrap": "13b438c376603bcb",
    "megatron.training.training:get_model": "b05b5cd0d24b9e5d",
    "megatron.training.training:training_log": "5e34a182d566e325",
    "megatron.training.checkpointing:generate_state_dict": "056da0775f13ba7e",
    "megatron.training.checkpointing:_load_base_checkpoint": "9a7e9e8de2428c67",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add": "e5e9ab39a7c1e085",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork": "6821e1e397253d43",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict": "fe621ae6a622b587",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict": "7e5f988b86b48501",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._init_optimizer_states_with_dummy_values": (
        "0338de756278b654"
    ),
    "megatron.core.datasets.utils:compile_helpers": "84029a50ae8cfac1",
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": "aa26caaa069c5c4f",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": "b179c9d95438b61c",
    "megatron.core.tensor_parallel.random:CheckpointFunction.backward": "43b157a2ebec22ef",
    "megatron.core.tensor_parallel.random:CheckpointWithoutOutput._recompute": "1bc8c9c07aba7453",
}

# megatron-core version -> the fingerprints its UPSTREAM sources had when the plugin was checked against it
# (tests/megatron/test_upstream_guard.py checks the installed version's row).
KNOWN_GOOD = {"0.19.1": _CORE_R0_19, "0.19.2": _CORE_R0_19}
TESTED_VERSIONS = tuple(KNOWN_GOOD)

_PG = "megatron.core.distributed.param_and_grad_buffer"

# "module:qualified name" of the Megatron class, function or module that defines them -> the names
# the plugin uses on its objects (attributes, instance attributes set in its source, dataclass
# fields, parameter tags it sets, module-level names the plugin looks up or rebinds), and where.
NAMES = {
    "megatron.core.distributed.data_parallel_base:_BaseDataParallel": (
        ("module",),
        "megatron/ddp.py: the wrapped model",
    ),
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel": (
        (
            "bucket_groups",
            "expert_parallel_bucket_groups",
            "dp_cp_group",
            "intra_dp_cp_group",
            "expt_dp_group",
            "intra_expt_dp_group",
            "tp_group",
            "zero_grad_buffer",
            "finish_grad_sync",
        ),
        "megatron/ddp.py (conversion, reduction and statistics groups), megatron/param_gather.py",
    ),
    f"{_PG}:_ParamAndGradBucketGroup": (
        (
            "buckets",
            "ddp_config",
            "is_first_batch",
            "grad_reduce_handle",
            "grad_reduce_finished",
            "param_gather_handle",
            "param_gather_dispatched",
            "data_parallel_group",
            "intra_distributed_optimizer_instance_group",
            "intra_distributed_optimizer_instance_size",
            "intra_distributed_optimizer_instance_rank",
            "inter_distributed_optimizer_instance_group",
            "check_grads",
            "_copy_back_extra_main_grads",
            "_post_param_sync",
            "start_grad_sync",
            "finish_grad_sync",
            "start_param_sync",
            "reset",
        ),
        "megatron/bucket_group.py GiftBucketGroup, megatron/param_gather.py DeltaParamSync (subclasses)",
    ),
    f"{_PG}:_ParamAndGradBucket": (
        (
            "params_list",
            "param_to_index",
            "param_data",
            "grad_data",
            "gradient_scaling_factor",
            "params_with_extra_main_grads",
        ),
        "megatron/ddp.py _convert, megatron/bucket_group.py, param_gather.py",
    ),
    f"{_PG}:_ParamAndGradBuffer": (
        ("main_grad", "main_grad_copy_in_grad_buffer"),
        "parameter tags read by GiftBucketGroup._prepare_grads",
    ),
    "megatron.core.distributed.distributed_data_parallel_config:DistributedDataParallelConfig": (
        (
            "use_distributed_optimizer",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "num_distributed_optimizer_instances",
            "average_in_collective",
            "check_for_nan_in_grad",
            "check_for_large_grads",
            "reduce_scatter_with_fp32_accumulation",
            "fp8_param_gather",
            "fp4_param_gather",
            "reuse_grad_buf_for_mxfp8_param_ag",
            "use_megatron_fsdp",
        ),
        "megatron/bucket_group.py, megatron/ddp.py refuse_unsupported, megatron/param_gather.py",
    ),
    "megatron.core.transformer.transformer_config:TransformerConfig": (
        ("enable_cuda_graph", "external_cuda_graph", "cuda_graph_impl"),
        "megatron/ddp.py refuse_unsupported",
    ),
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear": (
        ("allreduce", "sequence_parallel", "tp_group"),
        "megatron/ddp.py: expert tag of a weight, the statistics' tensor-parallel group",
    ),
    "megatron.core.tensor_parallel.layers:set_tensor_model_parallel_attributes": (
        ("tensor_model_parallel", "partition_dim"),
        "megatron/ddp.py: column-parallel weights",
    ),
    "megatron.core.parallel_state": (
        (
            "get_expert_tensor_parallel_group",
            "get_data_parallel_world_size",
            "get_data_parallel_rank",
            "get_tensor_model_parallel_world_size",
            "get_tensor_model_parallel_rank",
            "get_pipeline_model_parallel_world_size",
            "get_pipeline_model_parallel_rank",
            "get_expert_model_parallel_world_size",
            "get_expert_model_parallel_rank",
            "get_expert_tensor_parallel_world_size",
            "get_expert_tensor_parallel_rank",
            "get_expert_data_parallel_rank",
        ),
        "megatron/ddp.py (expert statistics group), megatron/checkpoint.py (shard keys)",
    ),
    "megatron.training.models.dist_utils": (("DistributedDataParallel",), "rebound by megatron/training.py"),
    "megatron.training.training": (("DDP", "training_log"), "rebound by megatron/training.py"),
    "megatron.training.checkpointing": (
        ("generate_state_dict", "_load_base_checkpoint"),
        "rebound by megatron/checkpoint.py",
    ),
    "megatron.training.global_vars": (
        ("get_tensorboard_writer", "get_wandb_writer"),
        "megatron/training.py telemetry_sink",
    ),
    "megatron.core.package_info": (("__shortversion__",), "check_upstream"),
    "megatron.training.arguments": (("get_device_arch_version",), "replaced on CPU by testing/cpu_harness.py"),
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker": (
        ("seeds_", "states_", "_is_initialized"),
        "set by testing/cpu_harness.py _rng_add",
    ),
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer": (
        (
            "optimizer",
            "buffers",
            "model_param_gbuf_map",
            "shard_fp32_from_float16_groups",
            "model_float16_groups",
            "_get_model_param_range_map",
        ),
        "testing/cpu_harness.py, testing/reference.py (the tests' stock gather)",
    ),
}


def defines(key: str, name: str) -> bool:
    """Whether the class, function or module ``key`` names still has ``name``: as an attribute or a
    dataclass field, or assigned in its source (``x.name = ...``, also in a tuple or annotated
    target, or ``setattr(x, "name", ...)``: instance attributes and the tags Megatron sets on parameters)."""
    obj = resolve(key)
    if hasattr(obj, name) or (dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}):
        return True
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(obj))))):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == name:
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1:
            if isinstance(node.args[1], ast.Constant) and node.args[1].value == name:
                return True
    return False


def installed_version() -> str:
    """megatron-core's version as installed (``megatron.core.package_info``)."""
    return importlib.import_module("megatron.core.package_info").__shortversion__


class UntestedMegatronError(RuntimeError):
    """Megatron-Core functions the plugin depends on differ from every release it was checked against (a start-up
    error)."""


def changed_upstream() -> list[str]:
    """``[]`` where the installed sources of the :data:`UPSTREAM` entries equal one known-good row
    (whatever the version string), else the entries (changed or gone) that differ from the row of
    the installed version, or from the row that differs least. Only entries of modules this process
    has imported count (the plugin patches or calls nothing in the others)."""
    installed = {k: _fingerprint_or_none(k) for k in UPSTREAM if k.partition(":")[0] in sys.modules}
    diffs = {v: [k for k, fp in installed.items() if row[k] != fp] for v, row in KNOWN_GOOD.items()}
    if any(not d for d in diffs.values()):
        return []
    version = installed_version()
    return diffs[version] if version in diffs else min(diffs.values(), key=len)


def _fingerprint_or_none(key: str) -> str | None:
    """:func:`fingerprint`, or None where the function is gone (renamed or removed upstream)."""
    try:
        return fingerprint(key)
    except AttributeError:
        return None


def check_upstream(allow_untested: bool = False) -> None:
    """Raise :class:`UntestedMegatronError` naming the functions of :func:`changed_upstream`, unless
    there are none (whatever the version string) or ``allow_untested`` / the environment variable
    :data:`ALLOW_ENV` says to go on anyway."""
    if allow_untested or os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        return
    changed = changed_upstream()
    if not changed:
        return
    listed = "; ".join(f"{k} ({UPSTREAM[k]})" for k in changed)
    raise UntestedMegatronError(
        f"megatron-gift re-implements, wraps or replaces Megatron-Core functions whose source in this megatron-core "
        f"{installed_version()} differs from megatron-core {', '.join(TESTED_VERSIONS)}: {listed}. Install one of "
        f"those versions, or compare these functions with the plugin's code (megatron_gift/upstream.py says where "
        f"each is used) and accept the risk with --gift-allow-untested-megatron (or {ALLOW_ENV}=1)"
    )


def resolve(key: str):
    """The object ``"module:qualified.name"`` names (the module itself for ``"module"``)."""
    module_name, _, qualname = key.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def fingerprint(key: str) -> str:
    """sha256 (16 hex digits) of the upstream source of ``key``, unwrapped from this plugin's patches."""
    return hashlib.sha256(inspect.getsource(inspect.unwrap(resolve(key))).encode()).hexdigest()[:16]
