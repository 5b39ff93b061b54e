"""Where a data-parallel group's ranks sit: nodes, local indices, and the subgroups of the
two-level exchange.

Processes are grouped as nodes by global rank index, ``ranks_per_node`` consecutive global
ranks to a node (how torchrun places them; ``LOCAL_WORLD_SIZE`` tells it, ``--gift-ranks-per-node``
overrides it, e.g. to simulate nodes on one machine). A data-parallel group of ``p`` ranks holds
``g`` of them on each of ``n`` nodes (``p = n·g``; ``g`` is 1 when tensor parallelism fills a
node): its rank ``i`` is local index ``l = i mod g`` on node ``k = i div g``. Unequal counts per
node, or a node's ranks not consecutive in the group, are refused with a message.

Two-level exchange (``comm.hierarchical``) when ``n > 1`` and ``g > 1``: the *intra* group of a
rank is the ``g`` ranks of its node, its *inter* group the ``n`` ranks with its local index.
Otherwise the flat all-to-all over the whole group is already the right one (one node: every
byte stays inside; one rank per node: every byte must cross a NIC anyway).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


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


def topology_of(global_ranks: list[int], ranks_per_node: int | None) -> Topology:
    """The topology of a group whose rank ``i`` is global rank ``global_ranks[i]``, with
    ``ranks_per_node`` processes per node (None: one node)."""
    p = len(global_ranks)
    if ranks_per_node is None:
        return Topology(1, p)
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node must be >= 1, got {ranks_per_node}")
    nodes = [r // ranks_per_node for r in global_ranks]
    counts = {k: nodes.count(k) for k in nodes}
    if len(set(counts.values())) != 1:
        raise ValueError(
            f"megatron-gift: the data-parallel group {global_ranks} has unequal ranks per node "
            f"({counts} with {ranks_per_node} processes per node); the two-level exchange needs the same "
            "number on every node: fix --gift-ranks-per-node / LOCAL_WORLD_SIZE or the parallel layout"
        )
    g = p // len(counts)
    if any(nodes[i] != nodes[i - i % g] for i in range(p)):
        raise ValueError(
            f"megatron-gift: the data-parallel group {global_ranks} does not list each node's ranks "
            f"consecutively ({ranks_per_node} processes per node); the two-level exchange cannot order its shards"
        )
    return Topology(len(counts), g)


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


def build_groups(groups: list, ranks_per_node: int | None, two_level: bool = True) -> list[TwoLevelGroups]:
    """``TwoLevelGroups`` of each of this rank's reduction ``groups`` (no subgroups unless ``two_level``).

    Collective over the default group (``new_group`` must be called by every process for every
    subgroup, in one order): every rank contributes its groups' global ranks, and the subgroups
    of all distinct groups are created (once per process) in sorted order."""
    own_groups = [tuple(dist.get_process_group_ranks(g)) for g in groups]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own_groups)
    split = {}
    for ranks in sorted({r for lists in everyone for r in lists}):
        topo = topology_of(list(ranks), ranks_per_node)
        if not (two_level and topo.two_level):
            continue
        for members in (topo.intra_ranks, topo.inter_ranks):
            for key in sorted({tuple(ranks[j] for j in members(i)) for i in range(topo.world)}):
                _subgroup(key)
        split[ranks] = topo
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
