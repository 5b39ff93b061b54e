"""GIFT state in Megatron's distributed checkpoints, through the real launcher (2 gloo ranks).

One uninterrupted run saves at iterations 3 and 6; a second run resumes from the iteration-3
checkpoint and saves at 6: both iteration-6 checkpoints (parameters, optimizer state, GIFT
statistics, transforms and every rank's error-feedback residual) must be bit-identical. The GIFT
runs gather parameters as coded changes (``--gift-param-gather delta``, overlapped with the
forward), so their weights are the reconstructed ones, which a resume must continue from. Then
the iteration-3 checkpoint is loaded with one rank (another data-parallel size), and a
checkpoint written with ``--gift-mode off`` is loaded by a GIFT run: both train and say in the
log what they did.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_gift.bench.corpus import build_token_corpus
from megatron_gift.bench.indexed_data import megatron_data_args
from megatron_gift.testing.launch import run_launcher


FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--split", "98,2,0",
    "--save-interval", "3",
]  # fmt: skip
GIFT = [
    "--gift-mode", "gift", "--gift-rank", "8", "--gift-sketch", "16",
    "--gift-refresh-interval", "2", "--gift-error-feedback",
    "--gift-param-gather", "delta", "--overlap-param-gather",  # the weights are the reconstructed ones
]  # fmt: skip
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([-+0-9.eE]+)")


def _launch(tmp: Path, ranks: int, *args: str) -> str:
    data = megatron_data_args(build_token_corpus(vocab_size=2048))
    return run_launcher(ranks, *FLAGS, *data, "--data-cache-path", str(tmp / "index-cache"), *args)


def _checkpoint_at(src: Path, iteration: int, dst: Path) -> Path:
    """A checkpoint directory holding only ``src``'s iteration ``iteration``."""
    name = f"iter_{iteration:07d}"
    dst.mkdir(parents=True)
    shutil.copytree(src / name, dst / name)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def _contents(ckpt: Path, tmp: Path) -> dict:
    """Every entry of a torch_dist checkpoint directory, ShardedObjects unpickled."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    entries = torch.load(out, weights_only=False)
    # torch_dist stores each ShardedObject as a one-element list
    return {k: v[0] if k.startswith("gift.") else v for k, v in entries.items()}


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoint")
    logs = {"whole": _launch(tmp, 2, *GIFT, "--save", str(tmp / "whole"))}
    resumed = _checkpoint_at(tmp / "whole", 3, tmp / "resumed")
    logs["resumed"] = _launch(tmp, 2, *GIFT, "--load", str(resumed), "--save", str(resumed))
    logs["one_rank"] = _launch(tmp, 1, *GIFT, "--load", str(_checkpoint_at(tmp / "whole", 3, tmp / "one-rank")))
    logs["off"] = _launch(tmp, 2, "--gift-mode", "off", "--save", str(tmp / "off"))
    logs["from_off"] = _launch(tmp, 2, *GIFT, "--load", str(_checkpoint_at(tmp / "off", 3, tmp / "from-off")))
    return tmp, logs


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_resumed_run_is_bitwise_identical_to_the_uninterrupted_one(runs):
    tmp, logs = runs
    assert "megatron-gift: GIFT state restored (step 2)" in logs["resumed"]
    whole = _contents(tmp / "whole" / "iter_0000006", tmp)
    resumed = _contents(tmp / "resumed" / "iter_0000006", tmp)
    gift = sorted(k for k in whole if k.startswith("gift."))
    # dense state (replicated over the 2 data-parallel ranks: one copy), both ranks' local
    # statistics (per-step EMAs, summed only at refreshes) and both ranks' residuals
    assert [k.split("/")[0] for k in gift] == ["gift.chunk0.dense", *["gift.chunk0.local"] * 2, *["gift.chunk0.residuals"] * 2]
    state = whole[gift[0]]
    assert state["step"] == 5 and len(state["params"]) == 8
    assert "decoder.layers.0.mlp.linear_fc2.weight" in state["params"]  # names without wrapper prefixes
    assert all(p["mode"] == "gift" and "whitening" in p and "damping" in p for p in state["params"].values())
    local = [whole[k] for k in gift[1:3]]
    assert all(len(s) == 8 and all(e["folds"] == 6 for e in s.values()) for s in local)
    assert not _bitwise_equal(local[0], local[1])  # each rank keeps its own EMA
    residuals = [whole[k] for k in gift[3:]]
    assert all(len(r) == 8 for r in residuals) and any(bool(t.abs().sum() > 0) for r in residuals for t in r.values())
    assert not _bitwise_equal(residuals[0], residuals[1])  # each rank keeps its own
    assert whole.keys() == resumed.keys()
    # Bit for bit, except: common_state (the run's arguments: --load differs) and the CPU torch
    # generator in rng_state, which differs the same way with Megatron's own DDP (the data
    # loader draws its seed from it after the checkpoint is loaded).
    differ = [k for k in whole if not k.startswith(("common_state", "rng_state")) and not _bitwise_equal(whole[k], resumed[k])]
    assert differ == []
    rng = [k for k in whole if k.startswith("rng_state")]
    strip = lambda states: [[{k: v for k, v in s.items() if k != "torch_rng_state"} for s in per_rank] for per_rank in states]  # noqa: E731
    assert rng and all(_bitwise_equal(strip(whole[k]), strip(resumed[k])) for k in rng)
    last = lambda log: {int(i): v for i, v in LOSS_RE.findall(log)}[6]  # noqa: E731
    assert last(logs["resumed"]) == last(logs["whole"])


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_another_data_parallel_size_restores_all_but_the_residuals(runs):
    _, logs = runs
    log = logs["one_rank"]
    assert "written by 2 ranks (data-parallel 2), this run has 1 (data-parallel 1)" in log
    assert "K-FAC statistics and error-feedback residuals (per rank) start afresh" in log
    assert "GIFT state restored (step 2)" in log
    assert sorted(int(i) for i, _ in LOSS_RE.findall(log)) == [4, 5, 6]


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_a_checkpoint_without_gift_state_starts_gift_fresh(runs):
    _, logs = runs
    assert "megatron-gift: the checkpoint has no GIFT state" in logs["from_off"]
    assert "GIFT state restored" not in logs["from_off"]
    assert sorted(int(i) for i, _ in LOSS_RE.findall(logs["from_off"])) == [4, 5, 6]
    assert "gradient reduction sent" not in logs["off"]
