"""Faults: a rank killed mid-run, and checkpoints whose GIFT state does not fit.

* Through the launcher (2 gloo ranks, checkpoints every 2 iterations; tests/launches.py's runs,
  shared with test_launcher and test_checkpoint): rank 1 is killed with SIGKILL during iteration
  3; the restarted run resumes from the iteration-2 checkpoint and its iteration-4 and iteration-6
  checkpoints (parameters, optimizer, GIFT statistics, transforms, each rank's error-feedback
  residual) are bit-identical to those of a run never interrupted.
* In one process: GIFT state of another format version, of other shapes (another model width,
  another --gift-sketch), truncated or garbled is refused with a message naming why, and the
  GIFT state starts fresh (never half-applied); a fitting state is applied, entry for entry.
"""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch

from megatron_gift.testing import run_on_ranks
from tests.launches import KILL_IN, losses

from .test_checkpoint import _bitwise_equal, _contents

pytestmark = pytest.mark.cpu_harness


@pytest.mark.slow
def test_killed_rank_resumes_bitwise_from_the_last_checkpoint(launcher_runs):
    tmp, logs = launcher_runs["tmp"], launcher_runs["logs"]
    assert launcher_runs["killed_rc"] != 0 and launcher_runs["killed_latest"] == "2"
    assert max(losses(logs["killed"])) == KILL_IN  # killed once iteration 3 was logged
    assert "GIFT state restored (step 1)" in logs["resumed"]
    assert sorted(losses(logs["resumed"])) == [3, 4, 5, 6]
    for iteration in (4, 6):
        whole = _contents(tmp / "whole" / f"iter_{iteration:07d}", tmp)
        resumed = _contents(tmp / "killed" / f"iter_{iteration:07d}", tmp)
        assert whole.keys() == resumed.keys() and any(k.startswith("gift.chunk0.residuals") for k in whole)
        # as in test_checkpoint: the run arguments and the CPU generator (the data loader's seed draw) differ
        differ = [
            k
            for k in whole
            if not k.startswith(("common_state", "rng_state")) and not _bitwise_equal(whole[k], resumed[k])
        ]
        assert differ == [], iteration
    # The first resumed iteration logs the uninterrupted run's loss (the second, a Megatron logging
    # matter, the mean of the run's first two: test_checkpoint).
    assert losses(logs["resumed"])[KILL_IN] == losses(logs["whole"])[KILL_IN]


