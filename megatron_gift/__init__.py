"""megatron-gift: low-precision data-parallel gradient communication for Megatron-Core, with GIFT whitening.

The public API, imported on first use (``import megatron_gift`` loads neither Megatron nor torch):

- ``GiftConfig``: what the plugin does (``megatron_gift.config``);
- ``add_gift_args(parser)``: the ``--gift-*`` flags on an argparse parser (``megatron_gift.arguments``);
- ``GiftDistributedDataParallel``: Megatron-Core's DDP with the plugin's reduction (``megatron_gift.megatron.ddp``);
- ``gift_ddp(config)``: the DDP class to hand Megatron's training loop (``megatron_gift.megatron.training``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "GiftConfig": "megatron_gift.config",
    "add_gift_args": "megatron_gift.arguments",
    "GiftDistributedDataParallel": "megatron_gift.megatron.ddp",
    "gift_ddp": "megatron_gift.megatron.training",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'megatron_gift' has no attribute {name!r}")
