"""Per-step telemetry of gradient communication: one JSON line per logged step, plus scalars
for TensorBoard and Weights & Biases when given. Calling it on rank 0 only is the caller's job.

Schema of a line (keys may be missing on a line that does not have them)::

    {"step": int,
     "loss": float | null,
     "bytes": {"all_to_all/fp8+scales": int, ...},          # CommLedger.as_dict() of the step
     "layers": {param_name: {
         "mode": "gift" | "euclidean" | "bf16" | "off",
         "rel_l2": float | null,       # reduced gradient vs the FP32 sum
         "cos": float | null,
         "saturation": float,          # share of FP8 codes at ±max
         "underflow": float,           # share of non-zero entries decoded as zero
         "top_r_share": float | null,  # gradient energy share in the factor's top-r subspace
                                       # (the factor owner's gradient)
         "bytes": int | null,
         "profile": {ProfileSummary fields} | null}},
     "decisions": [{"param": str, "from": str, "to": str, "reason": str}]}

Values are converted on the way out: enums to their value, dataclasses (``ProfileSummary``)
to dicts, 0-d tensors to numbers, and non-finite floats to ``null`` (strict JSON).
Scalars: ``gift/loss``, ``gift/bytes/<key>``, ``gift/<param>/<field>`` for the numeric layer
fields (``mode`` as its index in ``MODE_CODES``), ``gift/<param>/profile/<field>``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from pathlib import Path

import torch

MODE_CODES = ("off", "bf16", "euclidean", "gift")
TELEMETRY_FILE = "gift_telemetry.jsonl"  # in a run's directory; `megatron-gift report RUN_DIR` reads it


def jsonable(x):
    """``x`` as plain JSON values (see the module docstring)."""
    if isinstance(x, enum.Enum):
        return jsonable(x.value)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, torch.Tensor):
        return jsonable(x.item())
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def scalars(line: dict) -> dict[str, float]:
    """The numeric values of a (``jsonable``) line, tagged as in the module docstring."""
    out = {}

    def put(tag: str, value) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)

    put("gift/loss", line.get("loss"))
    for key, n in (line.get("bytes") or {}).items():
        put(f"gift/bytes/{key}", n)
    for name, layer in (line.get("layers") or {}).items():
        for field, value in layer.items():
            if field == "mode" and value in MODE_CODES:
                put(f"gift/{name}/mode", MODE_CODES.index(value))
            elif field == "profile":
                for pf, pv in (value or {}).items():
                    put(f"gift/{name}/profile/{pf}", pv)
            else:
                put(f"gift/{name}/{field}", value)
    return out


class TelemetryWriter:
    """Appends lines to ``path_jsonl`` (created with its directory; None: no file) and forwards
    scalars to a ``SummaryWriter``-like ``tensorboard`` (``add_scalar(tag, value, step)``) and a
    wandb-like ``wandb`` module or run (``log(dict, step=)``)."""

    def __init__(self, path_jsonl: str | os.PathLike | None, tensorboard=None, wandb=None):
        self.path = None if path_jsonl is None else Path(path_jsonl)
        self.tensorboard = tensorboard
        self.wandb = wandb
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, record: dict) -> dict:
        """Write ``{"step": step, **record}`` as one line (flushed); returns the line as written."""
        line = jsonable({"step": int(step), **{k: v for k, v in record.items() if k != "step"}})
        if self._file is not None:
            self._file.write(json.dumps(line, allow_nan=False, ensure_ascii=False) + "\n")
            self._file.flush()
        values = scalars(line)
        if self.tensorboard is not None:
            for tag, value in values.items():
                self.tensorboard.add_scalar(tag, value, int(step))
        if self.wandb is not None and values:
            self.wandb.log(values, step=int(step))
        return line

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> TelemetryWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
