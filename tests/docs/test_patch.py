"""patches/pretrain_gpt.patch and patches/apply.sh, without a Megatron-LM checkout.

The patch's hunks carry their pre-image context, so the tests rebuild a stand-in for
Megatron-LM's ``pretrain_gpt.py`` from the patch itself: each hunk's context and removed lines at
the line numbers its header names, unique filler lines everywhere else. ``git apply --check``
against that file fails for a malformed hunk (wrong line counts, stray lines, a header that
does not match its body) and the applied result must equal the hunks' post-image. The apply
script then runs on a fake checkout holding that stand-in.

The patched script's main block (the post-image of the hunks from ``pretrain, store = ...`` to
the end of the file) also runs, against the installed megatron-core wheel: Megatron's own
``parse_and_validate_args``, ``gpt_config_from_args``, ``pretrain_cfg_container_from_args`` and
``inprocess_restart``, with ``pretrain`` replaced by a recorder bound to the wheel's signature.

With ``MEGATRON_LM_DIR`` set to a Megatron-LM clone (a checkout or a bare mirror that has
branch ``core_r0.19.0``) the patch is also applied to the real file and the result parsed.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches" / "pretrain_gpt.patch"
APPLY = ROOT / "patches" / "apply.sh"
TARGET_REF = "core_r0.19.0"

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git (git apply)")
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _hunks(text: str):
    """``[(old_start, old_lines, new_start, new_lines, body)]`` of the patch's single file."""
    lines = text.splitlines()
    hunks, i = [], 0
    while i < len(lines):
        m = HUNK_RE.match(lines[i])
        i += 1
        if not m:
            continue
        body = []
        while i < len(lines) and not lines[i].startswith(("@@", "diff --git")):
            body.append(lines[i])
            i += 1
        o, ol, n, nl = m.group(1), m.group(2), m.group(3), m.group(4)
        hunks.append((int(o), int(ol or 1), int(n), int(nl or 1), body))
    return hunks


def _side(body, keep: str) -> list[str]:
    """The hunk's pre-image (``keep='-'``) or post-image (``keep='+'``) lines."""
    return [line[1:] for line in body if line[:1] in (" ", keep)]


def _reconstruct(hunks, side: str) -> str:
    """A file whose lines at each hunk's position are the hunk's ``side`` and unique fillers elsewhere.

    Both sides use the same fillers (numbered by pre-image line), so applying the patch to the
    pre-image reconstruction must give exactly the post-image reconstruction."""
    out, old_line = [], 1
    for old_start, old_len, _new_start, _new_len, body in hunks:
        while old_line < old_start:
            out.append(f"# megatron-gift test filler, pre-image line {old_line}")
            old_line += 1
        out.extend(_side(body, side))
        old_line += old_len
    # No filler after the last hunk: a hunk without trailing context (the patch's last one,
    # which ends at the end of pretrain_gpt.py) must match at the end of the file.
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def patch_text() -> str:
    return PATCH.read_text()


@pytest.fixture(scope="module")
def hunks(patch_text):
    return _hunks(patch_text)


