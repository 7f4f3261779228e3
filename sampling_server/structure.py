"""Which graph structure a server samples from, its partition's in-edges or the whole
graph's (``ServerConfig.structure``), and whose features and labels it gathers itself
(``ServerConfig.features``), likewise.

``full`` joins every partition's structure files at start-up
(:func:`partitioner.joins.load_structure`): every hop of a batch is then drawn on the
server and no peer is asked to sample, with the same draws. ``auto`` (the default) takes
it where it costs little: every partition's structure files are under the server's
partition directory, the graph has more than one partition, and the joined arrays fit in
:data:`AUTO_MEMORY_FRACTION` of the memory they would live in (the host's available
memory, and for a CUDA sampler that keeps its graph in GPU memory, the GPU's free
memory too). Otherwise ``partition``. The choice and its reason are logged.

``features: full`` likewise joins every partition's ``x`` and ``y``
(:func:`partitioner.joins.load_node_data`): every row of a batch is then gathered on the
server, no peer asked for any; ``auto`` takes it by the same rule, measured after the
structure is loaded; a CUDA server takes it only with the whole structure (its feature
tables, every row then, hottest by in-degree in GPU memory, need that order). Plain and
typed graphs alike: every node type's and relation's files.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from partitioner.format import Manifest, PartitionFormatError, check_files
from partitioner.joins import node_data_bytes, node_data_records, structure_bytes, structure_records
from partitioner.npyio import FileRecord
from sampling_server.config import STRUCTURES

log = logging.getLogger(__name__)

#: The settings of ``structure`` and ``features``.
SETTINGS = STRUCTURES

#: Largest share of the available memory (host, and GPU where the graph goes there) that
#: ``structure: auto`` lets the whole graph's structure take.
AUTO_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class StructureChoice:
    """What a server samples from, and why."""

    #: ``partition`` or ``full``.
    mode: str
    #: One sentence for the log.
    reason: str


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_memory() -> tuple[int, int] | None:
    """The cgroup's (a container's) memory limit and use, where it has a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        return None if limit == "max" else (int(limit), current)
    except (OSError, ValueError):
        return None


def available_host_memory() -> int | None:
    """Bytes of memory this process may still take: ``MemAvailable`` of
    ``/proc/meminfo``, less where its cgroup (a container's limit) allows less; None
    where neither is known."""
    available = _meminfo("MemAvailable")
    cgroup = _cgroup_memory()
    if cgroup is not None:
        room = max(0, cgroup[0] - cgroup[1])
        available = room if available is None else min(available, room)
    return available


def total_host_memory() -> int | None:
    """Bytes of memory of this host (``MemTotal``), or of its cgroup's limit where that
    is less; None where neither is known."""
    total = _meminfo("MemTotal")
    cgroup = _cgroup_memory()
    if cgroup is not None:
        total = cgroup[0] if total is None else min(total, cgroup[0])
    return total


def _gib(n: float) -> str:
    """A byte count for the log: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def choose_structure(setting: str, manifest: Manifest, root: Path | str, *,
                     host_free: int | None, gpu_free: int | None = None) -> StructureChoice:
    """Resolve ``setting`` (``auto``, ``partition`` or ``full``) for a server of the graph
    in ``root``. ``host_free``: the host memory available (None: unknown, not limiting);
    ``gpu_free``: the GPU's free memory where the structure would be placed in it (None:
    it goes to host memory)."""
    if (settled := _settled("structure", setting, manifest)) is not None:
        return settled
    if setting == "full":
        return StructureChoice(setting, "as configured")
    return _auto("structure", "structure files", structure_records(manifest),
                 structure_bytes(manifest), root, host_free=host_free, gpu_free=gpu_free)


def choose_features(setting: str, manifest: Manifest, root: Path | str, *,
                    host_free: int | None, cuda_partition_structure: bool = False
                    ) -> StructureChoice:
    """Resolve the features ``setting`` (``auto``, ``partition`` or ``full``: whose
    features and labels the server gathers itself) for a server of the graph in ``root``,
    as :func:`choose_structure` does; ``host_free`` measured after the structure's choice
    was loaded. ``cuda_partition_structure``: the server samples on a GPU from its own
    partition's structure; its feature table is ordered by the in-degree of the nodes it
    holds, which it then knows for its own only (``auto`` means ``partition`` there;
    ``full`` is refused)."""
    if (settled := _settled("features", setting, manifest)) is not None:
        return settled
    if cuda_partition_structure:
        if setting == "full":
            raise ValueError("features: 'full' on a CUDA server needs the whole graph's "
                             "structure too (its feature table is ordered by the in-degree of "
                             "the nodes it holds); expected 'auto' or 'partition' with the "
                             "partition's own structure, got 'full'")
        return StructureChoice("partition", "auto: a CUDA server holding its partition's own "
                               "structure orders its feature table by its own nodes' in-degree")
    if setting == "full":
        return StructureChoice(setting, "as configured")
    return _auto("features", "feature and label files", node_data_records(manifest),
                 node_data_bytes(manifest), root, host_free=host_free, gpu_free=None)


def _settled(field: str, setting: str, manifest: Manifest) -> StructureChoice | None:
    """The choice a ``setting`` of ``field`` makes whatever the memory: ``partition`` as
    configured or for a graph of one partition (None: not settled yet)."""
    if setting not in SETTINGS:
        raise ValueError(f"{field}: expected one of {list(SETTINGS)}, got {setting!r}")
    if setting == "partition":
        return StructureChoice(setting, "as configured")
    if manifest.num_partitions == 1:
        return StructureChoice("partition", f"{setting}: one partition holds the whole graph")
    return None


def _auto(what: str, files: str, records: list[FileRecord], need: int, root: Path | str, *,
          host_free: int | None, gpu_free: int | None) -> StructureChoice:
    """``auto``'s rule for the whole graph's ``what``: ``full`` where every partition's
    ``records`` are under ``root`` (sizes and headers) and ``need`` bytes fit in
    :data:`AUTO_MEMORY_FRACTION` of the memory available."""
    try:
        check_files(root, records, "size")
    except PartitionFormatError as exc:
        return StructureChoice("partition", f"auto: not every partition's {files} are "
                               f"under the partition directory ({exc})")
    for where, free in (("host memory", host_free), ("GPU memory", gpu_free)):
        if free is not None and need > math.floor(AUTO_MEMORY_FRACTION * free):
            return StructureChoice("partition", f"auto: the whole graph's {what}, "
                                   f"{_gib(need)}, is more than {AUTO_MEMORY_FRACTION:.0%} of "
                                   f"the {_gib(free)} of {where} available")
    room = " and ".join(f"{_gib(free)} of {where}" for where, free in
                        (("host memory", host_free), ("GPU memory", gpu_free)) if free is not None)
    return StructureChoice("full", f"auto: every partition's {files} are here and "
                           f"take {_gib(need)}" + (f", within {AUTO_MEMORY_FRACTION:.0%} of "
                                                   f"the {room} available" if room else ""))
