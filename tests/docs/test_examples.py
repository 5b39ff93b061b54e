"""examples/: the Llama-300M/600M recipes print the command they would run (DRY_RUN=1)."""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_gift.arguments import add_gift_args, gift_config_from_args, validate_gift_args

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

SIZES = {
    "300m": {
        "--num-layers": "24",
        "--hidden-size": "1024",
        "--num-attention-heads": "16",
        "--ffn-hidden-size": "2736",
        "--seq-length": "4096",
    },
    "600m": {
        "--num-layers": "32",
        "--hidden-size": "1280",
        "--num-attention-heads": "20",
        "--ffn-hidden-size": "3456",
        "--seq-length": "2048",
    },
}
COMMON_FLAGS = (
    "--position-embedding-type",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--bf16",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
)
# VARIANT -> (--gift-mode, whether Megatron's own --grad-reduce-in-bf16 is on)
VARIANTS = {
    "fp32": ("off", False),
    "bf16": ("off", True),
    "euclidean": ("euclidean", False),
    "gift": ("gift", False),
    "auto": ("gift", False),
}


def _dry_run(script: str, *args: str, **env) -> subprocess.CompletedProcess:
    unset = (
        "DATA_PATH",
        "MOCK_DATA",
        "GIFT_ARGS",
        "TP",
        "PP",
        "VARIANT",
        "MICRO_BATCH",
        "GLOBAL_BATCH",
        "TRANSFORMER_IMPL",
    )
    base = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        ["bash", str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        env={**base, "DRY_RUN": "1", **env},
        timeout=30,
    )


def _command(script: str, *args: str, **env) -> list[str]:
    res = _dry_run(script, *args, **env)
    assert res.returncode == 0, res.stderr
    return shlex.split(res.stdout)


def _value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, flag
    return cmd[cmd.index(flag) + 1]


def _gift_namespace(cmd: list[str]) -> argparse.Namespace:
    """The ``--gift-*`` flags of ``cmd`` parsed by a parser that has only the gift group."""
    after = cmd[cmd.index("megatron_gift.pretrain_gpt") + 1 :]
    parser = add_gift_args(argparse.ArgumentParser(allow_abbrev=False))
    ns, unknown = parser.parse_known_args(after)
    stray = [a for a in unknown if a.startswith("--gift")]
    assert not stray, f"--gift-* flags add_gift_args does not know: {stray}"
    return ns