def _fake_checkout(path: Path, hunks, minor: int = 19) -> Path:
    (path / "megatron" / "core").mkdir(parents=True)
    (path / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 1\n")
    (path / "pretrain_gpt.py").write_text(_reconstruct(hunks, "-"))
    return path


def _apply_sh(checkout: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(APPLY), str(checkout)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


# --------------------------------------------------------------------------- the patch's structure


def test_patch_touches_only_pretrain_gpt(patch_text, hunks):
    assert re.findall(r"^diff --git (\S+) (\S+)$", patch_text, re.M) == [("a/pretrain_gpt.py", "b/pretrain_gpt.py")]
    assert re.findall(r"^--- (\S+)$", patch_text, re.M) == ["a/pretrain_gpt.py"]
    assert re.findall(r"^\+\+\+ (\S+)$", patch_text, re.M) == ["b/pretrain_gpt.py"]
    assert 1 <= len(hunks) <= 4
    for _old_start, old_len, _new_start, new_len, body in hunks:
        assert all(line[:1] in (" ", "+", "-") for line in body), body  # no stray lines inside a hunk
        assert len(_side(body, "-")) == old_len and len(_side(body, "+")) == new_len
    added = sum(line.startswith("+") for _, _, _, _, b in hunks for line in b)
    removed = sum(line.startswith("-") for _, _, _, _, b in hunks for line in b)
    assert removed <= 12 and added <= 30, (added, removed)  # small: imports, provider, with-blocks


def test_patch_adds_the_provider_and_wraps_pretrain(hunks):
    added = "\n".join(line[1:] for _, _, _, _, b in hunks for line in b if line.startswith("+"))
    removed = "\n".join(line[1:] for _, _, _, _, b in hunks for line in b if line.startswith("-"))
    assert "from megatron_gift.arguments import" in added
    assert "from megatron_gift.megatron.training import gift_ddp" in added
    # The script's own provider (ModelOpt's, when installed) is kept, chained before the gift group.
    assert "chain_args_providers(add_modelopt_args, add_gift_args)" in added
    assert "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None" in removed
    assert re.search(r"^    gift_config = checked_gift_config\(args\)", added, re.M)  # a bad flag: one message, exit 2
    assert re.search(r"^    with gift_ddp\(gift_config, ", added, re.M)
    assert re.search(r"^    with gift_ddp\(.*\):\n        pretrain\($", added, re.M)  # pretrain inside the block
    assert re.search(r"^    pretrain\($", removed, re.M)


def test_patched_names_exist_in_megatron_gift(hunks):
    from megatron_gift import arguments
    from megatron_gift.megatron import training

    added = "\n".join(line[1:] for _, _, _, _, b in hunks for line in b if line.startswith("+"))
    imported = re.search(r"from megatron_gift\.arguments import (.+)", added).group(1)
    for name in (n.strip() for n in imported.split(",")):
        assert callable(getattr(arguments, name)), name
    call = re.search(r"with gift_ddp\((.*)\):", added).group(1)
    sig = inspect.signature(training.gift_ddp)
    assert {k for k in re.findall(r"(\w+)=", call)} <= set(sig.parameters), call
    # args.gift_log_interval is a flag of the group the patch adds.
    import argparse

    ns = arguments.add_gift_args(argparse.ArgumentParser()).parse_args([])
    for attr in re.findall(r"args\.(gift_\w+)", added):
        assert hasattr(ns, attr), attr


@needs_git
def test_patch_applies_to_its_own_pre_image(tmp_path, hunks):
    pre, post = _reconstruct(hunks, "-"), _reconstruct(hunks, "+")
    (tmp_path / "pretrain_gpt.py").write_text(pre)
    subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=tmp_path, check=True, capture_output=True)
    subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "pretrain_gpt.py").read_text() == post


@needs_git
def test_a_corrupted_hunk_is_rejected(tmp_path, hunks, patch_text):
    """The check above can fail: an off-by-one line count makes ``git apply --check`` refuse."""
    (tmp_path / "pretrain_gpt.py").write_text(_reconstruct(hunks, "-"))
    old_start, old_len = hunks[0][0], hunks[0][1]
    bad = patch_text.replace(f"@@ -{old_start},{old_len} ", f"@@ -{old_start},{old_len + 1} ", 1)
    assert bad != patch_text
    (tmp_path / "bad.patch").write_text(bad)
    res = subprocess.run(["git", "apply", "--check", "bad.patch"], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode != 0


# --------------------------------------------------------------------------- the patched main block, run

MAIN_BLOCK_START = (
    "    gift_args = chain_args_providers(add_modelopt_args, add_gift_args) if has_nvidia_modelopt else add_gift_args"
)
MEGATRON_ARGV = [
    "--transformer-impl",  # Megatron's default needs Transformer Engine, refused at start-up where it is missing
    "local",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--train-iters",
    "1",
    "--lr",
    "1e-3",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--mock-data",
]


def _main_block(hunks) -> str:
    """The post-image from :data:`MAIN_BLOCK_START` to the end, dedented to module level. Pre-image
    lines the patch does not carry (fillers) become a statement that fails if reached, indented as
    a block body where the line before opens one."""
    lines = _reconstruct(hunks, "+").splitlines()
    lines = lines[lines.index(MAIN_BLOCK_START) :]
    out = []
    for line in lines:
        if line.startswith("# megatron-gift test filler"):
            prev = out[-1]
            indent = len(prev) - len(prev.lstrip()) + (4 if prev.rstrip().endswith(":") else 0)
            line = " " * indent + f"raise AssertionError({line[2:]!r})"
        out.append(line)
    return textwrap.dedent("\n".join(out) + "\n")


def _patched_imports(hunks) -> str:
    added = [line[1:] for _, _, _, _, b in hunks for line in b if line.startswith("+")]
    return "\n".join(line for line in added if line.startswith(("from megatron_gift", "import megatron_gift")))


@pytest.fixture
def run_patched_main(hunks, monkeypatch):
    """``run(*flags) -> (calls, ddp classes seen by pretrain)``: the patched main block with
    ``sys.argv = [pretrain_gpt.py, *MEGATRON_ARGV, *flags]``; Megatron's global state reset after."""
    from megatron_gift.megatron.training import shim_typing_override

    shim_typing_override()
    from megatron.core.enums import ModelType
    from megatron.training import global_vars, inprocess_restart
    from megatron.training import training as megatron_training
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    signature = inspect.signature(megatron_training.pretrain)
    sentinels = {
        name: object() for name in ("train_valid_test_datasets_provider", "forward_step", "get_embedding_ranks")
    }

    def run(*flags):
        calls = []

        def pretrain(*args, **kwargs):
            calls.append((signature.bind(*args, **kwargs).arguments, megatron_training.DDP))

        namespace = dict(
            pretrain=pretrain,
            inprocess_restart=inprocess_restart,
            parse_and_validate_args=parse_and_validate_args,
            gpt_config_from_args=gpt_config_from_args,
            pretrain_cfg_container_from_args=pretrain_cfg_container_from_args,
            ModelType=ModelType,
            partial=functools.partial,
            has_nvidia_modelopt=False,
            **sentinels,
        )
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MEGATRON_ARGV, *flags])
        try:
            exec(
                compile(_patched_imports(hunks) + "\n" + _main_block(hunks), "patched-pretrain_gpt", "exec"), namespace
            )
        finally:
            global_vars.unset_global_variables()
        return calls, sentinels

    return run


