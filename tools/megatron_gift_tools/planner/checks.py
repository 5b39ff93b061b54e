"""The byte model against ``bench comm``'s measured ledger (``bench/results/comm-cpu.json``): bytes
per rank per step, and by link on simulated nodes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from megatron_gift_tools.planner.choices import MegatronSchedule
from megatron_gift_tools.planner.cluster import GH200
from megatron_gift_tools.planner.model import step_time
from megatron_gift_tools.planner.options import Options
from megatron_gift_tools.planner.schemes import Scheme
from megatron_gift_tools.planner.workloads import LINEAR_KINDS, Workload

COMM_JSON = Path(__file__).resolve().parents[3] / "bench" / "results" / "comm-cpu.json"  # in a source checkout


def _prediction(
    doc: dict,
    mode: str,
    ranks: int,
    ranks_per_node: int,
    dist_opt: bool,
    refresh_interval: int,
    exchange: str = "flat",
    intra_node: str | None = None,
) -> dict:
    """``step_time`` of one ``bench comm`` configuration (its model: every parameter quantized, GIFT on every
    linear weight), ``ranks_per_node`` ranks on each simulated node."""
    spec, m = doc["spec"], doc["spec"]["model"]
    w = Workload(
        name="bench-comm",
        layers=m["num_layers"],
        hidden=m["hidden_size"],
        heads=m["num_attention_heads"],
        ffn=m["ffn_hidden_size"],
        seq=spec["seq"],
        micro_batch=spec["batch"],
        global_batch=spec["batch"] * ranks,
        vocab=spec["vocab"],
    )
    scheme = Scheme(mode.removesuffix("-e4m3") + ("-2level" if exchange == "two-level" else ""))
    opts = Options(
        schedule=MegatronSchedule.OVERLAP if dist_opt else MegatronSchedule.SYNC,
        gift_layers=LINEAR_KINDS,
        refresh_interval=refresh_interval,
        bucket_size=spec["bucket_size"],
        intra_dtype=intra_node or "bf16",
    )
    return step_time(w, replace(GH200, gpus_per_node=ranks_per_node), scheme, ranks, opts=opts)


def comm_bytes_check(path: str) -> list[dict]:
    """Predicted vs measured gradient bytes per step per rank of a ``bench comm`` JSON's runs on one node, and the
    refresh's statistics all-reduce. ``bench comm`` reads its ledger after ``finish_grad_sync``; a refresh's record
    all-gather is sent when the step closes (``RefreshSync.close_step``), after that, so its ledger holds the
    statistics all-reduce alone: that is what the refresh ratio compares (the model's records are in
    ``refresh_records``)."""
    doc = json.load(open(path))
    rows = []
    for r in doc["results"]:
        pred = _prediction(doc, r["mode"], r["ranks"], r["ranks"], r["distributed_optimizer"], r["refresh_interval"])
        stats = pred["refresh_statistics_bytes"]
        records = pred["refresh_bytes_per_rank"] * r["refresh_interval"] - stats
        rows.append(
            dict(
                ranks=r["ranks"],
                distributed_optimizer=r["distributed_optimizer"],
                mode=pred["mode"],
                measured=r["grad_bytes_per_step"],
                predicted=round(pred["grad_bytes_per_rank"]),
                ratio=pred["grad_bytes_per_rank"] / r["grad_bytes_per_step"],
                refresh_measured=r["refresh_bytes"],
                refresh_predicted=round(stats),
                refresh_records=round(records),
                refresh_ratio=stats / r["refresh_bytes"] if r["refresh_bytes"] else None,
            )
        )
    return rows


def comm_links_check(path: str) -> list[dict]:
    """Predicted vs measured gradient bytes per rank by link (``links`` of a ``bench comm --nodes`` JSON: flat
    and two-level exchanges on simulated nodes; the busiest rank). The flat all-reduce's FP8 all-gather is
    modeled as an NCCL ring, which the ledger counts as direct sends: those rows are marked ``ring_vs_direct``."""
    doc = json.load(open(path))
    rows = []
    for r in doc.get("links", []):
        p, g = r["nodes"] * r["ranks_per_node"], r["ranks_per_node"]
        pred = _prediction(doc, r["mode"], p, g, r["distributed_optimizer"], 10, r["exchange"], r["intra_node"])
        rows.append(
            dict(
                nodes=r["nodes"],
                ranks_per_node=g,
                distributed_optimizer=r["distributed_optimizer"],
                mode=pred["mode"],
                intra_node=r["intra_node"],
                ring_vs_direct=r["exchange"] == "flat" and not r["distributed_optimizer"],
                intra_ratio=pred["nvlink_bytes_per_rank"] / r["intra_per_rank"] if r["intra_per_rank"] else None,
                inter_ratio=pred["nic_bytes_per_rank"] / r["inter_per_rank"],
            )
        )
    return rows
