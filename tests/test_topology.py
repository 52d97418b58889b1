"""GPU <-> stage mapping by SGLang's placement rule and by explicit table."""

from __future__ import annotations

from gputrace.topology import sglang_node_placements, single_node_placements


def test_pp8_tp1_one_node() -> None:
    """PP8 TP1 on one node: stage p on GPU p."""
    assert sglang_node_placements(pp_size=8, tp_size=1) == [(p, p, 0) for p in range(8)]


def test_pp2_tp4_one_node() -> None:
    """PP2 TP4: stage 0 on GPUs 0-3, stage 1 on 4-7."""
    got = sglang_node_placements(pp_size=2, tp_size=4)
    assert [(g, p) for g, p, _ in got] == [(0, 0), (1, 0), (2, 0), (3, 0),
                                            (4, 1), (5, 1), (6, 1), (7, 1)]


def test_pp4_two_nodes() -> None:
    """PP4 TP2 over two nodes: node 1 holds stages 2 and 3 on its GPUs 0-3."""
    node1 = sglang_node_placements(pp_size=4, tp_size=2, nnodes=2, node_rank=1)
    assert node1 == [(0, 2, 0), (1, 2, 1), (2, 3, 0), (3, 3, 1)]


def test_tp_split_over_nodes() -> None:
    """PP1 TP16 over two nodes: each node holds half of the TP ranks."""
    node1 = sglang_node_placements(pp_size=1, tp_size=16, nnodes=2, node_rank=1)
    assert [t for _, _, t in node1] == list(range(8, 16))
    assert [g for g, _, _ in node1] == list(range(8))


def test_single_node_helper() -> None:
    """The single-node helper names the host."""
    assert single_node_placements("h", 2)[1].pp_rank == 1