def test_patched_main_runs_pretrain_inside_gift_ddp(run_patched_main):
    """Bugs caught: the wrapped ``pretrain`` call no longer binds to the wheel's signature; pretrain
    runs outside the ``gift_ddp`` block (GIFT silently off) or with Megatron's class swapped under
    ``--gift-mode off``; the swap outliving the block."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.enums import ModelType
    from megatron.training import training as megatron_training

    from megatron_gift.megatron.ddp import GiftDistributedDataParallel

    for mode in ("gift", "off"):
        calls, sentinels = run_patched_main("--gift-mode", mode)
        assert len(calls) == 1, calls
        bound, ddp = calls[0]
        assert bound["train_valid_test_dataset_provider"] is sentinels["train_valid_test_datasets_provider"]
        assert (
            bound["model_type"] is ModelType.encoder_or_decoder
            and bound["forward_step_func"] is sentinels["forward_step"]
        )
        assert bound["get_embedding_ranks"] is sentinels["get_embedding_ranks"] and bound["store"] is None
        assert (ddp is DistributedDataParallel) == (mode == "off") and issubclass(ddp, GiftDistributedDataParallel) == (
            mode == "gift"
        )
        assert megatron_training.DDP is DistributedDataParallel  # restored after the block


def test_patched_main_stops_a_bad_flag_with_one_message(run_patched_main, monkeypatch, capsys):
    """A refused ``--gift-*`` value in the patched script: exit status 2 before ``pretrain`` and before
    Megatron's ~870-line argument dump (argparse's errors came before it, value errors after), one line
    naming the flag on rank 0, nothing on rank 1, no traceback (was: ValueError on every rank)."""
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exc:
            run_patched_main("--gift-mode", "gift", "--gift-ema", "1.5")
        assert exc.value.code == 2
        captured = capsys.readouterr()
        err = captured.err
        assert "------------------------ arguments" not in captured.out  # before Megatron's argument dump
        ours = [line for line in err.splitlines() if "megatron-gift" in line]
        assert ours == (["megatron-gift: --gift-ema must be in [0, 1), got 1.5"] if rank == "0" else []), err
        assert "Traceback" not in err


def test_patched_help_prints(run_patched_main, capsys):
    """``pretrain_gpt.py --help`` (patched) raised ``ValueError: unsupported format character ')'`` on a
    bare ``%`` in one of Megatron's help strings, while every plugin error points to ``--help``."""
    with pytest.raises(SystemExit) as exc:
        run_patched_main("--help")
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "--gift-mode" in out and "--moe-paged-stash-buffer-size-factor-cuda" in out and "10%)" in out


# --------------------------------------------------------------------------- apply.sh


