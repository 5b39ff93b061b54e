"""Where a data-parallel group's ranks sit: nodes, local indices, and the subgroups of the
two-level exchange.

The node of each global rank comes from its host (``nodes_of_ranks``: one ``all_gather_object`` of
the host names at DDP construction; under ``srun``, which sets no ``LOCAL_WORLD_SIZE``, this is what
finds the nodes). ``--gift-ranks-per-node``, else ``LOCAL_WORLD_SIZE``, groups ``ranks_per_node``
consecutive global ranks to a node instead (torchrun's placement; the flag also simulates nodes on
one machine): a node of the flag's that spans two hosts is refused, one that only splits a host is a
layout choice (a warning where there are several hosts). A data-parallel group of ``p`` ranks holds
``g`` of them on each of ``n`` nodes (``p = n·g``; ``g`` is 1 when tensor parallelism fills a
node): its rank ``i`` is local index ``l = i mod g`` on node ``k = i div g``. Unequal counts per
node, or a node's ranks not consecutive in the group, are refused with a message.

Two-level exchange (``comm.hierarchical``) when ``n > 1`` and ``g > 1``: the *intra* group of a
rank is the ``g`` ranks of its node, its *inter* group the ``n`` ranks with its local index.
Otherwise the flat all-to-all over the whole group is already the right one (one node: every
byte stays inside; one rank per node: every byte must cross a NIC anyway).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``ranks_per_node`` ranks of one reduction group, grouped by index."""

    nodes: int
    ranks_per_node: int

    def __post_init__(self):
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def two_level(self) -> bool:
        """Whether an intra-node stage and an inter-node stage are both needed."""
        return self.nodes > 1 and self.ranks_per_node > 1

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def intra_ranks(self, rank: int) -> list[int]:
        """Group ranks on ``rank``'s node, in order."""
        k = self.node(rank)
        return list(range(k * self.ranks_per_node, (k + 1) * self.ranks_per_node))

    def inter_ranks(self, rank: int) -> list[int]:
        """Group ranks with ``rank``'s local index, one per node, in node order (= the shards
        whose node-partial sums ``rank`` holds after the intra-node stage)."""
        return list(range(self.local(rank), self.world, self.ranks_per_node))

    def link_bytes(self, rank: int, per_peer: list[int]) -> dict[str, int]:
        """``{"intra": …, "inter": …}`` of ``per_peer[j]`` bytes sent from ``rank`` to rank ``j``."""
        out = {"intra": 0, "inter": 0}
        for j, nbytes in enumerate(per_peer):
            if j != rank:
                out["intra" if self.node(j) == self.node(rank) else "inter"] += nbytes
        return out


def ranks_per_node_from_env(override: int | None = None) -> int | None:
    """Processes per node: ``override`` (``--gift-ranks-per-node``), else ``LOCAL_WORLD_SIZE``
    (set by torchrun), else None (unknown: all processes are taken to share one node)."""
    if override is not None:
        return override
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def host_name() -> str:
    """This process's host; a hook (tests replace it to simulate several hosts on one machine)."""
    return socket.gethostname()


