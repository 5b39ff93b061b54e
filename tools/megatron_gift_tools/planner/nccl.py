"""NCCL's own cost model, reduced to the collectives the planner prices.

Constants and formulas from NVIDIA/nccl at commit 5067397c (2026-06-11): ``src/graph/tuning.cc``
(``ncclTunerConstantsDefaults``, ``ncclTopoTuneModel``, ``ncclTopoGetAlgoTime``) for ring
reduce-scatter / all-gather / all-reduce and tree all-reduce, each at the fastest of its three
protocols (LL, LL128, Simple) as NCCL's tuner picks, and ``src/enqueue.cc`` (``addP2pToPlan``:
LL up to ``NCCL_P2P_LL_THRESHOLD`` = 16 KiB per channel, else Simple) for the point-to-point
sends of an all-to-all. A collective's time is NCCL's ``latency + bytes / algorithm bandwidth``,
with the bus bandwidth from the planner's link model (``bus_bandwidth``) instead of NCCL's
topology search.

Left out: the per-channel caps (LL128 36.7 GB/s and tree 36-41 GB/s per channel on Hopper: above
the links here at NCCL's usual channel counts), NVLS, CollNet and PAT (PAT runs only with one GPU
per node: the planner prices those groups with rings), the network plugin's own latency
(``latencyInter``: 0 for NCCL's InfiniBand and socket transports).
"""

from __future__ import annotations

import enum
import math

from megatron_gift_tools.planner.cluster import Cluster

SOURCE = "NVIDIA/nccl 5067397c (2026-06-11): src/graph/tuning.cc, src/enqueue.cc"
"""where the constants and formulas come from (recorded in every planner JSON)."""


class Proto(enum.Enum):
    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


LL, LL128, SIMPLE = Proto.LL, Proto.LL128, Proto.SIMPLE
BASE_US = {"ring": {LL: 6.6, LL128: 14.0, SIMPLE: 8.4}, "tree": {LL: 6.8, LL128: 14.0, SIMPLE: 8.4}}
"""``baseLatencies`` per algorithm and protocol (us)."""
HW_US = {
    ("nvlink", "ring"): {LL: 0.6, LL128: 1.9, SIMPLE: 3.4},
    ("nvlink", "tree"): {LL: 0.6, LL128: 1.25, SIMPLE: 4.0},
    ("net", "ring"): {LL: 2.7, LL128: 4.0, SIMPLE: 14.0},
    ("net", "tree"): {LL: 5.0, LL128: 8.5, SIMPLE: 14.0},
}
"""``hwLatencies`` per link, algorithm and protocol (us): one step of a ring or tree level."""
NET_OVERHEAD_US = 1.0
"""``getNetOverhead``: per-step host cost of a network ring, 1 us on Intel and non-x86 CPUs (Grace), 2 on AMD;
x3 for Simple."""
LL_MAX_GBPS = (141.0, 39.0, 20.4)
"""``llMaxBws``: LL's bus-bandwidth cap (GB/s) on one node (Hopper row), two nodes and more (Intel/other row)."""
P2P_LL_THRESHOLD = 16384
"""``NCCL_P2P_LL_THRESHOLD``: a point-to-point message up to this many bytes (per channel) goes LL."""
TREE_CORRECTION = {
    LL: (
        1.0,
        1.0,
        1.0,
        1.0,
        0.9,
        0.8,
        0.7,
        0.7,
        0.7,
        0.7,
        0.6,
        0.5,
        0.4,
        0.4,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        1.0,
        1.0,
        1.0,
        1.0,
    ),
    LL128: (
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        0.9,
        0.8,
        0.8,
        0.8,
        0.7,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.8,
        0.9,
        0.9,
        0.9,
        0.9,
        1.0,
        1.0,
    ),
    SIMPLE: (
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.8,
        0.7,
        0.6,
        0.6,
        0.5,
        0.5,
        0.5,
        0.5,
        0.6,
        0.7,
        0.8,
        0.7,
        0.7,
        0.8,
        0.9,
        0.9,
    ),
}
"""``treeCorrectionFactor``: tree all-reduce bandwidth factor by ``log2(bytes / 64)`` (0-22)."""
RING_AR_PLATEAU = 1.4
"""``ncclTopoGetAlgoTime``: a multi-node ring all-reduce in Simple pays 1.4x its latency (compute capability
>= 8.0) once it carries at least 64 B per rank and channel (every all-reduce priced here does, at NCCL's
at most 32 channels)."""


def _us(c: Cluster, us: float) -> float:
    return c.latency_s if c.latency_s is not None else us * 1e-6 * c.latency_factor


def bus_bandwidth(c: Cluster, p: int, g: int) -> float:
    """Bus bandwidth (B/s) of a ring over ``p`` ranks, ``g`` per node, each with its own NIC: NVLink and NIC
    phases pipelined, ``1/g`` of what a rank sends crosses its NIC, the slower phase sets the rate."""
    multi = 1.0 if p > g else 0.0
    per_byte = max((1 - multi / g) / c.intra_bw, multi / (g * c.inter_bw))
    return c.efficiency / per_byte


