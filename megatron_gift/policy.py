"""Per-layer choice of gradient communication (Euclidean FP8, GIFT FP8 or BF16) from measured profiles.

``LayerPolicy.decide`` maps a parameter's ``ProfileSummary`` (summed over data-parallel ranks,
so identical everywhere) to a mode with plain comparisons: every rank decides the same. Rules,
with ``e``/``g`` the measured Euclidean/GIFT RelL2, ``m = margin``, ``b = bf16_bound``:

* FP8 choice: GIFT when ``g < e·(1-m)``; once in GIFT, it stays while ``g < e`` (a dead band of
  width ``m`` between the two, so a ratio hovering near 1 does not flap). GIFT is a candidate
  only when it was measured.
* BF16: when the better FP8 RelL2 ``min(e, g) > b``; back to FP8 only once it is ``< b·(1-m)``.
* A switch happens after ``hysteresis`` consecutive profiles asking for the same other mode,
  except leaving GIFT when it is clearly worse (``g > e·(1+m)``): that happens at once, since a
  whitening that has gone stale between profiles can multiply the error.
* A profile with non-finite entries or a zero gradient changes nothing (and resets the count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import Mode, PolicyConfig
from .numerics.profile import ProfileSummary

CHOICES = (Mode.EUCLIDEAN, Mode.GIFT, Mode.BF16)


@dataclass(frozen=True)
class Decision:
    """The mode a parameter uses from now on, why, and the mode it had before this decision."""

    mode: Mode
    reason: str
    previous: Mode | None = None

    @property
    def changed(self) -> bool:
        return self.previous is not None and self.previous is not self.mode


def _f(x: float) -> str:
    return f"{x:.3g}"


class LayerPolicy:
    """Current mode per parameter name (``default`` until decided otherwise) and the pending
    switch of each: ``(target mode, consecutive profiles asking for it)``."""

    def __init__(
        self, config: PolicyConfig | None = None, default: Mode = Mode.EUCLIDEAN, initial: dict[str, Mode] | None = None
    ):
        self.config = config or PolicyConfig()
        for mode in (default, *(initial or {}).values()):
            if mode not in CHOICES:
                raise ValueError(f"a policy chooses among {[m.value for m in CHOICES]}, got {mode}")
        self.default = default
        self.modes: dict[str, Mode] = dict(initial or {})
        self.pending: dict[str, tuple[Mode, int]] = {}

    def mode(self, name: str) -> Mode:
        return self.modes.get(name, self.default)

    def _target(self, current: Mode, s: ProfileSummary) -> tuple[Mode, str]:
        """The mode this one profile asks for and the comparison that says so."""
        cfg = self.config
        e, g = s.euclidean_rel_l2, s.gift_rel_l2
        keep = 1.0 - cfg.margin
        if current is Mode.GIFT and g is not None and g < e:
            fp8, why = Mode.GIFT, f"gift {_f(g)} < euclidean {_f(e)}"
        elif g is not None and g < e * keep:
            fp8, why = Mode.GIFT, f"gift {_f(g)} < euclidean {_f(e)} × {_f(keep)}"
        elif g is None:
            fp8, why = Mode.EUCLIDEAN, f"euclidean {_f(e)}, gift not measured"
        elif current is Mode.GIFT:
            fp8, why = Mode.EUCLIDEAN, f"gift {_f(g)} ≥ euclidean {_f(e)}"
        else:
            fp8, why = Mode.EUCLIDEAN, f"gift {_f(g)} ≥ euclidean {_f(e)} × {_f(keep)}"
        best = e if g is None else min(e, g)
        bound = cfg.bf16_bound
        if current is Mode.BF16:
            if best < bound * keep:
                return fp8, f"best FP8 {_f(best)} < bf16 bound {_f(bound)} × {_f(keep)}; {why}"
            return Mode.BF16, f"best FP8 {_f(best)} ≥ bf16 bound {_f(bound)} × {_f(keep)}"
        if best > bound:
            return Mode.BF16, f"best FP8 {_f(best)} > bf16 bound {_f(bound)}"
        return fp8, why

    def decide(self, name: str, summary: ProfileSummary) -> Decision:
        """Record one profile of ``name`` and return its mode from now on (deterministic)."""
        current = self.mode(name)
        e, g = summary.euclidean_rel_l2, summary.gift_rel_l2
        if summary.nonfinite or e is None or not math.isfinite(e) or (g is not None and not math.isfinite(g)):
            self.pending.pop(name, None)
            why = f"{summary.nonfinite} non-finite entries" if summary.nonfinite else "no finite RelL2 (zero gradient?)"
            return Decision(current, f"keep {current.value}: {why}", current)
        target, why = self._target(current, summary)
        if target is current:
            self.pending.pop(name, None)
            return Decision(current, why, current)
        pending_target, count = self.pending.get(name, (target, 0))
        count = count + 1 if pending_target is target else 1
        n = self.config.hysteresis
        g_clearly_worse = g is not None and g > e * (1.0 + self.config.margin)
        if current is Mode.GIFT and target is Mode.EUCLIDEAN and g_clearly_worse:
            n = 1
        if count < n:
            self.pending[name] = (target, count)
            return Decision(current, f"{why} ({count} of {n} profiles; keep {current.value})", current)
        self.pending.pop(name, None)
        self.modes[name] = target
        return Decision(target, f"{why} for {n} profile{'s' if n > 1 else ''}", current)

    def state_dict(self) -> dict:
        """Plain Python (JSON- and pickle-friendly): modes and pending switches by parameter name."""
        return {
            "modes": {k: m.value for k, m in self.modes.items()},
            "pending": {k: [m.value, c] for k, (m, c) in self.pending.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.modes = {k: Mode(v) for k, v in state["modes"].items()}
        self.pending = {k: (Mode(m), int(c)) for k, (m, c) in state["pending"].items()}
