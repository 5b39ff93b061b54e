"""Triton kernels run with each launch logged as ``(kernel name, bound arguments and grid)``: how tests and
``bench param-gather`` check a kernel's launch count and its ``TRAFFIC`` entry on real launches."""

from __future__ import annotations

from contextlib import contextmanager


class Logged:
    """``kernel`` (a Triton JIT function) launched as ``kernel[grid](...)``, appending to ``log`` first."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, dict(zip(self.kernel.arg_names, args), **kwargs, grid=tuple(grid))))
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextmanager
def launches_of(module):
    """Within the block every kernel ``module.TRAFFIC`` names logs its launches into the yielded list."""
    log: list[tuple[str, dict]] = []
    kernels = {name: getattr(module, name) for name in module.TRAFFIC}
    for name, kernel in kernels.items():
        setattr(module, name, Logged(kernel, name, log))
    try:
        yield log
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
