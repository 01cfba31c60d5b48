"""CommContext: the communication resources one training root owns.

Everything a step's collectives reuse lives here, one set per root ``fully_shard`` module, so
two models trained in one process never share buffers, pages, streams or queued reductions:

* ``streams`` - the gather and reduce CUDA streams (no-ops on CPU), see ``_streams.py``;
* ``pool`` - freed CPU collective buffers kept for the next group of the same shapes;
* ``pages`` - the ``PageBank`` lending freed unsharded parameters' pages, see
  ``_host_memory.py``;
* ``pending`` - gradient reductions in flight, at most ``max_pending`` at once;
* ``storage(...)`` - the factory for unsharded parameters' storage (``_storage.py``).

The root creates it at lazy init and hands it to every parameter group below it.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from device_mesh.switches import env_switch
from fsdp2._collectives import BufferPool
from fsdp2._host_memory import PageBank
from fsdp2._storage import UnshardedStorage, make_storage
from fsdp2._streams import CommStreams

logger = logging.getLogger(__name__)

# Reductions in flight at once, per device type. On CPU a new reduction first finishes the
# previous one and reuses its buffers (a second one in flight raised peak memory, see
# docs/fsdp2.md); on GPUs the next block's reduce-scatter overlaps the previous one's.
MAX_PENDING_REDUCES = {"cpu": 1}
DEFAULT_MAX_PENDING_REDUCES = 2


class CommContext:
    """The buffers, pages, streams and reductions in flight of one training root.

    Example:
        >>> comm = CommContext(torch.device("cpu"))
        >>> comm.max_pending
        1
    """

    def __init__(self, device: torch.device, *, check_freed: bool = False) -> None:
        self.device = device
        self.streams = CommStreams(device)
        # Enough for a gather (input and output) and a reduction (rows and receive buffer).
        self.pool = BufferPool(keep=4)
        self.no_pool = BufferPool(keep=0)  # groups whose buffer shapes no other group uses
        self.pages = PageBank()
        self.pending: deque = deque()
        self.max_pending = MAX_PENDING_REDUCES.get(device.type, DEFAULT_MAX_PENDING_REDUCES)
        # [Note: free by resize] check mode: no mappings, so reads of freed params raise.
        # fully_shard(check_freed=True) on the root turns it on; the environment variable
        # FSDP2_CHECK_FREED (1/true/yes/on or 0/false/no/off) overrides the argument, for a
        # run that cannot be edited.
        override = env_switch("FSDP2_CHECK_FREED", default=None)
        self.check_freed = check_freed if override is None else override
        self.post_optim_event = None
        if self.check_freed:
            logger.info("fsdp2 check mode: reads of freed unsharded parameters raise")

    def storage(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> UnshardedStorage:
        """Storage for one unsharded parameter's buffer (``_storage.make_storage``)."""
        return make_storage(shape, dtype, device, self.pages, mapped=not self.check_freed)

    def hold_pages_for(self, nbytes: int) -> None:
        """Let the page bank hold one group's unsharded bytes (the largest group's)."""
        self.pages.keep_bytes = max(self.pages.keep_bytes, nbytes)

    # ------------------------------------------------------------------------- reductions
    def make_room_for_reduce(self) -> None:
        """Finish the oldest reductions so that a new one keeps at most ``max_pending`` in
        flight (their buffers are then reused at once)."""
        while len(self.pending) >= self.max_pending:
            self._finish_one()

    def queue_reduce(self, pending) -> None:
        self.pending.append(pending)

    def drain_reduces(self) -> None:
        """Finish every reduction in flight and return the pooled buffers (idle until the
        next step's gathers, so the memory is better given back)."""
        while self.pending:
            self._finish_one()
        self.pool.clear()

    def discard_reduces(self) -> None:
        """Wait for the reductions in flight without installing their gradients (recovery
        after an exception: the failed iteration's gradients are dropped)."""
        while self.pending:
            self.pending.popleft().wait_only()
        self.pool.clear()

    def _finish_one(self) -> None:
        pending = self.pending.popleft()
        pending.group.finish_reduce(pending)

    # ------------------------------------------------------------------------- step end
    def end_of_backward(self) -> None:
        """Nothing gathers until the next forward: give the held pages back."""
        self.pages.clear()

    def take_post_optim_event(self):
        """The event set by ``set_post_optim_event`` (once), or None."""
        event, self.post_optim_event = self.post_optim_event, None
        return event