def nodes_from_hosts(hosts: Sequence[str], override: int | None = None) -> list[int]:
    """The node index of each global rank from ``hosts[r]``, the host of global rank ``r``
    (nodes numbered by first appearance); with ``override`` (``--gift-ranks-per-node``) or else
    ``LOCAL_WORLD_SIZE``, ``r // ranks_per_node``, refused where one such node spans two hosts."""
    index = {h: k for k, h in enumerate(dict.fromkeys(hosts))}
    by_host = [index[h] for h in hosts]
    per_node = ranks_per_node_from_env(override)
    if per_node is None:
        return by_host
    source = "--gift-ranks-per-node" if override is not None else "LOCAL_WORLD_SIZE"
    claimed = [r // per_node for r in range(len(hosts))]
    spans = {k: sorted({hosts[r] for r in range(len(hosts)) if claimed[r] == k}) for k in set(claimed)}
    crossing = next(((k, h) for k, h in sorted(spans.items()) if len(h) > 1), None)
    if crossing is not None:
        raise ValueError(
            f"megatron-gift: {source}={per_node} puts global ranks {per_node * crossing[0]}.. on one node, but they "
            f"run on hosts {crossing[1]}: fix {source} (or drop it: the nodes are then taken from the hosts)"
        )
    if len(index) > 1 and len(set(claimed)) > len(index):
        logger.warning(
            "megatron-gift: %s=%d splits each of the %d hosts into several nodes (a layout choice: the intra-node "
            "stage stays inside each part)",
            source,
            per_node,
            len(index),
        )
    return claimed


def nodes_of_ranks(override: int | None = None) -> list[int] | int | None:
    """The node of every global rank (``nodes_from_hosts``), from one ``all_gather_object`` of the
    host names over the default group: call at construction, never in a step. Without a process
    group of several ranks, ``ranks_per_node_from_env(override)``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ranks_per_node_from_env(override)
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_name())
    return nodes_from_hosts(hosts, override)


def topology_of(global_ranks: list[int], ranks_per_node: int | Sequence[int] | None) -> Topology:
    """The topology of a group whose rank ``i`` is global rank ``global_ranks[i]``, with
    ``ranks_per_node`` processes per node (None: one node), or given the node of every global
    rank (a sequence, ``nodes_of_ranks``)."""
    p = len(global_ranks)
    if ranks_per_node is None:
        return Topology(1, p)
    if isinstance(ranks_per_node, int) and ranks_per_node < 1:
        raise ValueError(f"ranks per node must be >= 1, got {ranks_per_node}")
    if isinstance(ranks_per_node, int):
        nodes = [r // ranks_per_node for r in global_ranks]
    else:
        nodes = [ranks_per_node[r] for r in global_ranks]
    counts = {k: nodes.count(k) for k in nodes}
    if len(set(counts.values())) != 1:
        raise ValueError(
            f"megatron-gift: the data-parallel group {global_ranks} has unequal ranks per node "
            f"({counts}, nodes {_describe(ranks_per_node)}); the two-level exchange needs the same "
            "number on every node: fix --gift-ranks-per-node / LOCAL_WORLD_SIZE or the parallel layout"
        )
    g = p // len(counts)
    if any(nodes[i] != nodes[i - i % g] for i in range(p)):
        raise ValueError(
            f"megatron-gift: the data-parallel group {global_ranks} does not list each node's ranks "
            f"consecutively (nodes {_describe(ranks_per_node)}); the two-level exchange cannot order its shards"
        )
    return Topology(len(counts), g)


def _describe(ranks_per_node: int | Sequence[int]) -> str:
    if isinstance(ranks_per_node, int):
        return f"of {ranks_per_node} processes"
    return f"from the hosts: {list(ranks_per_node)}"


@dataclass(frozen=True)
class TwoLevelGroups:
    """A reduction group, its topology, and this rank's subgroups (None where the topology needs
    no two-level exchange): ``intra``, the ranks of its node; ``inter``, the ranks with its local
    index. Collectives on the three communicators are issued in an order that depends only on the
    bucket order (``comm.schedule``), the same on every rank."""

    group: object
    topology: Topology
    intra: object = None
    inter: object = None


_SUBGROUPS: dict[tuple, tuple] = {}  # (id of the default group, global ranks) -> (default group, subgroup)


def _subgroup(ranks: tuple[int, ...]):
    """The process group of ``ranks``, created on first use (every process calls this for every
    subgroup, in one order) and shared by every DDP instance (virtual-pipeline chunks) of the
    current default group (a new ``init_process_group`` starts afresh)."""
    world = dist.group.WORLD
    key = (id(world), ranks)
    if key not in _SUBGROUPS or _SUBGROUPS[key][0] is not world:
        _SUBGROUPS[key] = (world, dist.new_group(list(ranks)))
    return _SUBGROUPS[key][1]


_WARM: dict[int, object] = {}  # id -> subgroup warmed (held: an id is never reused for another)


def _warm(subgroups: list) -> None:
    """One 1-element all-reduce on each of this rank's new ``subgroups``, in the order every process
    created them (the same on every rank: no deadlock), so that a lazily initialised communicator
    (NCCL's) is set up here at construction, not inside the first backward's hooks (issue 35 item 5)."""
    for sub in subgroups:
        if id(sub) in _WARM:
            continue
        cuda = dist.get_backend(sub) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dist.all_reduce(torch.zeros(1, device=device), group=sub)
        _WARM[id(sub)] = sub


def build_groups(
    groups: list, ranks_per_node: int | Sequence[int] | None, two_level: bool = True
) -> list[TwoLevelGroups]:
    """``TwoLevelGroups`` of each of this rank's reduction ``groups`` (no subgroups unless ``two_level``).

    Collective over the default group (``new_group`` must be called by every process for every
    subgroup, in one order): every rank contributes its groups' global ranks, and the subgroups
    of all distinct groups are created (once per process) in sorted order."""
    own_groups = [tuple(dist.get_process_group_ranks(g)) for g in groups]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own_groups)
    split, created = {}, []
    for ranks in sorted({r for lists in everyone for r in lists}):
        topo = topology_of(list(ranks), ranks_per_node)
        if not (two_level and topo.two_level):
            continue
        for members in (topo.intra_ranks, topo.inter_ranks):
            for key in sorted({tuple(ranks[j] for j in members(i)) for i in range(topo.world)}):
                created.append((key, _subgroup(key)))
        split[ranks] = topo
    _warm([sub for key, sub in created if dist.get_rank() in key])
    out = []
    for g, ranks in zip(groups, own_groups):
        topo = split.get(ranks) or topology_of(list(ranks), ranks_per_node)
        if ranks not in split:
            out.append(TwoLevelGroups(g, topo))
            continue
        i = dist.get_rank(g)
        node, peers = tuple(ranks[j] for j in topo.intra_ranks(i)), tuple(ranks[j] for j in topo.inter_ranks(i))
        out.append(TwoLevelGroups(g, topo, _subgroup(node), _subgroup(peers)))
    return out
