"""Machines: bandwidths, compute and the plugin's GPU-side assumptions, each with its source.

A ``Cluster`` field's source is its ``metadata["source"]`` (``sources``); the JSON of every run
records them. Bandwidths are per GPU and direction in B/s, latencies in seconds; NCCL's own
latencies are in ``nccl``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace


def sourced(default, source: str):
    """A dataclass field whose metadata names where its default comes from."""
    return field(default=default, metadata={"source": " ".join(source.split())})


@dataclass(frozen=True)
class Cluster:
    """One machine type: node shape, links, compute, HBM and how the plugin's kernels use it."""

    name: str = sourced("gh200", "preset name")
    gpus_per_node: int = sourced(
        4,
        """4 GH200 per node, one NIC per GPU: CSCS Alps (HPE Cray EX254n) and JSC
        JUPITER booster nodes (docs.cscs.ch/alps/hardware).""",
    )
    intra_bw: float = sourced(
        450e9,
        """NVLink 4 of the H100 die: 18 links x 25 GB/s = 450 GB/s per direction
        (NVIDIA H100 datasheet, 900 GB/s bidirectional); GH200 nodes: all-to-all between the node's 4 GPUs.""",
    )
    inter_bw: float = sourced(
        25e9,
        """one 200 Gb/s NIC per GPU (HPE Slingshot-11 on Alps; 4x NDR200
        InfiniBand on JUPITER) = 25 GB/s.""",
    )
    efficiency: float = sourced(
        0.8,
        """achieved fraction of link bandwidth of a large NCCL ring: assumed;
        NCCL's maintainers quote 46-48 GB/s busbw per 400 Gb/s NDR NIC (0.92-0.96, NVIDIA/nccl-tests#290),
        Slingshot through the aws-ofi-nccl plugin and loaded production fabrics reach less; 0.8 sits between.""",
    )
    a2a_nic_ratio: float = sourced(
        0.48,
        """achieved NIC bandwidth of the plugin's all-to-all relative to a
        ring's (``efficiency``), from the measurements cited: users report 20-25 GB/s alltoall busbw on 400 Gb/s
        NICs with 8 GPUs per node at 2-16 nodes (NVIDIA/nccl#1792, NVIDIA/nccl#2409), 0.42-0.54 of a tuned
        ring's 46-48 GB/s (NVIDIA/nccl-tests#290); 0.48 is the middle (22.5 over 47 GB/s). An all-to-all cannot
        aggregate the node's NICs and each peer's message is small (NCCL maintainer, NVIDIA/nccl-tests#267); the
        two-level exchange's inter-node all-to-all has one rank per node (rail-aligned), which those reports do
        not cover. A measured ratio goes in ``--a2a-efficiency``; every verdict prints the break-even.""",
    )
    a2a_nvlink_ratio: float = sourced(
        1.0,
        """the same for the NVLink part of an all-to-all: assumed equal to a
        ring's (the node's GPUs are connected directly or through NVSwitch; the limits above are the NIC's).""",
    )
    a2a_peer_latency: float = sourced(
        0.5e-6, "extra cost per peer of an all-to-all (one send/receive pair per peer): assumed."
    )
    latency_factor: float = sourced(
        1.0,
        """multiplies every latency of NCCL's model (``nccl``); 1: NCCL's own
        constants (src/graph/tuning.cc); the sensitivity moves it to 0.5 and 2.""",
    )
    latency_s: float | None = sourced(
        None,
        """a fixed latency per collective instead of NCCL's model (None); set
        only by the CPU validation to gloo's fitted intercept.""",
    )
    peak_flops: float = sourced(989e12, "dense BF16 tensor-core peak of the H100/GH200 GPU (NVIDIA datasheet).")
    mfu: float = sourced(0.4, "model-FLOP utilization: assumed, typical of Megatron on H100 for ~1B-parameter models.")
    hbm_bw: float = sourced(4.0e12, "HBM3 bandwidth of the 96 GB GH200 (NVIDIA datasheet).")
    gpu_memory: float = sourced(96e9, "HBM3 of the GH200 on Alps and JUPITER: 96 GB (NVIDIA datasheet).")
    codec_hbm_efficiency: float = sourced(
        0.6,
        """fraction of ``hbm_bw`` the plugin's memory-bound kernels (cast,
        sums, encode, decode) reach on the bytes they move (the meter's, not the essential ones): assumed;
        the fused kernels' target is 70% of copy bandwidth, and a device copy reaches about 85-90% of the
        datasheet peak on H100 (0.7 x 0.87 = 0.6); the GPU check measures it (gpu-codec.json).""",
    )
    codec_compute_overlap: float = sourced(
        0.0,
        """fraction of a codec kernel's time that runs under concurrent
        backward/forward compute without delaying it: assumed 0 (the GPU time-shared between the streams, a
        conservative bound; memory-bound kernels and GEMMs do overlap partly). The GPU check's profiler
        trace reports the share of codec work that overlaps the backward (docs/gpu-check.md).""",
    )
    launch_s: float = sourced(
        5e-6,
        """GPU time of one kernel launch of the plugin's small, memory-bound
        kernels beyond their bytes (launch latency, the grid's ramp-up and tail): assumed 5 us, the high end of
        the few microseconds a short kernel costs on H100-class GPUs, so that stages of many launches are not
        under-priced; not measured yet (the GPU check's profiler trace gives it). Each stage's launch count
        is the launch-and-traffic meter's (bench/results/launches-cpu.json, ``planner.metered``).""",
    )
    factor_build_s: float = sourced(
        7.0e-3,
        """one GIFT factor build (Nyström core of a [d_in, 64] sketch, d_in = 3456)
        without a ``bench overhead`` JSON of the GPU: what ``bench overhead`` measured on a 2-core EPYC CPU with one
        thread (bench/results/overhead-cpu.json, llama-600m fc2: 7.04 ms). The refresh builds it on the GPU, where
        it has not been measured yet; small latency-bound linear algebra, so the CPU figure stands in.""",
    )

    def __post_init__(self):
        positive = (
            "intra_bw",
            "inter_bw",
            "efficiency",
            "a2a_nic_ratio",
            "a2a_nvlink_ratio",
            "latency_factor",
            "peak_flops",
            "mfu",
            "hbm_bw",
            "gpu_memory",
            "codec_hbm_efficiency",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster.{name} must be > 0, got {getattr(self, name)!r}")
        if self.gpus_per_node < 1 or min(self.a2a_peer_latency, self.launch_s, self.factor_build_s) < 0:
            raise ValueError(f"Cluster: gpus_per_node must be >= 1 and latencies >= 0, got {self}")
        if not 0.0 <= self.codec_compute_overlap <= 1.0:
            raise ValueError(f"Cluster.codec_compute_overlap must be in [0, 1], got {self.codec_compute_overlap}")
        if self.latency_s is not None and self.latency_s < 0:
            raise ValueError(f"Cluster.latency_s must be >= 0 or None, got {self.latency_s}")


def sources() -> dict[str, str]:
    """Each ``Cluster`` field's source, from its metadata."""
    return {f.name: f.metadata["source"] for f in dataclasses.fields(Cluster)}


GH200 = Cluster()
CLUSTERS = {
    "gh200": GH200,
    "h100": replace(GH200, name="h100", gpus_per_node=8, inter_bw=50e9, hbm_bw=3.35e12, gpu_memory=80e9),
    "h100-100g": replace(GH200, name="h100-100g", gpus_per_node=8, inter_bw=12.5e9, hbm_bw=3.35e12, gpu_memory=80e9),
}
PRESET_SOURCES = {
    "gh200": "the Cluster defaults (field sources)",
    "h100": "DGX H100 / HGX H100 8-GPU (NVIDIA DGX H100 datasheet): NVSwitch, 450 GB/s NVLink per GPU and direction, "
    "8 ConnectX-7 400 Gb/s NICs (50 GB/s per GPU), H100 SXM 3.35 TB/s HBM3, 80 GB; the rest as gh200",
    "h100-100g": "8 H100 SXM per node with one 100 Gb/s NIC per GPU (12.5 GB/s, e.g. HDR100/100GbE rails): a "
    "hypothetical slower fabric, the rest as h100",
}
