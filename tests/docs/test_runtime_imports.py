"""The training path imports nothing of the tools, and installs without the demo's dependencies.

Each check runs in a fresh interpreter whose meta path refuses a list of modules. The training
path (every module of the package but the tools: configuration, state, numerics, kernels, comm,
the Megatron adapter, the launcher, the flags) imports with every tools module refused
(``TOOLS``: the benchmarks, the planner, the demo, the report, their command line, and the test
support, which the launcher's CPU path imports only when it runs); the flags need no Megatron;
the launcher's ``--help`` lists every ``--gift-*`` flag without the demo's dependencies
(matplotlib, tokenizers, the corpus builder, which shells out to the system package manager, and
the CPU harness), and the commands that need them say how to install them.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gift.arguments import add_gift_args

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("megatron_gift_tools", "megatron_gift.testing")
DEMO_ONLY = ("matplotlib", "tokenizers", "megatron_gift_tools.bench.corpus", "megatron_gift.megatron.cpu_harness")
TIMEOUT = float(os.environ.get("MEGATRON_GIFT_TEST_TIMEOUT", 600))

BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
def blocked(name):
    return any(name == b or name.startswith(b + ".") for b in BLOCKED)
class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ImportError("blocked by the test: " + name)
        return None
sys.meta_path.insert(0, _Blocker())
"""


def _run(code: str, blocked: tuple[str, ...] = DEMO_ONLY) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (this checkout first on the path) that refuses ``blocked``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", BLOCKER.format(blocked=blocked) + code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=TIMEOUT,
    )


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules(package: str = "megatron_gift", root: Path = ROOT) -> list[str]:
    """Every module of ``package`` (a folder under ``root``), by its file (nothing imported)."""
    names = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_tools_module_exists():
    """A tool renamed or moved would silently fall out of ``TOOLS`` and be imported by the check below."""
    modules = _modules() + _modules("megatron_gift_tools", ROOT / "tools")
    assert all(any(_under(m, (tool,)) for m in modules) for tool in TOOLS), TOOLS