def _ring_latency_us(proto: Proto, steps: int, inter_steps: int, nodes: int, ppn: int) -> float:
    intra = HW_US["nvlink", "ring"][proto]
    if nodes > 1:
        intra = max(intra, NET_OVERHEAD_US * (3 if proto is SIMPLE else 1))
    inter = HW_US["net", "tree" if ppn == 1 else "ring"][proto]
    return BASE_US["ring"][proto] + (steps - inter_steps) * intra + inter_steps * inter


def _protocol_bus(proto: Proto, bus: float, nodes: int) -> float:
    """Ring bus bandwidth of ``proto``: LL half the link (capped), LL128 120/128 of it, Simple all."""
    if proto is LL:
        return min(LL_MAX_GBPS[min(nodes, 3) - 1] * 1e9, 0.5 * bus)
    return bus * (0.92 if proto is LL128 else 1.0)


def ring_time(kind: str, nbytes: float, p: int, g: int, c: Cluster) -> float:
    """NCCL ring ``kind`` (``reduce_scatter``, ``all_gather``, ``all_reduce`` or ``broadcast``) of an ``nbytes``
    buffer over ``p`` ranks, ``g`` per node, at its fastest protocol (a broadcast: ``p - 1`` pipelined steps,
    every link carrying the whole buffer)."""
    if p == 1:
        return 0.0
    g = min(g, p)
    nodes = math.ceil(p / g)
    twice = 2 if kind == "all_reduce" else 1
    steps, inter_steps = twice * (p - 1), twice * (nodes - 1)
    bus = bus_bandwidth(c, p, g)
    best = math.inf
    for proto in Proto:
        lat = _ring_latency_us(proto, steps, inter_steps, nodes, p // nodes)
        if kind == "all_reduce" and proto is SIMPLE and nodes > 1:
            lat *= RING_AR_PLATEAU
        moved = nbytes if kind == "broadcast" else nbytes * steps / p
        best = min(best, _us(c, lat) + moved / _protocol_bus(proto, bus, nodes))
    return best


def tree_all_reduce_time(nbytes: float, p: int, g: int, c: Cluster) -> float:
    """NCCL tree all-reduce (reduce up, broadcast down a tree of nodes, a chain inside each) at its fastest
    protocol: latency ``2·((p/n - 1)·intra + floor(log2 n)·inter)``, algorithm bandwidth half the bus's."""
    if p == 1:
        return 0.0
    g = min(g, p)
    nodes = math.ceil(p / g)
    bus = 0.92 * bus_bandwidth(c, p, g)
    log_size = int(math.log2(max(nbytes / 64, 1)))
    best = math.inf
    for proto in Proto:
        lat = BASE_US["tree"][proto] + 2 * (
            (p // nodes - 1) * HW_US["nvlink", "tree"][proto] + int(math.log2(nodes)) * HW_US["net", "tree"][proto]
        )
        if proto is LL:
            proto_bus = min(bus / 3.8, LL_MAX_GBPS[min(nodes, 3) - 1] * 1e9)
        else:
            proto_bus = bus * ((120 / 128 if nodes > 1 else 7 / 9) if proto is LL128 else 1.0)
        if log_size < len(TREE_CORRECTION[proto]):
            proto_bus *= TREE_CORRECTION[proto][log_size]
        best = min(best, _us(c, lat) + nbytes / (0.5 * proto_bus))
    return best


def all_reduce_time(nbytes: float, p: int, g: int, c: Cluster) -> float:
    """NCCL all-reduce: the faster of ring and tree, as its tuner picks."""
    return min(ring_time("all_reduce", nbytes, p, g, c), tree_all_reduce_time(nbytes, p, g, c))


def p2p_protocol(message_bytes: float) -> Proto:
    return LL if message_bytes <= P2P_LL_THRESHOLD else SIMPLE


def all_to_all_time(nbytes: float, p: int, g: int, c: Cluster) -> float:
    """All-to-all in which each rank sends ``nbytes/p`` to each other rank (the self message skipped), ``g``
    per node: one point-to-point step of NCCL's latency at the protocol of the message size plus a cost per
    peer, and the NVLink part (``(g-1)/p`` of the bytes) and NIC part (``(p-g)/p``) concurrent, each at
    ``efficiency`` times the all-to-all's ratio to a ring (LL: half the link, as a ring's)."""
    if p == 1:
        return 0.0
    g = min(g, p)
    proto = p2p_protocol(nbytes / p)
    link = "net" if p > g else "nvlink"
    latency = _us(c, BASE_US["ring"][proto] + HW_US[link, "ring"][proto]) + (p - 1) * c.a2a_peer_latency
    half = 0.5 if proto is LL else 1.0
    intra = (g - 1) / p * nbytes / (c.intra_bw * c.efficiency * c.a2a_nvlink_ratio * half)
    inter = (p - g) / p * nbytes / (c.inter_bw * c.efficiency * c.a2a_nic_ratio * half)
    return latency + max(intra, inter)


def neighbour_exchange_time(across_nodes: bool, c: Cluster) -> float:
    """GIFT's cut-row exchange: an all-to-all whose splits are non-zero only for the 1-2 neighbour ranks that
    hold the rest of a row (r floats per cut row): one LL point-to-point latency, over the network when a
    neighbour is on another node."""
    link = "net" if across_nodes else "nvlink"
    return _us(c, BASE_US["ring"][LL] + HW_US[link, "ring"][LL]) + 2 * c.a2a_peer_latency