@needs_git
@needs_bash
def test_apply_sh_patches_then_is_idempotent(tmp_path, hunks):
    checkout = _fake_checkout(tmp_path / "Megatron-LM", hunks)
    res = _apply_sh(checkout)
    assert res.returncode == 0, res.stderr
    assert "patched" in res.stdout
    patched = (checkout / "pretrain_gpt.py").read_text()
    assert patched == _reconstruct(hunks, "+")
    res = _apply_sh(checkout)
    assert res.returncode == 0, res.stderr
    assert "already patched" in res.stdout
    assert (checkout / "pretrain_gpt.py").read_text() == patched


@needs_git
@needs_bash
def test_apply_sh_works_in_a_git_work_tree_subfolder(tmp_path, hunks):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    checkout = _fake_checkout(tmp_path / "third_party" / "Megatron-LM", hunks)
    res = _apply_sh(checkout)
    assert res.returncode == 0, res.stderr
    assert (checkout / "pretrain_gpt.py").read_text() == _reconstruct(hunks, "+")


@needs_git
@needs_bash
def test_apply_sh_refuses_a_different_file(tmp_path, hunks):
    checkout = _fake_checkout(tmp_path / "Megatron-LM", hunks)
    text = (checkout / "pretrain_gpt.py").read_text().replace("from model_provider import model_provider", "import x")
    (checkout / "pretrain_gpt.py").write_text(text)
    res = _apply_sh(checkout)
    assert res.returncode == 1
    assert "does not apply" in res.stderr and "core_r0.19.0" in res.stderr
    assert (checkout / "pretrain_gpt.py").read_text() == text  # left untouched


@needs_git
@needs_bash
def test_apply_sh_checks_the_checkout(tmp_path, hunks):
    res = _apply_sh(tmp_path / "nowhere")
    assert res.returncode == 1 and "not a directory" in res.stderr
    (tmp_path / "empty").mkdir()
    res = _apply_sh(tmp_path / "empty")
    assert res.returncode == 1 and "pretrain_gpt.py not found" in res.stderr

    old = _fake_checkout(tmp_path / "old", hunks, minor=18)
    res = _apply_sh(old)
    assert res.returncode == 1 and "Megatron-Core 0.18" in res.stderr
    assert (old / "pretrain_gpt.py").read_text() == _reconstruct(hunks, "-")
    res = _apply_sh(old, GIFT_PATCH_FORCE="1")  # the version check can be skipped; the patch still applies
    assert res.returncode == 0, res.stderr

    res = subprocess.run(["bash", str(APPLY)], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stderr


@needs_git
@needs_bash
def test_apply_sh_uses_gift_patch(tmp_path):
    """``GIFT_PATCH`` selects the patch: a synthetic one on a synthetic checkout."""
    checkout = tmp_path / "co"
    (checkout / "megatron" / "core").mkdir(parents=True)
    (checkout / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\n")
    (checkout / "pretrain_gpt.py").write_text("a\nb\nc\n")
    (tmp_path / "syn.patch").write_text(
        "--- a/pretrain_gpt.py\n+++ b/pretrain_gpt.py\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
    )
    for expect in ("patched", "already patched"):
        res = _apply_sh(checkout, GIFT_PATCH=str(tmp_path / "syn.patch"))
        assert res.returncode == 0 and expect in res.stdout, res.stderr
        assert (checkout / "pretrain_gpt.py").read_text() == "a\nB\nc\n"


# --------------------------------------------------------------------------- the real file, when given


def _real_pretrain_gpt() -> str:
    repo = os.environ.get("MEGATRON_LM_DIR")
    if not repo or shutil.which("git") is None:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM clone with branch core_r0.19.0")
    res = subprocess.run(["git", "-C", repo, "show", f"{TARGET_REF}:pretrain_gpt.py"], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"{repo} has no {TARGET_REF}:pretrain_gpt.py ({res.stderr.strip()})")
    return res.stdout


@needs_git
def test_patch_applies_to_megatron_lm_core_r0_19(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text(_real_pretrain_gpt())
    subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=tmp_path, check=True, capture_output=True)
    subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, check=True, capture_output=True)
    tree = ast.parse((tmp_path / "pretrain_gpt.py").read_text())
    withs = [n for n in ast.walk(tree) if isinstance(n, ast.With)]
    gift = [w for w in withs if ast.unparse(w.items[0].context_expr).startswith("gift_ddp(gift_config,")]
    assert len(gift) == 1
    body = gift[0].body
    assert len(body) == 1 and ast.unparse(body[0].value.func) == "pretrain"
    calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert sum(c.startswith("pretrain(") for c in calls) == 1  # the only pretrain call is the wrapped one