def test_training_path_imports_without_the_tools():
    """A runtime module that imports a benchmark, the planner, the demo, the report or the command line
    (the chain the planner once had: cost model -> ``bench.overhead`` -> ``demo.PRESETS``), even through
    another module, fails to import here; so does the flag module if it needs Megatron."""
    runtime = [m for m in _modules() if not _under(m, TOOLS)]
    res = _run(
        f"""
import importlib, json
import megatron_gift.arguments
after_arguments = sorted(m for m in sys.modules if m == "megatron" or \
m.startswith(("megatron.", "megatron_gift.megatron")))
failed = {{}}
for name in {runtime!r}:
    try:
        importlib.import_module(name)
    except ImportError as e:
        failed[name] = str(e)
try:
    import megatron_gift_tools.bench.overhead
    blocker_works = False
except ImportError:
    blocker_works = True
loaded = sorted(m for m in sys.modules if blocked(m))
print(json.dumps(dict(after_arguments=after_arguments, failed=failed, loaded=loaded, blocker_works=blocker_works)))
""",
        blocked=("matplotlib", "tokenizers", *TOOLS),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["blocker_works"]
    expected = {
        "megatron_gift.config",
        "megatron_gift.state",
        "megatron_gift.arguments",
        "megatron_gift.upstream",
        "megatron_gift.policy",
        "megatron_gift.pretrain_gpt",
        "megatron_gift.numerics.fp8",
        "megatron_gift.kernels.fused",
        "megatron_gift.comm.quantized",
        "megatron_gift.megatron.ddp",
        "megatron_gift.megatron.bucket_group",
        "megatron_gift.megatron.training",
    }
    assert expected <= set(runtime), sorted(expected - set(runtime))
    assert out["failed"] == {}
    assert out["loaded"] == []
    # the flags need neither the adapter nor Megatron itself
    assert out["after_arguments"] == []


def _gift_flags() -> set[str]:
    from megatron_gift.pretrain_gpt import add_launcher_args

    parser = add_launcher_args(add_gift_args(argparse.ArgumentParser()))
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--gift-")}


def test_launcher_help_lists_every_gift_flag_without_the_bench_modules():
    res = _run(
        """
import runpy
sys.argv = ["megatron_gift.pretrain_gpt", "--help"]
runpy.run_module("megatron_gift.pretrain_gpt", run_name="__main__", alter_sys=True)
"""
    )
    assert res.returncode == 0, res.stderr[-4000:]
    flags = _gift_flags()
    assert len(flags) >= 20
    missing = sorted(f for f in flags if f not in res.stdout)
    assert not missing, missing


@pytest.mark.parametrize(
    "argv, needs",
    [
        (["report", "runs/none"], "matplotlib"),
        (["demo", "--quick"], "matplotlib, tokenizers"),
        (["bench", "comm", "--quick"], "tokenizers"),
        (["model", "--validate-cpu", "x.json"], "tokenizers"),
    ],
)
def test_bench_commands_name_the_extra_they_need(argv, needs):
    res = _run(f"from megatron_gift_tools.cli import main\nmain({argv!r})")
    assert res.returncode == 1, (res.stdout, res.stderr[-2000:])
    assert (
        f"needs {needs} (a dependency of the tools): pip install -e tools  (in the megatron-gift checkout)"
        in res.stderr
    )


def test_gpu_check_commands_need_no_bench_extra():
    """bench/gpu_check.sh runs ``bench overhead`` and ``model`` in a training container."""
    from megatron_gift_tools.cli import build_parser

    for argv in (["bench", "overhead"], ["bench", "telemetry"], ["model"]):
        assert getattr(build_parser().parse_args(argv), "needs", ()) == (), argv


def _private_uses(source: str, package: str, targets: tuple[str, ...]) -> list[str]:
    """Underscore names of the ``targets`` packages that ``source`` (a module of ``package``)
    imports (``from ..numerics.fp8 import _x``) or reaches through an imported module (``kernels._x``)."""
    found, modules = [], {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if full.startswith(targets):
                    modules[alias.asname or alias.name] = full
                if module.startswith(targets) and alias.name.startswith("_"):
                    found.append(f"from {module} import {alias.name}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if node.attr.startswith("_"):
                found.append(f"{modules[node.value.id]}.{node.attr}")
    return found


TARGETS = ("megatron_gift.numerics", "megatron_gift.kernels")


def test_comm_uses_only_public_names_of_numerics_and_kernels():
    files = sorted((ROOT / "megatron_gift" / "comm").glob("*.py"))
    assert files
    found = [f"{p.name}: {f}" for p in files for f in _private_uses(p.read_text(), "megatron_gift.comm", TARGETS)]
    assert not found, found


def test_private_use_check_sees_private_names():
    source = (
        "from ..numerics.fp8 import _helper, encode\n"
        "from megatron_gift.kernels.reference import _x\n"
        "from .. import kernels\n"
        "from .layout import _merge\n"
        "y = kernels._fused() + kernels.available(0)\n"
    )
    assert _private_uses(source, "megatron_gift.comm", TARGETS) == [
        "from megatron_gift.numerics.fp8 import _helper",
        "from megatron_gift.kernels.reference import _x",
        "megatron_gift.kernels._fused",
    ]


def test_reduction_state_imports_without_megatron():
    """``megatron_gift.state`` (statistics, factors, residual bookkeeping, step) and the refresh that
    fills it (``refresh_sync``) are Megatron-free: they import, and the state dict round-trips, with
    every ``megatron`` module refused."""
    res = _run(
        """
class _NoMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError("blocked by the test: " + name)
sys.meta_path.insert(0, _NoMegatron())
import torch
from megatron_gift.config import GiftConfig, Mode
from megatron_gift.refresh_sync import RefreshSync
from megatron_gift.state import GiftParam, GiftState
state = GiftState(GiftConfig(mode=Mode.EUCLIDEAN), torch.device("cpu"))
RefreshSync(state).install(lambda gp, old, new: None)  # nothing in flight: a no-op
state.params[torch.nn.Parameter(torch.zeros(2, 2))] = GiftParam("w", Mode.EUCLIDEAN)
state.open_step()
saved = state.state_dict([])
other = GiftState(GiftConfig(mode=Mode.EUCLIDEAN), torch.device("cpu"))
other.params[torch.nn.Parameter(torch.zeros(2, 2))] = GiftParam("w", Mode.EUCLIDEAN)
print(saved, other.load_state_dict(saved, [], torch.device("cpu")), other.step)
"""
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip().splitlines()[-1] == "{'step': 0, 'params': {'w': {'mode': 'euclidean'}}} [] 0"
