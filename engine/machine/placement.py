"""Where to put a tensor-parallel server: GPU sets that share a NUMA node and the best link.

Given the GPU list and link matrix from `ddtree.engine.machine.hw` and the NUMA nodes from
`ddtree.engine.machine.host`, `suggest(...)` ranks every GPU set of the requested TP size and says how to pin
the server's CPUs and memory next to it (a `numactl` prefix, a CPU list for sched_setaffinity, and
CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ddtree.engine.errors import EngineError
from ddtree.engine.machine.host import NumaNode
from ddtree.engine.machine.hw import GpuInfo, format_cpulist, link_rank

# A GPU with this much memory held by other processes counts as busy.
BUSY_MEMORY_BYTES = 2 * 1024**3
MAX_COMBINATIONS = 200_000


class PlacementError(EngineError):
    """The TP size or GPU list cannot be placed (bad input)."""

    exit_code = 2


@dataclass(frozen=True)
class Placement:
    gpus: tuple[int, ...]
    numa_nodes: tuple[int, ...]  # nodes the GPUs sit on (empty when unknown)
    worst_link: str  # the slowest GPU-to-GPU path inside the set ("X" for one GPU)
    cpus: tuple[int, ...]  # CPUs local to the set, for sched_setaffinity / taskset
    numactl: tuple[str, ...]  # a command prefix; empty when pinning would not help
    env: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def cpulist(self) -> str:
        return format_cpulist(list(self.cpus))

    def to_dict(self) -> dict:
        return {
            "gpus": list(self.gpus),
            "numa_nodes": list(self.numa_nodes),
            "worst_link": self.worst_link,
            "cpus": self.cpulist,
            "numactl": list(self.numactl),
            "env": dict(self.env),
            "notes": list(self.notes),
        }


def _is_busy(gpu: GpuInfo) -> bool:
    return bool(gpu.processes) or (gpu.memory_used or 0) > BUSY_MEMORY_BYTES


def _score(combo: tuple[int, ...], gpus: dict[int, GpuInfo], links: list[list[str]]) -> tuple:
    nodes = {gpus[i].numa_node for i in combo}
    pair_ranks = [link_rank(links[a][b]) for a, b in itertools.combinations(combo, 2)]
    worst = max(pair_ranks) if pair_ranks else (-1, 0)
    total = tuple(sum(r[k] for r in pair_ranks) for k in (0, 1)) if pair_ranks else (0, 0)
    busy = sum(_is_busy(gpus[i]) for i in combo)
    degraded = sum(bool(gpus[i].pcie_degraded) for i in combo)
    # busy GPUs first (they are not free), then NUMA spread, then the slowest link, then all links
    return (busy, len(nodes), worst, total, degraded, combo)


def check_tp(tp: int) -> None:
    """Refuse a tensor-parallel size no machine could place."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise PlacementError(f"tensor-parallel size must be a positive integer, got {tp!r}")


def suggest(gpus: list[GpuInfo], links: list[list[str]], tp: int, *, numa: list[NumaNode] | None = None,
            limit: int = 3, exclude: tuple[int, ...] = ()) -> list[Placement]:
    """The best `limit` GPU sets of size `tp`, best first."""
    check_tp(tp)
    candidates = [g for g in gpus if g.index not in set(exclude)]
    if not gpus:
        raise PlacementError("no GPU to place on", "ddtree-console hw shows what NVML sees")
    if tp > len(candidates):
        raise PlacementError(f"tensor-parallel size {tp} needs {tp} GPUs, this machine has {len(candidates)} free",
                             "lower --tp or free some GPUs")
    if len(links) != len(gpus) or any(len(row) != len(gpus) for row in links):
        raise PlacementError("link matrix does not match the GPU list")
    if math.comb(len(candidates), tp) > MAX_COMBINATIONS:
        raise PlacementError(f"too many GPU sets to rank ({len(candidates)} choose {tp})")
    by_index = {g.index: g for g in gpus}
    order = sorted(itertools.combinations(sorted(g.index for g in candidates), tp),
                   key=lambda c: _score(c, by_index, links))
    return [_placement(c, by_index, links, numa or []) for c in order[:max(1, limit)]]


def _placement(combo: tuple[int, ...], gpus: dict[int, GpuInfo], links: list[list[str]],
               numa: list[NumaNode]) -> Placement:
    pairs = [links[a][b] for a, b in itertools.combinations(combo, 2)]
    worst = max(pairs, key=link_rank) if pairs else "X"
    nodes = sorted({gpus[i].numa_node for i in combo if gpus[i].numa_node is not None})
    notes = []
    unknown = [i for i in combo if gpus[i].numa_node is None]
    # CPUs near every GPU of the set: NVML's affinity masks, else the nodes' CPU lists.
    masks = [set(gpus[i].cpu_affinity) for i in combo if gpus[i].cpu_affinity]
    cpus: set[int] = set.intersection(*masks) if masks and len(masks) == len(combo) else set()
    if not cpus and nodes:
        for n in numa:
            if n.node in nodes:
                cpus.update(n.cpus)
    if not cpus and masks:
        cpus = set.union(*masks)
    numactl: tuple[str, ...] = ()
    all_nodes = sorted(n.node for n in numa)
    if unknown:
        notes.append(f"NUMA node unknown for GPU {','.join(map(str, unknown))}: not pinning")
    elif nodes and (len(all_nodes) <= 1 or nodes == all_nodes):
        notes.append("the set spans every NUMA node: pinning would not help")
    elif nodes:
        joined = ",".join(map(str, nodes))
        numactl = ("numactl", f"--cpunodebind={joined}", f"--membind={joined}")
    if len(nodes) > 1:
        notes.append(f"crosses NUMA nodes {','.join(map(str, nodes))}: GPU-to-GPU traffic goes over the CPU interconnect")
    busy = [i for i in combo if _is_busy(gpus[i])]
    if busy:
        notes.append(f"GPU {','.join(map(str, busy))} already in use")
    degraded = [i for i in combo if gpus[i].pcie_degraded]
    if degraded:
        notes.append(f"GPU {','.join(map(str, degraded))} has a degraded PCIe link")
    return Placement(
        gpus=combo,
        numa_nodes=tuple(nodes),
        worst_link=worst,
        cpus=tuple(sorted(cpus)),
        numactl=numactl,
        # NVML numbers GPUs in PCI bus order; CUDA's default order is "fastest first".
        env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, combo))},
        notes=tuple(notes),
    )
