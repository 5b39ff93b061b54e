"""What one GIFT refresh costs a rank: host and device time of each stage, host waits, ATen ops,
collectives and bytes, for the linear layers of Llama-600M (``bench.overhead.MODELS``) at a
data-parallel size ``R``, so that the planner (``megatron_gift_tools.planner.stages``) can price it.

It runs ``refresh_sync.RefreshSync``'s refresh as training does (``at_sync`` at the first bucket sync,
``after_reductions`` at ``finish_grad_sync``, ``close_step``, ``install`` at the next step's first
sync) on one process, for the layers rank 0 of ``R`` owns (``RefreshSync.assign_owners``), with
``--gift-damping auto`` on random gradients of the layers' shapes. The reduction group is a stand-in
of ``R`` ranks whose collectives do nothing but count (the bytes are the ledger's, the time of the
wire is the planner's to price); every layer's record still takes its slot of the all-gather.

Per stage: ``host_s`` (the call's wall time: what the host spends, including its host waits) and,
on CUDA, ``done_s`` (until the device finished the stage's work, by a synchronisation the plugin
does not make). Run: ``python -m megatron_gift_tools.bench.refresh [--quick] --json PATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

from megatron_gift import refresh_sync as refresh_mod
from megatron_gift.config import GiftConfig, Mode, WhiteningConfig
from megatron_gift.numerics.kfac import KFACStatistics
from megatron_gift.numerics.refresh import RecordLayout
from megatron_gift.refresh_sync import RefreshSync
from megatron_gift.state import GiftParam, GiftState
from megatron_gift.testing.dispatch import OpCounter
from megatron_gift_tools.bench.overhead import MODELS
from megatron_gift_tools.planner.workloads import layer_shapes

STAGES = ("start (first sync)", "cores (finish_grad_sync)", "send (close of the step)", "install (next first sync)")


class StubGroup:
    """A reduction group of ``size`` ranks seen from rank 0, for code that reads its size and rank without
    communicating (``RefreshSync`` with its collectives stubbed, a reduction's ``footprint()``)."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


class _Done:
    def wait(self) -> None:
        pass


@contextlib.contextmanager
def _counted_collectives(calls: list):
    """``dist.all_reduce``, the statistics' reduce-scatter and the factor all-gather record ``(name, bytes)``
    instead of communicating (the reduce-scatter hands rank 0 its own slot as the sum; the all-gather leaves
    the other ranks' slots zero: headers of empty rank-0 records)."""
    real_reduce, real_scatter, real_gather = dist.all_reduce, refresh_mod._reduce_scatter, refresh_mod._all_gather
    dist.all_reduce = lambda t, *a, **k: calls.append(("all_reduce", t.numel() * t.element_size())) or _Done()

    def scatter(out, t, **k):
        calls.append(("reduce_scatter", t.numel() * t.element_size()))
        out.copy_(t[: out.numel()])
        return _Done()

    def gather(out, t, **k):  # rank 0's slot its own; the others' records are zero (status OK, rank 0)
        calls.append(("all_gather", t.numel() * t.element_size()))
        out.zero_()[: t.numel()].copy_(t)
        return _Done()

    refresh_mod._reduce_scatter, refresh_mod._all_gather = scatter, gather
    try:
        yield
    finally:
        dist.all_reduce, refresh_mod._reduce_scatter, refresh_mod._all_gather = real_reduce, real_scatter, real_gather


def _layers(model: dict, dp: int, device: torch.device, cfg: GiftConfig):
    """Every GIFT layer of ``model`` as ``(GiftParam, group, gradient or None)``, with a filled EMA;
    owners as ``GiftDistributedDataParallel`` assigns them (``RefreshSync.assign_owners``); gradients
    only for rank 0's layers."""
    group, params = StubGroup(dp), []
    gen = torch.Generator().manual_seed(0)
    for layer in range(model["layers"]):
        for name, (d_out, d_in) in layer_shapes(model).items():
            g = GiftParam(f"{layer}.{name}", Mode.GIFT, candidate=True, sketch_seed=len(params))
            g.input.stats = KFACStatistics(
                d_in, ema=cfg.whitening.ema, sketch=cfg.whitening.sketch, seed=len(params), device=device
            )
            g.input.stats.accumulate(torch.randn(256, d_in, generator=gen).to(device))
            g.input.stats.fold()
            g.input.groups = [group]
            params.append((g, d_out))
    RefreshSync(GiftState(cfg, device)).assign_owners([(g, group) for g, _ in params])
    return [
        (g, group, torch.randn(d_out, g.input.stats.d_in, generator=gen).to(device) if g.owner == 0 else None)
        for g, d_out in params
    ]


def _refresh(layers, cfg: GiftConfig, device: torch.device, count_ops: bool) -> tuple[RefreshSync, list[dict]]:
    """One refresh through ``RefreshSync``'s four calls; per stage its times (``count_ops``: its ATen
    ops instead, the dispatch probe's own overhead making the times meaningless)."""
    st = RefreshSync(GiftState(cfg, device))
    st.assign_owners([(g, grp) for g, grp, _ in layers])  # the owners _layers assigned, and the layers kept
    st.state.open_step()  # step 0: a refresh step
    calls, stages = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    remap = lambda g, old, new: None  # noqa: E731 - no error feedback here
    steps = (
        lambda: st.at_sync([(g, grp, gr) for g, grp, gr in layers if gr is not None], remap),
        st.after_reductions,
        lambda: st.close_step([]),
        lambda: (st.state.open_step(), st.install(remap)),
    )
    with _counted_collectives(calls):
        for name, fn in zip(STAGES, steps):
            sync()
            n_calls, waits, ops = len(calls), st.host_waits, OpCounter()
            t0 = time.perf_counter()
            with ops if count_ops else contextlib.nullcontext():
                fn()
            host = time.perf_counter() - t0
            sync()
            rec = dict(stage=name, host_waits=st.host_waits - waits, collectives=calls[n_calls:])
            rec.update(aten_ops=ops.total) if count_ops else rec.update(host_s=host, done_s=time.perf_counter() - t0)
            stages.append(rec)
    return st, stages


def measure(model_name: str, dp: int, device: torch.device) -> dict:
    """One refresh of ``model_name``'s GIFT layers as rank 0 of ``dp`` ranks (module doc), timed, then counted."""
    cfg = GiftConfig(mode=Mode.GIFT)
    layers = _layers(MODELS[model_name], dp, device, cfg)
    st, stages = _refresh(layers, cfg, device, count_ops=False)
    for s, counted in zip(stages, _refresh(layers, cfg, device, count_ops=True)[1]):
        s["aten_ops"] = counted["aten_ops"]
    owned = [g for g, _, gr in layers if gr is not None]
    records = [
        RecordLayout(g.input.stats.d_in, g.input.stats.factor_rank(cfg.whitening.rank)).nbytes for g, _, _ in layers
    ]
    slot = max(sum(b for (g, _, _), b in zip(layers, records) if g.owner == r) for r in range(dp))
    assert st.state.last_step_bytes.get("all_gather/factors", 0) == (dp - 1) * slot  # the ledger counts what is sent
    return dict(
        model=model_name,
        dp=dp,
        device=str(device),
        gift_layers=len(layers),
        owned_layers=len(owned),
        built_layers=sum(g.input.whitening is not None for g in owned),
        record_bytes_total=sum(records),
        slot_bytes=slot,
        stats_reduce_scatter_bytes=st.state.last_step_bytes.get("reduce_scatter/fp32", 0),
        allgather_bytes_sent=st.state.last_step_bytes.get("all_gather/factors", 0),
        host_waits=st.host_waits,
        stages=stages,
        host_s=sum(s["host_s"] for s in stages),
        done_s=sum(s["done_s"] for s in stages),
    )


def run(quick: bool, json_path: str | None, device: str | None = None, command: str | None = None) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cases = [("llama-600m", 64)] if quick else [("llama-600m", 64), ("llama-600m", 8), ("demo", 2)]
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    load, t0 = os.getloadavg()[0], time.time()
    try:
        results = []
        for name, dp in cases:
            print(f"[bench refresh] {name} at {dp} ranks on {dev} ...", file=sys.stderr, flush=True)
            results.append(measure(name, dp, dev))
    finally:
        torch.set_num_threads(threads)
    doc = dict(
        benchmark="refresh",
        command=command or ("python -m megatron_gift_tools.bench.refresh" + (" --quick" if quick else "")),
        machine=dict(
            platform=platform.platform(),
            processor=platform.processor() or platform.machine(),
            cpus=os.cpu_count(),
            load_average_before_after=[load, os.getloadavg()[0]],
            torch=torch.__version__,
            threads=1 if dev.type == "cpu" else threads,
            gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        ),
        config=dict(
            rank=WhiteningConfig().rank,
            sketch=WhiteningConfig().sketch,
            damping="auto",
            candidates=WhiteningConfig().damping_candidates,
        ),
        schema=__doc__.split("\n\n")[2],
        wall_seconds=round(time.time() - t0, 1),
        results=results,
    )
    print(format_table(doc), end="")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def format_table(doc: dict) -> str:
    lines = [
        "| model | R | layers built | stage | host ms | done ms | host waits | ATen ops | collectives (bytes) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        for s in r["stages"]:
            coll = ", ".join(f"{c} {b}" for c, b in s["collectives"]) or "-"
            lines.append(
                f"| {r['model']} | {r['dp']} | {r['built_layers']}/{r['gift_layers']} | {s['stage']} | "
                f"{1e3 * s['host_s']:.1f} | {1e3 * s['done_s']:.1f} | {s['host_waits']} | {s['aten_ops']} | {coll} |"
            )
        lines.append(
            f"| {r['model']} | {r['dp']} | | **refresh** | {1e3 * r['host_s']:.1f} | {1e3 * r['done_s']:.1f} | "
            f"{r['host_waits']} | | stats reduce-scatter {r['stats_reduce_scatter_bytes']} B out, factor all-gather "
            f"{r['allgather_bytes_sent']} B out (slot {r['slot_bytes']} B, records {r['record_bytes_total']} B) |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_gift_tools.bench.refresh", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="Llama-600M at 64 ranks only")
    ap.add_argument("--json")
    ap.add_argument("--device")
    args = ap.parse_args(argv)
    run(
        args.quick,
        args.json,
        args.device,
        "python -m megatron_gift_tools.bench.refresh " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
