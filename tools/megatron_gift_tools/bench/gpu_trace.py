"""GPU check, one steady step looked at closely: host synchronisations and codec/backward overlap.

- ``sync_probe``: the step's forward, backward and ``finish_grad_sync`` under
  ``torch.cuda.set_sync_debug_mode("warn")``, every warning kept with the Python line that raised it
  and counted as the plugin's when that line is in ``megatron_gift`` (outside ``testing``); on the
  CPU (the dry run) ``testing.dispatch.SyncSanitizer`` sees the same ops.
- ``sync_error``: the same under ``set_sync_debug_mode("error")``: whether it raised,
  and the innermost ``megatron_gift`` frame of the error. It aborts the step: run it last.
- ``profiled``: a ``torch.profiler`` trace of the step; ``overlap`` reads it (Chrome trace format):
  the compute stream is the stream of most kernels launched inside the last micro-batch's backward
  (the ``BACKWARD`` annotation), the plugin's codec kernels are the other non-NCCL kernels of the
  step, and the share is their time that overlaps compute-stream kernels of that backward.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import tempfile
import traceback
import warnings

import torch

import megatron_gift

BACKWARD = "gpu_check/last-backward"
_PACKAGE = os.path.dirname(os.path.abspath(megatron_gift.__file__))
_TESTING = os.path.join(_PACKAGE, "testing")


def _plugin_file(path: str) -> bool:
    return (
        path.startswith(_PACKAGE) and not path.startswith(_TESTING) and not path.startswith(os.path.dirname(__file__))
    )


@contextlib.contextmanager
def _debug_mode(mode: str):
    """``torch.cuda.set_sync_debug_mode(mode)`` inside, off again after."""
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def sync_probe(step, device: torch.device) -> dict:
    """Run ``step(scope)`` (``scope``: a context manager factory around the step's fwd/bwd/finish) and list the
    host synchronisations inside the scope: ``plugin`` (``file:line``: count) and ``others`` (count)."""
    if device.type == "cpu":
        from megatron_gift.testing.dispatch import SyncSanitizer

        sanitizer = SyncSanitizer()
        step(lambda: sanitizer)
        return dict(method="testing.dispatch.SyncSanitizer (CPU)", plugin=dict(sanitizer.counts()), others=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(lambda: _debug_mode("warn"))
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    plugin = collections.Counter(
        f"{os.path.relpath(w.filename, os.path.dirname(_PACKAGE))}:{w.lineno}"
        for w in syncs
        if _plugin_file(w.filename)
    )
    return dict(
        method='torch.cuda.set_sync_debug_mode("warn")', plugin=dict(plugin), others=len(syncs) - sum(plugin.values())
    )


def sync_error(step, device: torch.device) -> dict | None:
    """``step(scope)`` under ``set_sync_debug_mode("error")``: ``raised`` and where (None on the CPU)."""
    if device.type == "cpu":
        return None
    try:
        step(lambda: _debug_mode("error"))
    except RuntimeError as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _plugin_file(f.filename)]
        where = (
            f"{os.path.relpath(frames[-1].filename, os.path.dirname(_PACKAGE))}:{frames[-1].lineno}" if frames else None
        )
        return dict(raised=True, error=str(e).splitlines()[0], plugin_frame=where)
    return dict(raised=False, error=None, plugin_frame=None)


def profiled(step, device: torch.device) -> dict:
    """``step()`` under ``torch.profiler``; the trace's overlap summary (``overlap``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=activities) as prof:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return overlap(json.load(f))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(a: float, b: float, busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def overlap(trace: dict) -> dict:
    """Codec kernels against the last backward's compute-stream kernels (times in the trace's microseconds)."""
    events = trace.get("traceEvents", [])
    marks = [e for e in events if e.get("name") == BACKWARD and e.get("cat") == "user_annotation"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not marks or not kernels:
        return dict(
            kernels=len(kernels),
            codec_kernels=0,
            codec_s=0.0,
            share_overlapping_backward=None,
            share_in_backward_window=None,
            note="no GPU kernels in the trace" if marks else "no backward mark",
        )
    t0, t1 = marks[0]["ts"], marks[0]["ts"] + marks[0]["dur"]
    launches = [
        e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    ]
    launched = {e["args"]["correlation"] for e in launches if t0 <= e["ts"] <= t1}
    earlier = {e["args"]["correlation"] for e in launches if e["ts"] < t0}
    inside = [k for k in kernels if k.get("args", {}).get("correlation") in launched]
    # the compute stream runs most of the forward passes' kernels (launched before the mark): inside the last
    # backward the plugin's streams may run more kernels than the backward itself
    streams = collections.Counter(k["args"].get("stream") for k in kernels if k["args"].get("correlation") in earlier)
    streams = streams or collections.Counter(k["args"].get("stream") for k in inside)
    compute_stream = streams.most_common(1)[0][0] if streams else None
    compute = [(k["ts"], k["ts"] + k["dur"]) for k in inside if k["args"].get("stream") == compute_stream]
    codec = [
        (k["ts"], k["ts"] + k["dur"])
        for k in kernels
        if k.get("args", {}).get("stream") != compute_stream and "nccl" not in k.get("name", "").lower()
    ]
    busy = _union(compute)
    window = [(busy[0][0], busy[-1][1])] if busy else []
    total = sum(b - a for a, b in codec)
    share = lambda spans: sum(_covered(a, b, spans) for a, b in codec) / total if total else None  # noqa: E731
    return dict(
        kernels=len(kernels),
        compute_stream=compute_stream,
        backward_kernels=len(compute),
        backward_window_s=(window[0][1] - window[0][0]) * 1e-6 if window else None,
        codec_kernels=len(codec),
        codec_s=total * 1e-6,
        share_overlapping_backward=share(busy),
        share_in_backward_window=share(window),
    )
