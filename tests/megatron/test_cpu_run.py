"""The CPU route for a Megatron training script (``python -m megatron_gift.megatron.cpu_run SCRIPT``,
issue 37 item 3) and the patched script's refusal of the launcher's ``--gift-cpu`` pointing at it.

Megatron-LM's checkout is not here: stand-in scripts do what the patched ``pretrain_gpt.py`` does at
the points that matter (its first call, its imports, Megatron's ``pretrain``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_gift.megatron import cpu_harness
from megatron_gift.testing import launch
from megatron_gift.testing.limits import wall_limit


def _run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **launch.ENV}
    return subprocess.run(
        [sys.executable, *argv], cwd=launch.ROOT, env=env, capture_output=True, text=True, timeout=wall_limit(timeout)
    )


@pytest.mark.cpu_harness
def test_the_script_runs_under_the_harness_with_its_flags(tmp_path):
    """Bugs caught: the script run before the harness is installed (Megatron's CUDA calls), without the
    harness's flags in front of its own (a user's flag must win: it comes later), with the launcher's
    ``--gift-cpu`` it cannot parse, without ``typing.override`` on 3.11, or unable to import its
    neighbours (Megatron-LM's script imports ``model_provider`` from its own folder)."""
    cpu_harness.check_host()
    (tmp_path / "neighbour.py").write_text("VALUE = 'neighbour'\n")
    script = tmp_path / "pretrain_stand_in.py"
    script.write_text(
        "import sys, typing, torch\n"
        "import megatron.training  # needs typing.override\n"
        "from neighbour import VALUE\n"
        "print('ARGV', sys.argv[1:])\n"
        "print('DEVICE', torch.cuda.current_device(), VALUE, hasattr(typing, 'override'), __name__)\n"
    )
    res = _run("-m", "megatron_gift.megatron.cpu_run", str(script), "--lr", "1e-3", "--gift-cpu")
    assert res.returncode == 0, res.stderr[-3000:]
    argv = next(line for line in res.stdout.splitlines() if line.startswith("ARGV "))
    assert argv == f"ARGV {[*cpu_harness.TRAINING_FLAGS, '--lr', '1e-3']}"
    assert "DEVICE cpu neighbour True __main__" in res.stdout


def test_a_missing_script_is_one_line():
    """A mistyped script path: one line with the usage, exit status 2 (not runpy's traceback)."""
    res = _run("-m", "megatron_gift.megatron.cpu_run", "/nonexistent/pretrain_gpt.py", "--lr", "1")
    assert res.returncode == 2 and "usage: python -m megatron_gift.megatron.cpu_run SCRIPT" in res.stderr
    assert "Traceback" not in res.stderr


def test_the_patched_script_refuses_gift_cpu_naming_the_route(tmp_path):
    """The patched script's first call (``print_help_if_asked``) given the launcher's ``--gift-cpu``:
    it was argparse's "unrecognized arguments" after Megatron's parse; now one line naming
    ``megatron_gift.megatron.cpu_run`` and the script, exit status 2."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(
        "from megatron_gift.arguments import add_gift_args, print_help_if_asked\nprint_help_if_asked(add_gift_args)\n"
    )
    res = _run(str(script), "--gift-mode", "gift", "--gift-cpu")
    lines = [line for line in res.stderr.splitlines() if "megatron-gift" in line]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "-m megatron_gift.megatron.cpu_run" in lines[0] and str(script) in lines[0]


@pytest.mark.slow
@pytest.mark.cpu_harness
def test_a_megatron_training_script_trains_through_it(tmp_path):
    """End to end: torchrun -m megatron_gift.megatron.cpu_run on a script that runs Megatron's
    ``pretrain`` (the launcher's main, as Megatron-LM's script would be run) trains GIFT for 2
    iterations on one gloo rank: the route installs all the CPU training needs."""
    cpu_harness.check_host()
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("from megatron_gift.pretrain_gpt import main\nmain()\n")
    flags = (
        "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 1 --global-batch-size 1 --train-iters 2 --lr 1e-3 --log-interval 1 --eval-iters 0 "
        "--eval-interval 1000 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--gift-mode gift --gift-rank 4 --gift-sketch 8 --gift-loopback"
    ).split() + ["--data-cache-path", str(tmp_path / "cache")]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    res = _run(*torchrun, "-m", "megatron_gift.megatron.cpu_run", str(script), *flags, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "GiftDistributedDataParallel" in out and out.count("lm loss:") == 2, out[-3000:]
