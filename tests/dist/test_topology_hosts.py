"""Nodes from hosts (issue 35 item 4): under ``srun`` (no ``LOCAL_WORLD_SIZE``) the ranks' hosts give
the nodes, and a ``--gift-ranks-per-node`` / ``LOCAL_WORLD_SIZE`` whose node spans two hosts is refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_gift.comm import topology
from megatron_gift.comm.topology import Topology, build_groups, nodes_from_hosts, nodes_of_ranks
from megatron_gift.testing.spawn import run_on_ranks


@pytest.fixture
def no_lws(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_nodes_follow_the_hosts_without_a_flag(no_lws):
    """Catches srun's missing LOCAL_WORLD_SIZE read as one node (or one rank per node): a flat 512-way all-to-all."""
    assert nodes_from_hosts(["a", "a", "b", "b", "c", "c"]) == [0, 0, 1, 1, 2, 2]
    assert nodes_from_hosts(["b", "b", "a", "a"]) == [0, 0, 1, 1]


def test_a_flag_node_across_hosts_is_refused(no_lws, monkeypatch):
    """Catches a --gift-ranks-per-node (or LOCAL_WORLD_SIZE) whose intra-node stage would cross the network."""
    with pytest.raises(ValueError, match=r"--gift-ranks-per-node=4 .* hosts \['a', 'b'\]"):
        nodes_from_hosts(["a", "a", "b", "b"], 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3"):
        nodes_from_hosts(["a", "a", "b", "b"])


def test_a_flag_that_splits_hosts_is_a_layout_choice(no_lws, caplog):
    """Catches a refused simulation of nodes on one machine, or a silent split of real hosts."""
    assert nodes_from_hosts(["a"] * 4, 2) == [0, 0, 1, 1]  # simulating nodes on one machine: silent
    assert not caplog.records
    assert nodes_from_hosts(["a", "a", "b", "b"], 1) == [0, 1, 2, 3]
    assert "splits each of the 2 hosts" in caplog.text


def _on_ranks(rank, world):
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    out = {}
    topology.host_name = lambda: f"host{rank // 2}"  # the hook: 2 hosts x 2 ranks
    nodes = nodes_of_ranks(None)  # srun-like: no flag, no LOCAL_WORLD_SIZE
    out["nodes"] = nodes
    reduced, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda t, group=None, **kw: reduced.append(group) or all_reduce(t, group=group, **kw)
    (placed,) = build_groups([dist.group.WORLD], nodes)
    dist.all_reduce = all_reduce
    out["warmed"] = reduced == [placed.intra, placed.inter] or reduced == [placed.inter, placed.intra]
    out["topology"] = placed.topology
    x = torch.tensor([float(1 << rank)])
    dist.all_reduce(x, group=placed.intra)  # the intra group is this rank's host
    out["intra_sum"] = x.item()
    for flag, env in ((4, None), (None, "4")):
        if env is not None:
            os.environ["LOCAL_WORLD_SIZE"] = env
        try:
            nodes_of_ranks(flag)
            out[f"refused-{flag}-{env}"] = None
        except ValueError as e:
            out[f"refused-{flag}-{env}"] = str(e)
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    return out


def test_four_ranks_on_two_hosts():
    """Catches nodes not gathered from the hosts (the two-level exchange would run flat or across
    hosts), a disagreeing flag or LOCAL_WORLD_SIZE taken silently, and subgroups not warmed at
    construction (NCCL would set up their communicators inside the first backward)."""
    results = run_on_ranks(_on_ranks, 4, timeout=120)
    for rank, out in enumerate(results):
        assert out["nodes"] == [0, 0, 1, 1]
        assert out["topology"] == Topology(2, 2)
        assert out["warmed"]  # each subgroup's communicator set up at construction, once
        node = rank // 2
        assert out["intra_sum"] == float((1 << 2 * node) + (1 << 2 * node + 1))
        assert "--gift-ranks-per-node=4" in out["refused-4-None"]
        assert "LOCAL_WORLD_SIZE=4" in out["refused-None-4"]
