"""All-reduce between ranks on different nodes as one all-gather and a local sum.

Why: across a network, gloo's all-reduce is a ring — a reduce-scatter, then an all-gather — so
even two ranks pay two dependent rounds of messages, where gloo's all-gather of two ranks is
one. A decode step issues its collectives one at a time with a few KiB to a few hundred KiB
each, so what it pays is mostly those rounds. So a group whose ranks sit on different nodes
all-reduces by gathering every rank's tensor (gloo's own all-gather) and adding the copies in
rank order on every rank — gloo's collectives, run on its worker thread, rather than
point-to-point swaps, which were slower back to back (docs/bench/HISTORY.md).

- **Bytes.** At two ranks the gather sends exactly the ring's bytes (the ring sends one half in
  each of its two steps); at ``p`` ranks ``(p - 1)`` tensors against the ring's
  ``2 (p - 1) / p``. Tensors over ``LARGE_BYTES`` (prefill's, not a decode step's) keep gloo's
  ring: there the rounds saved are small beside the transfer, and the gather's copy and sum are
  not (docs/INFERENCE.md, "Collectives across nodes").
- **The same bits on every rank.** Every rank adds the same copies in the same (rank) order; at
  two ranks that is gloo's one addition, so the bits are gloo's.
- All-gathers are gloo's already; backward passes (training) keep torch.distributed: their
  reduce-scatters do not go through a transport.
- A peer that died or stopped answering ends the collective with gloo's error (the process
  group's timeout applies), restated in one line that names the group's global ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deinfer_megatron.parallel import comm

LARGE_BYTES = 256 << 10  # over this, the all-reduce is gloo's ring


class GatherSum:
    """A cross-node group's raw collectives: all-reduce as all-gather + sum, gloo's all-gather."""

    def __init__(self, group: dist.ProcessGroup, *, large_bytes: int = LARGE_BYTES) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.large_bytes = large_bytes

    def _failed(self, op: str, err: RuntimeError) -> RuntimeError:
        first = (str(err).strip().splitlines() or ["no message"])[0]
        return RuntimeError(f"tensor-parallel {op} across nodes (global ranks {self.global_ranks}) failed "
                            f"({first}); a rank stopped or cannot be reached")

    def all_reduce(self, x: torch.Tensor) -> None:
        """In-place sum over the group of a contiguous ``x``."""
        try:
            if x.numel() * x.element_size() > self.large_bytes:
                dist.all_reduce(x, group=self.group)
                return
            every = torch.empty((self.size, x.numel()), dtype=x.dtype, device=x.device)
            comm._all_gather_flat(every, x.view(1, -1), group=self.group)
        except RuntimeError as err:
            raise self._failed("all-reduce", err) from None
        mine = x.view(-1)
        torch.add(every[0], every[1], out=mine)
        for row in every[2:]:
            mine.add_(row)

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out`` (``size`` × ``x`` along dim 0) = every rank's ``x`` in rank order."""
        try:
            comm._all_gather_flat(out, x, group=self.group)
        except RuntimeError as err:
            raise self._failed("all-gather", err) from None