def _misfit_worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_gift.config import GiftConfig, Mode, Side
    from megatron_gift.megatron import checkpoint
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.testing.gpt import build_tiny_gpt, lm_loss, random_tokens

    parallel_state.initialize_model_parallel(1, 1)

    def trained(hidden=64, sketch=0, steps=1, side=Side.INPUT, ffn=None):
        model = build_tiny_gpt(hidden_size=hidden, ffn_hidden_size=ffn or 2 * hidden)
        gift = GiftConfig.build(
            mode=Mode.GIFT, rank=8, sketch=sketch, refresh_interval=1, error_feedback=True, loopback=True, side=side
        )  # one rank: GIFT state exists only with loopback
        ddp = GiftDistributedDataParallel(model.config, DistributedDataParallelConfig(), model, gift_config=gift)
        for step in range(steps):
            ddp.zero_grad_buffer()
            lm_loss(ddp, random_tokens(step, rank)).backward()
            ddp.finish_grad_sync()
        return ddp

    def fresh(ddp):
        return all(
            g.input.whitening is None
            and (g.output is None or g.output.whitening is None)
            and all(
                st is None or (st.folds == 0 and float(st.ema_tokens) == 0)
                for st in (g.input.stats, g.output and g.output.stats)
            )
            for g in ddp.gift_params.values()
        )

    source = trained()
    saved = checkpoint.split_state(source, source.gift_state_dict())
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    truncated = {k: v for k, v in saved.items() if k != "dense"} | {"dense": {"step": saved["dense"]["step"]}}
    cut = {**saved, "dense": {**saved["dense"], "params": {**saved["dense"]["params"]}}}
    entry = dict(cut["dense"]["params"][qkv])
    w = entry["sides"]["input"]["whitening"]
    entry["sides"] = {
        **entry["sides"],
        "input": {**entry["sides"]["input"], "whitening": {k: v[: v.shape[0] // 2] for k, v in w.items()}},
    }
    cut["dense"]["params"][qkv] = entry
    both = trained(steps=3, side=Side.BOTH)
    saved_both = checkpoint.split_state(both, both.gift_state_dict())
    cases = {
        "fits": (trained(steps=0), saved),
        "fits_two_sided": (trained(steps=0, side=Side.BOTH), saved_both),
        "other_output_rows": (trained(steps=0, side=Side.BOTH, ffn=64), saved_both),
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
    # what the fitting restore holds, against what was saved, entry by entry
    for name in ("fits", "fits_two_sided"):
        out[name]["restored"] = checkpoint.split_state(cases[name][0], cases[name][0].gift_state_dict())
        out[name]["saved"] = cases[name][1]
    hooks = checkpoint._Hooks([])
    hooks.meta = {**checkpoint.layout(), "version": checkpoint.VERSION + 1}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        out["other_version"] = dict(parts=hooks.parts_to_load(), log=log.getvalue())
        hooks.meta["version"] = 1  # before SideState: read, and upgraded (checkpoint.merge_state)
        out["version_1"] = dict(parts=hooks.parts_to_load())
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def misfits():
    return run_on_ranks(_misfit_worker, 1, cpu_harness=True, timeout=600)[0]


def _leaves(tree, path=()):
    """``(path, value)`` of every leaf of a nested dict."""
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k], (*path, k))
    else:
        yield path, tree


@pytest.mark.parametrize("case", ["fits", "fits_two_sided"])
def test_fitting_gift_state_is_applied(misfits, case):
    """Every saved entry (step, modes, statistics, transforms, damping choices, residuals; the output
    side's with ``--gift-side both``) is what the restored DDP holds, bit for bit. Bug caught: a part
    reported applied but left fresh or mixed."""
    res = misfits[case]
    assert res["applied"] and not res["fresh"] and res["step"] == (0 if case == "fits" else 2)
    saved, restored = dict(_leaves(res["saved"])), dict(_leaves(res["restored"]))
    assert saved.keys() == restored.keys() and any(isinstance(v, torch.Tensor) for v in saved.values())
    for path, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(restored[path], value), path
        else:
            assert restored[path] == value, path


def test_output_statistics_are_saved_per_rank(misfits):
    """``B``'s local EMA is this rank's own, like ``A``'s: it belongs in the per-rank part, not in the
    replicated dense part (bug caught: every rank resumed with one rank's ``B``, the refresh's sum
    over ranks then p times that rank's instead of the global one)."""
    saved = misfits["fits_two_sided"]["saved"]
    assert any("stats" in entry.get("output", {}) for entry in saved["local"].values() if isinstance(entry, dict))
    dense = saved["dense"]["params"].values()
    assert not any("stats" in side for entry in dense for side in entry.get("sides", {}).values())


PROJ = "decoder.layers.0.self_attention.linear_proj.weight"


@pytest.mark.parametrize(
    "case, message",
    [
        ("other_width", f"{PROJ}: saved statistics xtx of shape (64, 64), this run's is (72, 72) (another layer width"),
        ("other_sketch", f"{PROJ}: saved statistics ['xtx'], this run keeps ['diag', 'y'] (another --gift-sketch)"),
        ("truncated", "part 'dense' lacks ['params'] (truncated)"),
        (
            "cut_tensor",
            "decoder.layers.0.self_attention.linear_qkv.weight: saved transform for input size 32, the layer has 64",
        ),
        ("garbled", "part 'dense' is bytes, not a GIFT state (garbled)"),
        (
            "other_output_rows",
            "decoder.layers.0.mlp.linear_fc1.weight: saved statistics xtx of shape (256, 256), this run's "
            "is (128, 128)",
        ),
    ],
)
def test_misfit_gift_state_starts_fresh_with_a_message(misfits, case, message):
    """Each corruption is named for what it is (bug caught: a raw KeyError / size mismatch, or a
    state half applied before the failure)."""
    res = misfits[case]
    assert res["fresh"] and not res["applied"], res  # nothing half-applied
    assert res["log"].count("does not fit this run") == 1 and message in res["log"], res["log"]


def test_other_format_version_is_not_loaded(misfits):
    """A format this megatron-gift does not read starts fresh with a message; format 1 (before
    ``SideState``) is read in full (bug caught: old checkpoints silently dropped after the upgrade)."""
    assert misfits["version_1"]["parts"] == ("dense", "expert", "local", "residuals")
    res = misfits["other_version"]
    assert res["parts"] == () and "format version 3" in res["log"] and "starting it fresh" in res["log"]
