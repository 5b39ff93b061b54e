"""Faults: a rank killed mid-run, and checkpoints whose GIFT state does not fit.

* Through the launcher (2 gloo ranks, checkpoints every 2 iterations): rank 1 is killed with
  SIGKILL during iteration 3; the restarted run resumes from the iteration-2 checkpoint and its
  iteration-4 checkpoint (parameters, optimizer, GIFT statistics, transforms, each rank's
  error-feedback residual) is bit-identical to that of a run never interrupted.
* In one process: GIFT state of another format version, of other shapes (another model width,
  another --gift-sketch), truncated or garbled is refused with a message naming why, and the
  GIFT state starts fresh (never half-applied); a fitting state is applied.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import subprocess

import psutil
import pytest
import torch

from megatron_gift.bench.corpus import build_token_corpus
from megatron_gift.bench.indexed_data import megatron_data_args
from megatron_gift.testing import run_on_ranks
from megatron_gift.testing.launch import ENV, ROOT, launcher_command
from megatron_gift.testing.spawn import wall_limit

from .test_checkpoint import FLAGS, GIFT, LOSS_RE, _bitwise_equal, _contents, _launch

SHORT = ["--train-iters", "4", "--save-interval", "2"]  # later flags win over FLAGS'
KILL_AT = re.compile(r"iteration\s+3/")


def _run_and_kill(tmp, save) -> str:
    """The launcher until it logs iteration 3, then SIGKILL to one rank; its output."""
    data = megatron_data_args(build_token_corpus(vocab_size=2048))
    cmd = launcher_command(2, *FLAGS, *data, "--data-cache-path", str(tmp / "index-cache"), *SHORT, *GIFT, "--save", str(save))
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, killed = [], None
    try:
        for line in proc.stdout:
            out.append(line)
            if killed is None and KILL_AT.search(line):
                ranks = [c for c in psutil.Process(proc.pid).children(recursive=True) if "megatron_gift.pretrain_gpt" in " ".join(c.cmdline())]
                killed = max(ranks, key=lambda c: c.pid)
                os.kill(killed.pid, signal.SIGKILL)
        proc.wait(timeout=wall_limit(900.0))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "".join(out[-50:])
    assert proc.returncode != 0
    return "".join(out)


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the --gift-cpu launcher refuses to run where CUDA is available")
    tmp = tmp_path_factory.mktemp("faults")
    logs = {"whole": _launch(tmp, 2, *SHORT, *GIFT, "--save", str(tmp / "whole"))}
    logs["killed"] = _run_and_kill(tmp, tmp / "killed")
    latest = (tmp / "killed" / "latest_checkpointed_iteration.txt").read_text().strip()
    logs["resumed"] = _launch(tmp, 2, *SHORT, *GIFT, "--load", str(tmp / "killed"), "--save", str(tmp / "killed"))
    return tmp, logs, latest


@pytest.mark.slow
def test_killed_rank_resumes_bitwise_from_the_last_checkpoint(killed_and_resumed):
    tmp, logs, latest = killed_and_resumed
    assert latest == "2"
    assert "GIFT state restored (step 1)" in logs["resumed"]
    assert sorted(int(i) for i, _ in LOSS_RE.findall(logs["resumed"])) == [3, 4]
    whole = _contents(tmp / "whole" / "iter_0000004", tmp)
    resumed = _contents(tmp / "killed" / "iter_0000004", tmp)
    assert whole.keys() == resumed.keys() and any(k.startswith("gift.chunk0.residuals") for k in whole)
    # as in test_checkpoint: the run arguments and the CPU generator (the data loader's seed draw) differ
    differ = [k for k in whole if not k.startswith(("common_state", "rng_state")) and not _bitwise_equal(whole[k], resumed[k])]
    assert differ == []
    # The first resumed iteration logs the uninterrupted run's loss. (The last one's logged loss
    # differs after any resume, with --gift-mode off too: 7.563098 vs 7.550075 in this set-up,
    # while the iteration-4 checkpoints are bitwise equal; a Megatron logging matter.)
    loss = lambda log: {int(i): v for i, v in LOSS_RE.findall(log)}[3]  # noqa: E731
    assert loss(logs["resumed"]) == loss(logs["whole"])


def _misfit_worker(rank, world):
    from megatron.core import parallel_state

    from megatron_gift.config import GiftConfig, Mode
    from megatron_gift.megatron import checkpoint
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

    parallel_state.initialize_model_parallel(1, 1)

    def trained(hidden=64, sketch=0, steps=1):
        model = build_tiny_gpt(hidden_size=hidden, ffn_hidden_size=2 * hidden)
        gift = GiftConfig(mode=Mode.GIFT, rank=8, sketch=sketch, refresh_interval=1, error_feedback=True,
                          loopback=True)  # one rank: GIFT state exists only with loopback  # fmt: skip
        ddp = GiftDistributedDataParallel(model.config, DistributedDataParallelConfig(), model, gift_config=gift)
        for step in range(steps):
            ddp.zero_grad_buffer()
            lm_loss(ddp, random_tokens(step, rank)).backward()
            ddp.finish_grad_sync()
        return ddp

    def fresh(ddp):
        return all(g.whitening is None and (g.stats is None or (g.stats.folds == 0 and float(g.stats.ema_tokens) == 0))
                   for g in ddp.gift_params.values())  # fmt: skip

    source = trained()
    saved = checkpoint.split_state(source, source.gift_state_dict())
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    truncated = {k: v for k, v in saved.items() if k != "dense"} | {"dense": {"step": saved["dense"]["step"]}}
    cut = {**saved, "dense": {**saved["dense"], "params": {**saved["dense"]["params"]}}}
    entry = dict(cut["dense"]["params"][qkv])
    entry["whitening"] = {k: v[: v.shape[0] // 2] for k, v in entry["whitening"].items()}
    cut["dense"]["params"][qkv] = entry
    cases = {
        "fits": (trained(steps=0), saved),
        "other_width": (trained(hidden=72, steps=0), saved),
        "other_sketch": (trained(sketch=16, steps=0), saved),
        "truncated": (trained(steps=0), truncated),
        "cut_tensor": (trained(steps=0), cut),
        "garbled": (trained(steps=0), {**saved, "dense": b"\x00not a state"}),
    }
    out = {}
    for name, (ddp, loaded) in cases.items():
        log = io.StringIO()
        handler = logging.StreamHandler(log)  # per-parameter messages go to the logger, the rest is printed
        logging.getLogger("megatron_gift").addHandler(handler)
        with contextlib.redirect_stdout(log):
            applied = checkpoint.restore(ddp, loaded)
        logging.getLogger("megatron_gift").removeHandler(handler)
        out[name] = dict(applied=applied, fresh=fresh(ddp), log=log.getvalue(), step=ddp.step)
    hooks = checkpoint._Hooks([])
    hooks.meta = {**checkpoint.layout(), "version": checkpoint.VERSION + 1}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        out["other_version"] = dict(parts=hooks.parts_to_load(), log=log.getvalue())
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def misfits():
    return run_on_ranks(_misfit_worker, 1, cpu_harness=True, timeout=600)[0]


def test_fitting_gift_state_is_applied(misfits):
    assert misfits["fits"]["applied"] and not misfits["fits"]["fresh"] and misfits["fits"]["step"] == 0


@pytest.mark.parametrize("case", ["other_width", "other_sketch", "truncated", "cut_tensor", "garbled"])
def test_misfit_gift_state_starts_fresh_with_a_message(misfits, case):
    res = misfits[case]
    assert res["fresh"], res  # nothing half-applied
    assert "starting them fresh" in res["log"] or "does not fit this run" in res["log"], res["log"]


def test_other_format_version_is_not_loaded(misfits):
    res = misfits["other_version"]
    assert res["parts"] == () and "format version 2" in res["log"] and "starting it fresh" in res["log"]
