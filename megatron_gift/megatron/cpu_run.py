"""Megatron-LM's own (patched) ``pretrain_gpt.py`` on CPU ranks over gloo: the route the launcher's
``--gift-cpu`` takes, for a script (tests and demos; never on a GPU machine)::

    torchrun --nproc-per-node 2 -m megatron_gift.megatron.cpu_run /path/to/Megatron-LM/pretrain_gpt.py <flags>

The CPU harness is installed before the script imports Megatron (``cpu_harness.install_for_training``),
its ``TRAINING_FLAGS`` go in front of the flags (later flags win), ``typing.override`` is provided on
Python 3.11 (Megatron-LM's script otherwise needs 3.12), the checkout's dataset helpers are used as
built, and the script runs as ``__main__`` with its folder first on ``sys.path`` (its own imports,
``model_provider``, resolve as ``python pretrain_gpt.py`` would). A ``--gift-cpu`` given is dropped:
the patched script does not know the launcher's flag, and this module is what it asks for.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m megatron_gift.megatron.cpu_run SCRIPT [Megatron and --gift-* flags]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") or not os.path.isfile(argv[0]):
        print(f"megatron-gift: {USAGE} (got {argv[0] if argv else 'no script'})", file=sys.stderr)
        raise SystemExit(2)
    script, flags = os.path.abspath(argv[0]), [a for a in argv[1:] if a != "--gift-cpu"]
    from . import cpu_harness
    from . import training as gift_training

    gift_training.shim_typing_override()
    cpu_harness.install_for_training()
    gift_training.use_prebuilt_dataset_helpers()
    sys.argv = [script, *cpu_harness.TRAINING_FLAGS, *flags]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
