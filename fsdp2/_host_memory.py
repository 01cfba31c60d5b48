"""Host memory for fsdp2's large, short-lived CPU buffers: mappings of their own.

[Note: host memory] Every block of a training step allocates and frees, on CPU, buffers the
size of the block's parameters: the unsharded parameters and the blocks a gradient reduction
receives (and, on the staged route, the all-gather input and output and the gradient rows). Once glibc's dynamic mmap threshold has risen (it follows the largest
freed block, up to 32 MiB), malloc serves all of them from its main heap, and smaller
allocations (activations, autograd's gradients) then carve up the holes they leave.
The heap then holds hundreds of MB it cannot return (docs/fsdp2.md, "Host memory on CPU").

So on CPU these buffers live outside the heap, each in an anonymous private mapping:

* a buffer that is dropped is unmapped at once (its pages go back to the kernel);
* an unsharded parameter keeps its mapping for its whole life - autograd may hold views of
  it between forward and backward, which is why freeing never replaces its storage - and
  "freeing" it drops the pages with ``MADV_DONTNEED``: the addresses stay valid, the memory
  goes back to the kernel, and the next all-gather writes into fresh zero pages;
* the mappings ask for transparent huge pages, so refilling costs one fault per 2 MiB
  instead of one per 4 KiB.

Faults still cost (see docs/fsdp2.md for the measurements). Yet the next block's parameters
have the same sizes as the ones just freed, so a ``PageBank`` (one per training root, held by
its ``CommContext``) holds freed parameters' pages back for a moment and moves them, with
``mremap``, under the next parameter of the same size just before its all-gather writes into
it: no copy, no fault, no zeroing. The most recently freed go first, the bank holds at most
one group's worth (the largest), and it is emptied at the end of backward, so resident
memory stays what it was. ``_storage.MappedStorage`` is the only user of both classes.

Where the kernel offers no transparent huge pages (``never``), faults would cost more than
the heap wastes, so every buffer stays on torch's allocator. Buffers below ``MIN_BYTES`` also
stay there: malloc handles small blocks well.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 20
_PAGE = mmap.PAGESIZE
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def huge_pages_available() -> bool:
    """Whether the kernel hands out transparent huge pages to a mapping that asks."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def wants_mapping(nbytes: int, device: torch.device) -> bool:
    """Whether a buffer of ``nbytes`` on ``device`` should get a mapping of its own."""
    return device.type == "cpu" and nbytes >= MIN_BYTES and huge_pages_available()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class HostRegion:
    """``nbytes`` of host memory in an anonymous mapping that starts on a huge page.

    ``tensor()`` views the region; the mapping lives as long as any such view. ``drop()``
    returns the pages to the kernel and keeps the addresses (reads then see zeros until the
    region is written again).

    Example::

        >>> region = HostRegion(8 << 20)
        >>> t = region.tensor(torch.float32, (1024, 2048))
        >>> t.fill_(1.0).sum().item()
        2097152.0
        >>> region.drop()  # resident memory goes down by 8 MiB; t still has its addresses
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._span = _round_up(max(nbytes, 1), _PAGE)
        # One huge page of slack lets the used part start on a huge-page boundary; the
        # untouched slack never becomes resident.
        self._map = mmap.mmap(
            -1, self._span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        self._offset = (-base) % HUGE_PAGE
        self._address = base + self._offset
        whole = (nbytes // HUGE_PAGE) * HUGE_PAGE  # only whole huge pages: no rounding waste
        # madvise splits the mapping there, and mremap moves one piece at a time.
        self._pieces = [
            (start, end) for start, end in ((0, whole), (whole, self._span)) if end > start
        ]
        if whole and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self._offset, whole)
            except OSError:  # a kernel built without transparent huge pages
                pass
        self.resident = True

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` over the start of the region (it keeps the mapping alive)."""
        count = math.prod(shape) * dtype.itemsize
        if count > self.nbytes:
            raise ValueError(f"HostRegion: {shape} {dtype} needs {count} bytes, has {self.nbytes}")
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=count, offset=self._offset)
        return raw.view(dtype).view(shape)

    def drop(self) -> None:
        """Give the pages back to the kernel (``MADV_DONTNEED``); the addresses stay valid."""
        self._map.madvise(mmap.MADV_DONTNEED, self._offset, self._span)
        self.resident = False

    def zero(self) -> None:
        """Write zeros over the region (its pages stay resident)."""
        ctypes.memset(self._address, 0, self.nbytes)

    def touch(self) -> None:
        """Mark the region in use again (its pages come back as they are written)."""
        self.resident = True

    def take_pages_of(self, donor: HostRegion) -> bool:
        """Move ``donor``'s pages under this region's addresses (``mremap``, no copy), where
        this region's own pages were dropped; ``donor`` keeps its addresses, now empty.
        Returns whether the move happened (both regions must have the same span)."""
        remap = _mremap()
        if remap is None or donor._span != self._span or donor is self:
            return False
        for start, end in self._pieces:
            size = ctypes.c_size_t(end - start)
            target = self._address + start
            moved = remap(
                ctypes.c_void_p(donor._address + start),
                size,
                size,
                _MREMAP_MOVE_KEEP_SOURCE,
                ctypes.c_void_p(target),
            )
            if moved != target:  # refused (a kernel before 5.7): pages fault in as before
                return False
        return True


