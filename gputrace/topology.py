"""Which GPU serves which pipeline stage: (host, gpu) <-> (pp_rank, tp_rank, dp_rank).

From SGLang's placement rule (``entrypoints/engine.py``; see shared ENGINES.md) or from an
explicit table in the configuration (read by gputrace.config, which builds these placements). The
mapping is stored in the run's meta so the report can show the one it used.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gputrace.errors import ConfigError, StoreError


@dataclass(frozen=True, slots=True)
class Placement:
    """One GPU's place in the deployment: the one shape for it (config, agent, collector, analysis)."""

    host: str
    gpu_index: int
    pp_rank: int
    tp_rank: int = 0
    dp_rank: int = 0


def sglang_node_placements(
    *,
    pp_size: int,
    tp_size: int,
    nnodes: int = 1,
    node_rank: int = 0,
    base_gpu_id: int = 0,
    gpu_id_step: int = 1,
) -> list[tuple[int, int, int]]:
    """(gpu_id, pp_rank, tp_rank) of every rank SGLang places on node ``node_rank``.

    gpu_id = base_gpu_id + (pp_rank % pp_per_node) * tp_per_node + (tp_rank % tp_per_node) * step,
    with pp_per_node = max(pp_size // nnodes, 1) and nnodes_per_pp_rank = max(nnodes // pp_size, 1).
    """
    if pp_size < 1 or tp_size < 1 or nnodes < 1:
        raise ConfigError(f"topology: pp_size, tp_size and nnodes must be >= 1 "
                          f"(got {pp_size}, {tp_size}, {nnodes})")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"topology: node_rank {node_rank} outside 0..{nnodes - 1}")
    pp_per_node = max(pp_size // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp_size, 1)
    tp_per_node = max(tp_size // nnodes_per_pp_rank, 1)
    pp_first = pp_per_node * (node_rank // nnodes_per_pp_rank)
    tp_first = tp_per_node * (node_rank % nnodes_per_pp_rank)
    out = []
    for pp_rank in range(pp_first, min(pp_first + pp_per_node, pp_size)):
        for tp_rank in range(tp_first, min(tp_first + tp_per_node, tp_size)):
            gpu_id = (base_gpu_id + (pp_rank % pp_per_node) * tp_per_node
                      + (tp_rank % tp_per_node) * gpu_id_step)
            out.append((gpu_id, pp_rank, tp_rank))
    return out


def sglang_placements(host: str, *, pp_size: int, tp_size: int, nnodes: int = 1, node_rank: int = 0,
                      base_gpu_id: int = 0, gpu_id_step: int = 1) -> list[Placement]:
    """The placements SGLang's rule gives the GPUs of ``host``, node ``node_rank`` of ``nnodes``."""
    return [Placement(host, gpu_id, pp_rank, tp_rank)
            for gpu_id, pp_rank, tp_rank in sglang_node_placements(
                pp_size=pp_size, tp_size=tp_size, nnodes=nnodes, node_rank=node_rank,
                base_gpu_id=base_gpu_id, gpu_id_step=gpu_id_step)]


def single_node_placements(host: str, pp_size: int, tp_size: int = 1) -> list[Placement]:
    """SGLang's placement on one node (the common case, and the simulator's)."""
    return sglang_placements(host, pp_size=pp_size, tp_size=tp_size)


def topology_to_meta(pp_size: int, tp_size: int, dp_size: int,
                     placements: Iterable[Placement], source: str) -> dict[str, Any]:
    """The form stored in meta.json's ``topology``; ``source`` says where the mapping came from."""
    return {
        "pp_size": pp_size,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "source": source,  # e.g. "sglang-formula", "explicit", "simulator"
        "placements": [asdict(p) for p in placements],
    }


def placements_from_meta(topology: Mapping[str, Any]) -> list[Placement]:
    """Inverse of :func:`topology_to_meta`."""
    rows: Sequence[Mapping[str, Any]] = topology.get("placements", [])
    out = []
    for i, row in enumerate(rows if isinstance(rows, list) else [rows]):
        try:
            out.append(Placement(**row))
        except TypeError as exc:  # not a mapping, or keys that are not a placement's
            raise StoreError(f"meta.json topology.placements[{i}]: not a placement ({row!a}): "
                             f"{exc}") from None
    return out
