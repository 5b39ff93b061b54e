"""The package's public names resolve to the runtime's objects, and importing the package stays light."""

from __future__ import annotations

import subprocess
import sys


def test_public_names_are_the_runtime_objects():
    """A public name pointing at a renamed or moved object would fail only in a user's script."""
    import megatron_gift
    from megatron_gift.arguments import add_gift_args
    from megatron_gift.config import GiftConfig
    from megatron_gift.megatron.ddp import GiftDistributedDataParallel
    from megatron_gift.megatron.training import gift_ddp

    assert megatron_gift.GiftConfig is GiftConfig
    assert megatron_gift.add_gift_args is add_gift_args
    assert megatron_gift.GiftDistributedDataParallel is GiftDistributedDataParallel
    assert megatron_gift.gift_ddp is gift_ddp
    assert set(megatron_gift.__all__) == {
        "__version__",
        "GiftConfig",
        "add_gift_args",
        "GiftDistributedDataParallel",
        "gift_ddp",
    }


def test_import_loads_neither_megatron_nor_torch():
    """An eager import in ``__init__`` would make every ``megatron_gift.*`` import (the flags, the
    launcher's ``--help``) pay for Megatron-Core's 4-5 s import."""
    code = (
        "import sys, megatron_gift; print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
