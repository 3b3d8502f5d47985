"""Which transport carries each tensor-parallel group's collectives, chosen once at group setup.

``Collectives.AUTO`` (the default of every command): on a CPU (gloo) job, the ranks of a
tensor-parallel group that share a node talk through a shared-memory segment
(``parallel.shm``); when the group also spans nodes the collectives are hierarchical — the local
sum or gather in shared memory, then one collective between the ranks of the same local index on
each node (every local rank holds the node's result, so no broadcast is needed). What crosses
nodes — a group with one rank per node, or the cross-node step of a hierarchical one —
all-reduces as one all-gather and a local sum (``parallel.exchange``: one round of messages
where gloo's ring all-reduce makes two at two nodes). An NCCL job (tensors on GPUs), a group
whose ranks are not in equal per-node blocks, or an unsupported machine keeps torch.distributed.
``Collectives.PROCESS_GROUP`` keeps torch.distributed for every group (``--collectives
process-group``).

A *node* is a machine and network namespace (hostname, boot id, ``/proc/self/ns/net``): ranks in
two namespaces of one machine count as two nodes, which is how the two-namespace tests emulate a
cluster.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from deinfer_megatron.parallel import comm, exchange, shm

log = logging.getLogger(__name__)


class Collectives(str, enum.Enum):
    AUTO = "auto"  # shared memory between the CPU ranks of a node, the process group beyond
    PROCESS_GROUP = "process-group"  # torch.distributed (gloo / NCCL) for everything

    @classmethod
    def parse(cls, value: "str | Collectives") -> "Collectives":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown collectives {value!r}; choose one of "
                             f"{', '.join(c.value for c in cls)}") from None


def node_key() -> str:
    """What identifies this rank's node: hostname, boot id and network namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = ""
    return f"{socket.gethostname()}|{boot}|{netns}"


@dataclass(frozen=True)
class GroupShape:
    """How one tensor-parallel group's ranks lie on nodes: ``nodes`` blocks of ``local`` ranks.

    ``None`` from ``of`` when the ranks are not in equal, consecutive per-node blocks (then the
    hierarchy would reorder an all-gather; such a group keeps the process group).
    """

    nodes: int
    local: int

    @classmethod
    def of(cls, keys: list[str]) -> "GroupShape | None":
        """``keys[i]``: the node key of the group's i-th rank."""
        blocks: list[list[str]] = []
        for key in keys:
            if blocks and blocks[-1][0] == key:
                blocks[-1].append(key)
            else:
                blocks.append([key])
        if len({b[0] for b in blocks}) != len(blocks) or len({len(b) for b in blocks}) != 1:
            return None
        return cls(len(blocks), len(blocks[0]))


class Hierarchical:
    """Local shared memory, then the cross-node collective of this local index."""

    def __init__(self, local: shm.ShmCollectives, cross: dist.ProcessGroup) -> None:
        self.local, self.cross = local, exchange.GatherSum(cross)

    def all_reduce(self, x: torch.Tensor) -> None:
        self.local.all_reduce(x)
        self.cross.all_reduce(x)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> None:
        node = torch.empty((self.local.size * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        self.local.all_gather(node, x)
        self.cross.all_gather(out, node)


@dataclass
class Installed:
    """What ``install`` set up, for ``uninstall``; ``kind`` says what carries the group's
    collectives: "shared-memory", "hierarchical" (shared memory, then across nodes),
    "gather-sum" (one rank per node, ``parallel.exchange``) or "process-group"."""

    group: dist.ProcessGroup | None = None
    segment: shm.ShmCollectives | None = None
    kind: str = "process-group"


def install(tp_group: dist.ProcessGroup, mode: Collectives, *, timeout_s: float,
            slot_bytes: int = shm.DEFAULT_SLOT_BYTES) -> Installed:
    """Choose and register the transport of this rank's tensor-parallel group.

    Collective over the whole job (every rank calls it, in the same order): the node keys and
    groups are exchanged over the default group, and any cross-node groups are created by all.
    """
    mode = Collectives.parse(mode)
    if mode is Collectives.PROCESS_GROUP or dist.get_backend() != "gloo" or dist.get_world_size() == 1:
        return Installed()
    mine = {"key": node_key(), "tp": dist.get_process_group_ranks(tp_group),
            "name": shm.new_segment_name(), "ok": shm.supported()}
    every: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    shared = all(e["ok"] for e in every)  # the same answer on every rank
    rank = dist.get_rank()
    installed = Installed()
    for ranks in sorted({tuple(e["tp"]) for e in every}):  # the same order on every rank
        shape = GroupShape.of([every[r]["key"] for r in ranks])
        if shape is None or len(ranks) == 1:
            continue
        if shape.local == 1:  # one rank per node: nothing to share, only the link to cross
            if rank in ranks:
                comm.use_transport(tp_group, exchange.GatherSum(tp_group))
                installed = Installed(tp_group, None, "gather-sum")
                _LIVE.append(installed)
                log.info("tensor-parallel collectives: all-reduce as all-gather + sum between %d nodes", len(ranks))
            continue
        if not shared:
            continue
        cross = None
        if shape.nodes > 1:  # every rank creates every cross group, in the same order
            for j in range(shape.local):
                g = dist.new_group([ranks[i * shape.local + j] for i in range(shape.nodes)])
                if rank in ranks and ranks.index(rank) % shape.local == j:
                    cross = g
        if rank in ranks:
            installed = _share(tp_group, list(ranks), shape, every, cross, slot_bytes, timeout_s)
    return installed


def _share(tp_group: dist.ProcessGroup, ranks: list[int], shape: GroupShape, every: list[dict],
           cross: dist.ProcessGroup | None, slot_bytes: int, timeout_s: float) -> Installed:
    """Map this node's segment of ``tp_group`` (this rank is in ``ranks``) and route the group
    through it, hierarchically over ``cross`` when the group spans nodes."""
    index = ranks.index(dist.get_rank())
    first = index - index % shape.local
    names = [f"tensor-parallel rank {i} (global rank {ranks[i]})" for i in range(first, first + shape.local)]
    segment = shm.ShmCollectives(every[ranks[first]]["name"], index % shape.local, shape.local,
                                 create=index == first, slot_bytes=slot_bytes, timeout_s=timeout_s, names=names)
    if index == first:
        segment.unlink()  # every member has mapped it: nothing is left in /dev/shm
    dist.barrier(group=tp_group)  # ... by the time any member goes on
    comm.use_transport(tp_group, segment if cross is None else Hierarchical(segment, cross))
    installed = Installed(tp_group, segment, "shared-memory" if cross is None else "hierarchical")
    _LIVE.append(installed)
    log.info("tensor-parallel collectives: shared memory among %d local ranks%s", shape.local,
             "" if cross is None else f", then over {shape.nodes} nodes")
    return installed


_LIVE: list[Installed] = []  # installed in this process, for uninstall_all at shutdown


def uninstall(installed: Installed) -> None:
    """Back to torch.distributed for the group; the segment is unmapped."""
    if installed.group is not None:
        comm.use_transport(installed.group, None)
    if installed.segment is not None:
        installed.segment.close()
    if installed in _LIVE:
        _LIVE.remove(installed)


def uninstall_all() -> None:
    """Everything ``install`` set up in this process (``runtime.shutdown``)."""
    for installed in list(_LIVE):
        uninstall(installed)
