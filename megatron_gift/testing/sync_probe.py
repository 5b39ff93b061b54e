"""Every iteration of a real launcher run under ``dispatch.SyncSanitizer``, for tests (CPU runs only).

With ``GIFT_SYNC_PROBE_DIR`` set, ``testing.launch`` runs the launcher through this module
(``python -m megatron_gift.testing.sync_probe <launcher flags>``), which calls :func:`install` first (the
runtime never imports test support): an iteration
is everything from one ``train_step`` call of Megatron's training loop to the next (forward,
backward, ``finish_grad_sync``, optimizer step, the parameter gather started there and waited on in
the next forward, ``training_log``, the plugin's step close), each under a fresh sanitizer. At exit
each rank writes ``rank<r>.json``: ``{iteration: {"file:line (op)": count}}``, ``iteration`` as
Megatron logs it (1 for the first).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os

from .dispatch import SyncSanitizer

ENV = "GIFT_SYNC_PROBE_DIR"


class _Probe:
    def __init__(self, directory: str):
        self.directory = directory
        self.current: tuple[int, SyncSanitizer] | None = None
        self.iterations: dict[int, dict] = {}

    def next_iteration(self, iteration: int) -> None:
        self.close()
        sanitizer = SyncSanitizer()
        sanitizer.__enter__()
        self.current = (iteration, sanitizer)

    def close(self) -> None:
        if self.current is not None:
            iteration, sanitizer = self.current
            sanitizer.__exit__(None, None, None)
            self.iterations[iteration] = dict(sanitizer.counts())
            self.current = None

    def write(self) -> None:
        import torch.distributed as dist

        self.close()
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank{rank}.json"), "w") as f:
            json.dump(self.iterations, f, indent=1)


def install(directory: str) -> None:
    """Probe every iteration of Megatron's training loop (module doc); the results written at exit."""
    training = importlib.import_module("megatron.training.training")
    original = training.train_step
    probe = _Probe(directory)

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        from megatron.training import get_args

        probe.next_iteration(get_args().curr_iteration + 1)
        return original(*args, **kwargs)

    training.train_step = train_step
    atexit.register(probe.write)


def main() -> None:
    """The launcher (``megatron_gift.pretrain_gpt``) with every iteration probed into ``$GIFT_SYNC_PROBE_DIR``."""
    from megatron_gift import pretrain_gpt
    from megatron_gift.megatron import training

    training.shim_typing_override()  # megatron.training imports typing.override (Python 3.12)
    install(os.environ[ENV])
    pretrain_gpt.main()


if __name__ == "__main__":
    main()
