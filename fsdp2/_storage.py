"""Where an unsharded parameter's memory comes from: one interface, two kinds.

Every unsharded parameter is a view into a padded, rank-major buffer (``_param.py``). Between
uses the buffer's memory goes back, but the buffer *object* must live on: autograd may hold
the unsharded parameter as a saved tensor, and the next all-gather refills the same memory
before backward reads it. So "free" never means "drop the tensor". The rest of the runtime
sees only this interface:

* ``tensor`` - the whole buffer, ``(shard_size * pad, ...)`` with the shard dim first;
* ``back()`` - give it memory, right before an all-gather writes into it;
* ``free()`` - give the memory back (the tensor keeps its storage object);
* ``is_allocated`` - whether it currently has memory.

[Note: free by resize] ``ResizableStorage`` shrinks the tensor's storage to zero bytes and
grows it back. Used on accelerators (the CUDA caching allocator reuses the memory), for small
CPU buffers, and in check mode. Reading a freed parameter raises (storage of size 0).

``MappedStorage`` (CPU, buffers of 1 MiB and more, where the kernel offers transparent huge
pages) keeps the buffer in a ``HostRegion`` of its own; freeing drops the pages and the root's
``PageBank`` may move them under the next parameter of the same size (see [Note: host
memory] in ``_host_memory.py``), unless something outside the runtime still references the
buffer ([Note: kept unsharded parameters] in ``_param.py``): a read of a freed parameter
through a tensor kept from forward then returns zeros or its own values, never another
parameter's. The check mode (``fully_shard(check_freed=True)`` on the root, or
``FSDP2_CHECK_FREED=1``) turns mappings off, so such reads raise instead.
"""

from __future__ import annotations

import abc
import math

import torch

from fsdp2 import _host_memory
from fsdp2._host_memory import HostRegion, PageBank


class UnshardedStorage(abc.ABC):
    """The memory behind one unsharded parameter's buffer (see the module notes).

    Example:
        >>> s = ResizableStorage((4, 3), torch.float32, torch.device("cpu"))
        >>> s.free(); s.is_allocated
        False
        >>> s.back(); s.tensor.fill_(1.0).sum().item()
        12.0
    """

    tensor: torch.Tensor
    nbytes: int

    @abc.abstractmethod
    def back(self, *, held_elsewhere: bool = False) -> None:
        """Give the buffer memory; the next all-gather writes into it. ``held_elsewhere``:
        something outside the runtime may read the buffer before the all-gather has filled
        it, so the memory given must not hold another parameter's bytes (zeros, or this
        buffer's own earlier values, are fine)."""

    @abc.abstractmethod
    def free(self) -> None:
        """Give the memory back; ``tensor`` keeps its storage object and addresses."""

    @property
    @abc.abstractmethod
    def is_allocated(self) -> bool:
        """Whether the buffer currently has memory."""


class ResizableStorage(UnshardedStorage):
    """Freed by resizing the storage to zero bytes ([Note: free by resize])."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.nbytes = self.tensor.numel() * self.tensor.element_size()

    def back(self, *, held_elsewhere: bool = False) -> None:
        storage = self.tensor.untyped_storage()
        if storage.size() != self.nbytes:
            storage.resize_(self.nbytes)
            if held_elsewhere and self.tensor.device.type == "cpu":
                # malloc may hand back another parameter's freed bytes; a storage write
                # leaves the tensors' version counters (autograd's check) alone
                storage.fill_(0)

    def free(self) -> None:
        self.tensor.untyped_storage().resize_(0)

    @property
    def is_allocated(self) -> bool:
        return self.tensor.untyped_storage().size() > 0 or self.nbytes == 0


class MappedStorage(UnshardedStorage):
    """A host mapping of its own whose pages a ``PageBank`` lends between parameters."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, bank: PageBank) -> None:
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.region = HostRegion(self.nbytes)
        self.tensor = self.region.tensor(dtype, tuple(shape))
        self._bank = bank

    def back(self, *, held_elsewhere: bool = False) -> None:
        if self._bank.acquire(self.region) and held_elsewhere:
            # another parameter's pages, still holding its bytes: clear them (cheaper than
            # faulting fresh pages in, which the kernel zeroes too)
            self.region.zero()

    def free(self) -> None:
        self._bank.release(self.region)

    @property
    def is_allocated(self) -> bool:
        return self.region.resident


def make_storage(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    bank: PageBank,
    *,
    mapped: bool = True,
) -> UnshardedStorage:
    """The storage kind for a buffer: a mapping for a large CPU buffer (when ``mapped`` and
    the kernel has huge pages), else a resizable tensor.

    Example:
        >>> type(make_storage((4,), torch.float32, torch.device("cpu"), PageBank())).__name__
        'ResizableStorage'
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if mapped and _host_memory.wants_mapping(nbytes, device):
        return MappedStorage(shape, dtype, bank)
    return ResizableStorage(shape, dtype, device)