# mremap flags: may move, to a fixed address, leaving the source mapped (and empty).
_MREMAP_MOVE_KEEP_SOURCE = ctypes.c_int(1 | 2 | 4)


@functools.cache
def _mremap():
    """libc's ``mremap``, or None where there is none (not Linux)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).mremap
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    return fn


class PageBank:
    """Pages of freed unsharded parameters, held back to move under the next parameter
    of the same size (see [Note: host memory]).

    ``release(region)`` takes a region that is done with its contents; ``acquire(region)``
    readies a region for a new all-gather, with its own pages if they are still here, else
    with a held region's pages of the same span, else fresh ones as they are written. At
    most ``keep_bytes`` are held; the oldest beyond that are dropped at once.

    Example::

        >>> bank = PageBank()
        >>> a, b = HostRegion(4 << 20), HostRegion(4 << 20)
        >>> bank.keep_bytes = 8 << 20
        >>> bank.release(a)  # a is done with its contents: its pages wait in the bank
        >>> b.drop()
        >>> bank.acquire(b)  # ...and now back b, with no page fault when b is written
        >>> bank.clear()
    """

    def __init__(self) -> None:
        self.keep_bytes = 0
        self._held: collections.OrderedDict[int, HostRegion] = collections.OrderedDict()
        self.moves = 0  # regions backed by another's pages so far

    @property
    def held_bytes(self) -> int:
        """Bytes of the freed parameters' pages held now (for ``fsdp2.tools.MemoryTracker``).

        Example::

            >>> PageBank().held_bytes
            0
        """
        return sum(r.nbytes for r in self._held.values())

    def release(self, region: HostRegion) -> None:
        region.resident = False
        if id(region) in self._held:
            return
        self._held[id(region)] = region
        while sum(r._span for r in self._held.values()) > self.keep_bytes:
            self._held.popitem(last=False)[1].drop()  # the oldest

    def acquire(self, region: HostRegion) -> bool:
        """Ready ``region`` for writing: its own held pages, else a held region's pages of
        the same span, else fresh zero pages as it is written. Returns whether it took
        another region's pages (it then holds that region's old bytes until written)."""
        if region.resident:
            return False
        moved = False
        if self._held.pop(id(region), None) is None:  # its own pages are gone
            # The most recently freed first: older ones are the first to go over budget.
            for key, donor in reversed(self._held.items()):
                if region.take_pages_of(donor):
                    del self._held[key]
                    self.moves += 1
                    moved = True
                    break
        region.touch()
        return moved

    def clear(self) -> None:
        while self._held:
            self._held.popitem()[1].drop()


def allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device
) -> tuple[torch.Tensor, HostRegion | None]:
    """An uninitialized tensor, and the ``HostRegion`` under it when it got a mapping of its
    own (a large CPU buffer, see the note above); otherwise ``torch.empty`` and ``None``.

    Example::

        >>> t, region = allocate((4, 1 << 20), torch.float32, "cpu")
        >>> t.shape, region is None or region.nbytes == t.numel() * 4
        (torch.Size([4, 1048576]), True)
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if not wants_mapping(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device), None
    region = HostRegion(nbytes)
    return region.tensor(dtype, tuple(shape)), region


def empty(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``, except that a large CPU buffer gets a mapping of its own, unmapped
    when the last view of it is gone.

    Example::

        >>> empty((4, 1 << 20), torch.float32, "cpu").shape
        torch.Size([4, 1048576])
    """
    return allocate(shape, dtype, device)[0]