@pytest.mark.parametrize("model", ["300m", "600m"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("how", ["wrapper", "MODEL"])
def test_recipe_prints_the_models_command(model, variant, how):
    if how == "wrapper":
        cmd = _command(f"llama_{model}.sh", VARIANT=variant)
    else:
        cmd = _command("pretrain_llama.sh", MODEL=model, VARIANT=variant)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "megatron_gift.pretrain_gpt" in cmd
    for flag, value in SIZES[model].items():
        assert _value(cmd, flag) == value, flag
    assert _value(cmd, "--max-position-embeddings") == SIZES[model]["--seq-length"]
    assert _value(cmd, "--normalization") == "RMSNorm" and _value(cmd, "--position-embedding-type") == "rope"
    assert _value(cmd, "--global-batch-size") == "512" and _value(cmd, "--micro-batch-size") == "4"
    assert _value(cmd, "--transformer-impl") == "local"  # explicit: Megatron's default is transformer_engine
    for flag in COMMON_FLAGS:
        assert flag in cmd, flag
    mode, bf16_reduction = VARIANTS[variant]
    assert _value(cmd, "--gift-mode") == mode
    assert ("--grad-reduce-in-bf16" in cmd) == bf16_reduction

    ns = _gift_namespace(cmd)
    validate_gift_args(ns)  # flag-level checks (no Megatron flags on this namespace: defaults apply)
    cfg = gift_config_from_args(ns)
    if mode == "off":  # the baselines are Megatron's own reductions
        assert cfg is None
    else:
        assert cfg.mode.value == mode
    assert (cfg is not None and cfg.policy is not None) == (variant == "auto")
    if variant == "gift":  # the paper's selection: GIFT only on the down projection
        assert any("linear_fc2" in p for p in cfg.layers) and not any("fc2" in p for p in cfg.euclidean_layers)


def test_default_variant_is_euclidean():
    assert _value(_command("llama_300m.sh"), "--gift-mode") == "euclidean"


def test_recipe_environment_and_extra_flags():
    cmd = _command(
        "llama_600m.sh",
        "--dry-run",
        "--train-iters",
        "7",
        DRY_RUN="0",
        NNODES="8",
        GPUS_PER_NODE="8",
        TP="2",
        PP="1",
        DATA_PATH="/d/owt_text_document",
        GIFT_ARGS="--gift-rank 16 --gift-log-interval 100",
        VARIANT="gift",
    )
    assert _value(cmd, "--nnodes") == "8" and _value(cmd, "--nproc-per-node") == "8"
    assert _value(cmd, "--tensor-model-parallel-size") == "2" and "--sequence-parallel" in cmd
    assert _value(cmd, "--data-path") == "/d/owt_text_document"
    assert cmd[-2:] == ["--train-iters", "7"]  # extra flags come last (argparse: last one wins)
    ns = _gift_namespace(cmd)
    assert ns.gift_rank == 16 and ns.gift_log_interval == 100


def test_recipe_at_scale_and_its_planner_command():
    """32 nodes x 8 GPUs (DP 256): the default micro-batch falls to 2 (512 = 2 x 256) instead of refusing the
    run; MICRO_BATCH, GLOBAL_BATCH, TP, PP and appended flags set what the batch check uses; the planner command
    printed on stderr runs and describes the same batch."""
    res = _dry_run("pretrain_llama.sh", NNODES="32", GPUS_PER_NODE="8", MODEL="600m")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout)
    assert _value(cmd, "--micro-batch-size") == "2" and _value(cmd, "--nnodes") == "32"
    plan = res.stderr.split("megatron-gift model ", 1)[1].split()
    assert plan[plan.index("--micro-batch") + 1] == "2" and plan[plan.index("--gpus") + 1] == "256"
    assert plan[plan.index("--cluster") + 1] == "h100"  # dropped, the planner priced 8-GPU nodes as gh200's
    from megatron_gift_tools.cli import main

    assert main(["model", *plan]) == 0
    custom = _command(
        "pretrain_llama.sh",
        NNODES="32",
        GPUS_PER_NODE="8",
        MICRO_BATCH="1",
        GLOBAL_BATCH="1024",
        TP="2",
        TRANSFORMER_IMPL="transformer_engine",
    )
    assert [
        _value(custom, f) for f in ("--micro-batch-size", "--global-batch-size", "--tensor-model-parallel-size")
    ] == ["1", "1024", "2"] and _value(custom, "--transformer-impl") == "transformer_engine"
    # an appended --micro-batch-size wins over MICRO_BATCH=4, which alone would not fit DP 256
    res = _dry_run("pretrain_llama.sh", "--micro-batch-size", "1", NNODES="32", GPUS_PER_NODE="8", MICRO_BATCH="4")
    assert res.returncode == 0 and "--micro-batch 1" in res.stderr, res.stderr
    res = _dry_run("pretrain_llama.sh", NNODES="2", GPUS_PER_NODE="4", MODEL="600m")
    assert res.returncode == 0 and "--cluster gh200 --gpus-per-node 4" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MODEL": "1b"}, "MODEL must be"),
        ({"VARIANT": "fp4"}, "VARIANT must be"),
        ({"NNODES": "6"}, "not a multiple"),  # 48 GPUs: 512 is not a multiple of 4, 2 or 1 x 48
        ({"NNODES": "32", "MICRO_BATCH": "4"}, "not a multiple"),  # 4 x 256 > 512
        ({"GPUS_PER_NODE": "8", "TP": "3"}, "not divisible"),
        ({"DRY_RUN": "0", "PYTHON": "false"}, "DATA_PATH"),  # a real run needs data
    ],
)
def test_recipe_refuses_bad_settings(env, message):
    res = _dry_run("pretrain_llama.sh", **env)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_scripts_are_bash_n_clean():
    for script in [*EXAMPLES.glob("*.sh"), *(ROOT / "patches").glob("*.sh")]:
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, f"{script}: {res.stderr}"


def test_recipe_megatron_flags_exist():
    """Every non-gift flag of the recipe is one Megatron-Core 0.19's argument parser defines."""
    from megatron_gift.megatron.training import shim_typing_override

    shim_typing_override()  # megatron.training imports typing.override (Python 3.12)
    pytest.importorskip("megatron.training.arguments")
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    known = set(parser._option_string_actions)
    for model, variant in itertools.product(SIZES, VARIANTS):
        cmd = _command("pretrain_llama.sh", MODEL=model, VARIANT=variant, TP="2", SAVE_DIR="/ckpt")
        after = cmd[cmd.index("megatron_gift.pretrain_gpt") + 1 :]
        flags = {a for a in after if a.startswith("--") and not a.startswith("--gift-")}
        assert flags and not flags - known, sorted(flags - known)
