"""Which GPU serves which pipeline stage: (host, gpu) <-> (pp_rank, tp_rank, dp_rank).

From SGLang's placement rule (``entrypoints/engine.py``; see shared ENGINES.md) or from an
explicit table in the configuration (read by gputrace.config, which builds these placements). The
mapping is stored in the run's meta so the report can show the one it used.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypedDict, TypeGuard

from gputrace.errors import ConfigError, StoreError

# The largest pipeline, tensor or data parallel size (and node count) gputrace takes from any
# input (config, log, meta.json, command line): far beyond any deployment (the largest run
# PP x TP in the tens), and small enough that what is built per stage or GPU stays small (a
# pp_size of 10^9 from a config built placements until the collector held 2.8 GB).
MAX_PARALLEL_SIZE = 1024
MAX_GPUS = 65_536  # pp x tp x dp: the GPUs of one deployment
MAX_GPU_INDEX = 1023  # a GPU's index on its host (NVML numbers a node's GPUs from 0; nodes hold 8 or 16)


def is_parallel_size(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a parallel size gputrace takes: an integer from 1 to MAX_PARALLEL_SIZE."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_PARALLEL_SIZE


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
    if not all(is_parallel_size(v) for v in (pp_size, tp_size, nnodes)):
        raise ConfigError(f"topology: pp_size, tp_size and nnodes must be 1 to {MAX_PARALLEL_SIZE} "
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


class MetaPlacement(TypedDict):
    """A :class:`Placement` as meta.json's ``topology.placements`` holds it."""

    host: str
    gpu_index: int
    pp_rank: int
    tp_rank: int
    dp_rank: int


class MetaTopology(TypedDict):
    """meta.json's ``topology``: the sizes, where the mapping came from, and every GPU's place."""

    pp_size: int
    tp_size: int
    dp_size: int
    source: str
    placements: list[MetaPlacement]


def topology_to_meta(pp_size: int, tp_size: int, dp_size: int,
                     placements: Iterable[Placement], source: str) -> MetaTopology:
    """The form stored in meta.json's ``topology``; ``source`` says where the mapping came from."""
    return {
        "pp_size": pp_size,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "source": source,  # e.g. "sglang-formula", "explicit", "simulator"
        "placements": [MetaPlacement(host=p.host, gpu_index=p.gpu_index, pp_rank=p.pp_rank,
                                     tp_rank=p.tp_rank, dp_rank=p.dp_rank) for p in placements],
    }


def check_meta_topology(topology: Mapping[str, object]) -> None:
    """StoreError naming the field when meta.json's topology holds a size gputrace does not take
    (negative, zero, past MAX_PARALLEL_SIZE, not an integer) or a placement outside them."""
    for name in ("pp_size", "tp_size", "dp_size"):
        value = topology.get(name)
        if value is not None and not is_parallel_size(value):
            raise StoreError(f"meta.json topology.{name}: {value!a} is not a parallel size "
                             f"(an integer from 1 to {MAX_PARALLEL_SIZE})")
    placements_from_meta(topology)


def placements_from_meta(topology: Mapping[str, object]) -> list[Placement]:
    """Inverse of :func:`topology_to_meta`, on meta.json's ``topology`` as read; StoreError for a row
    that is no placement or whose ranks fall outside the sizes (a rank from 0 to size - 1)."""
    rows = topology.get("placements", [])
    sizes = {name: topology.get(f"{name[:2]}_size") for name in ("pp_rank", "tp_rank", "dp_rank")}
    out = []
    for i, row in enumerate(rows if isinstance(rows, list) else [rows]):
        try:
            if not isinstance(row, dict):
                raise TypeError(f"a {type(row).__name__}, not an object")
            placement = Placement(**row)
        except TypeError as exc:  # not a mapping, or keys that are not a placement's
            raise StoreError(f"meta.json topology.placements[{i}]: not a placement ({row!a}): "
                             f"{exc}") from None
        for name, size in sizes.items():
            rank = getattr(placement, name)
            limit = size if is_parallel_size(size) else MAX_PARALLEL_SIZE
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < limit:
                raise StoreError(f"meta.json topology.placements[{i}].{name}: {rank!a} is outside "
                                 f"0 to {limit - 1}")
        out.append(placement)
    return out
