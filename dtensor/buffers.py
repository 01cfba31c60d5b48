"""Host buffers kept for reuse, handed out again only once nothing else uses them.

Collectives on CPU allocate the same large, short-lived buffers step after step, and
glibc's heap serves them badly (docs/parallel.md, "Collective buffers"; docs/fsdp2.md, "Host
memory on CPU"). Two keepers hold such buffers for reuse, on this one allocator:

* DTensor's collective workspace (``dtensor._workspace.Workspace``, one per mesh dim): every
  buffer it hands out stays kept; a request takes a free kept buffer of its exact size;
  a byte budget bounds it;
* fsdp2's ``BufferPool`` (one per training root): buffers come back with ``put`` once
  their collective finished; a request takes the smallest free one it fits in with little
  waste; at most ``keep`` are held.

fsdp2's ``PageBank`` (``fsdp2/_host_memory.py``) is not a third keeper: an unsharded
parameter keeps its mapping, and its addresses, for life (autograd may hold views of it), so
the bank never hands out a buffer; it moves freed *pages* under a parameter's own addresses
with ``mremap``. Its counterpart of the safety rule is ``FSDPParam.held_elsewhere()``: a
parameter something may still read gets pages but not another parameter's bytes.

[Note: the buffer safety rule] A kept buffer is handed out only while nothing but its
keeper references its storage: the storage's C++ reference count
(``torch._C._storage_Use_Count``, the check inductor's CUDA-graph trees make) counts every
tensor, view, autograd saved tensor and collective in flight over it, and the Python
reference count of its storage object counts a storage handle someone kept
(``t.untyped_storage()`` returns the keeper's own object). So a result that is still read -
or a buffer given back too early - is never handed out twice. Where torch lacks the use
count, no kept buffer is ever handed out (``can_tell_free()`` is False).

Example::

    >>> buf = KeptBuffer.new(1 << 20)
    >>> t = buf.tensor((256, 1024), torch.float32)
    >>> buf.is_free()
    False
    >>> del t
    >>> buf.is_free()
    True
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)

__all__ = ["KeptBuffer", "can_tell_free", "nbytes_of"]


def can_tell_free() -> bool:
    """Whether this torch can tell that nothing references a storage; without it, kept
    buffers are never handed out.

    Example::

        >>> can_tell_free()
        True
    """
    return _use_count is not None


def nbytes_of(shape, dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``.

    Example::

        >>> nbytes_of((4, 1024), torch.float32)
        16384
    """
    return math.prod(shape) * dtype.itemsize


@dataclass(eq=False)  # buffers are told apart by identity
class KeptBuffer:
    """One kept CPU storage of ``nbytes`` bytes; ``last_use`` is its keeper's clock.

    Example::

        >>> buf = KeptBuffer.new(4096)
        >>> buf.tensor((1024,), torch.float32).shape
        torch.Size([1024])
    """

    storage: torch.UntypedStorage
    nbytes: int
    last_use: int = 0

    @staticmethod
    def new(nbytes: int) -> KeptBuffer:
        """A buffer over a fresh CPU storage of ``nbytes`` (heap memory)."""
        storage = torch.empty(nbytes, dtype=torch.uint8, device="cpu").untyped_storage()
        return KeptBuffer(storage, nbytes)

    @staticmethod
    def of(t: torch.Tensor) -> KeptBuffer:
        """A buffer over ``t``'s whole storage (``t`` itself still references it)."""
        storage = t.untyped_storage()
        return KeptBuffer(storage, storage.nbytes())

    def is_free(self) -> bool:
        """[Note: the buffer safety rule] Whether nothing but the keeper references the
        storage: one C++ reference and one Python reference (this attribute;
        ``getrefcount`` adds its argument)."""
        if _use_count is None:
            return False
        return _use_count(self.storage._cdata) == 1 and sys.getrefcount(self.storage) == 2

    def left_the_keeper(self) -> bool:
        """Resized (e.g. freed by ``resize_(0)``) or moved to shared memory: not the
        keeper's to hand out any more."""
        return self.storage.nbytes() != self.nbytes or self.storage.is_shared()

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` over the start of the buffer."""
        if nbytes_of(shape, dtype) > self.nbytes:
            raise ValueError(
                f"KeptBuffer: {tuple(shape)} {dtype} needs {nbytes_of(shape, dtype)} bytes, "
                f"the buffer has {self.nbytes}."
            )
        empty = torch.empty(0, dtype=dtype, device=self.storage.device)
        return empty.set_(self.storage, 0, tuple(shape))
