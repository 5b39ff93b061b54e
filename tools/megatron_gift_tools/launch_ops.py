"""The launcher with the plugin's ATen ops counted in chosen training steps (``bench launches``).

``python -m megatron_gift_tools.launch_ops OUT_DIR STEPS -- <megatron_gift.pretrain_gpt args>``
runs ``megatron_gift.pretrain_gpt`` unchanged, except that Megatron's ``train_step`` calls whose
0-based index is in ``STEPS`` (comma-separated) run inside a dispatch mode that counts every ATen
op whose innermost ``megatron_gift``/``megatron`` frame is the plugin's (``_owner``: Megatron's
own ops are stock behaviour, even when the plugin calls into Megatron). Each rank writes ``OUT_DIR/rank<r>.json``:
``{step: {"plugin_ops": n, "all_ops": m, "by_op": {...}}}``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys

from torch.utils._python_dispatch import TorchDispatchMode

from megatron_gift.testing.dispatch import _HARNESS, _PACKAGE, _TESTING


def _owner(frame) -> str | None:
    """``"plugin"``, ``"megatron"`` or None: who the innermost frame of either package belongs to."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and not path.startswith(_TESTING) and path != _HARNESS:
            return "plugin"
        if f"{os.sep}megatron{os.sep}" in path and not path.startswith(_PACKAGE):
            return "megatron"
        frame = frame.f_back
    return None


class PluginOps(TorchDispatchMode):
    """Counts the ATen ops dispatched while active, and those from the plugin's frames."""

    def __init__(self):
        super().__init__()
        self.all_ops = 0
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.all_ops += 1
        if _owner(sys._getframe(1)) == "plugin":
            self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def plugin_ops(self) -> int:
        return sum(self.by_op.values())


def _counting_train_step(real, steps: set[int], out_dir: str):
    calls, results = [0], {}

    def train_step(*args, **kwargs):
        k = calls[0]
        calls[0] += 1
        if k not in steps:
            return real(*args, **kwargs)
        mode = PluginOps()
        with mode:
            out = real(*args, **kwargs)
        results[k] = dict(plugin_ops=mode.plugin_ops, all_ops=mode.all_ops, by_op=dict(mode.by_op.most_common(12)))
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
        return out

    return train_step


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir, steps, rest = argv[0], {int(s) for s in argv[1].split(",")}, argv[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    os.makedirs(out_dir, exist_ok=True)
    from megatron_gift import pretrain_gpt
    from megatron_gift.megatron import training as gift_training

    real_ddp = gift_training.gift_ddp

    @contextlib.contextmanager
    def gift_ddp(*args, **kwargs):  # entered right before pretrain(): megatron.training imports by then
        import megatron.training.training as training

        with real_ddp(*args, **kwargs) as value:
            real_step = training.train_step
            training.train_step = _counting_train_step(real_step, steps, out_dir)
            try:
                yield value
            finally:
                training.train_step = real_step

    gift_training.gift_ddp = gift_ddp
    try:
        pretrain_gpt.main(rest)
    finally:
        gift_training.gift_ddp = real_ddp


if __name__ == "__main__":
    main()
