"""Workspace: host buffers that one mesh dim's collectives reuse from call to call.

[Note: collective workspace] A tensor-parallel step redistributes activations at every
planned module, forward and backward: on the benchmark GPT (12 blocks, sequence parallel, TP
at 2 ranks) about 300 buffers of 64 KiB or more per step - staging blocks, send copies, the
gathered inputs, the reduced outputs - each allocated, used for one module and freed. glibc's
malloc serves them from its main heap, between activations and gradients that live much
longer, and the holes they leave are cut up by the next allocations: the heap then grows for
the large requests that no longer fit (the 12-16 MB logits and vocabulary gradients). There,
rank 0's heap grew to 992-996 MB over four steps against PyTorch's 938 MB, with 250-510 MB of
it free but resident (glibc's ``mallinfo2``; docs/parallel.md, "Collective buffers").

A workspace keeps those buffers instead and hands them out again. ``empty`` returns a tensor
over a kept buffer of exactly the size asked that nothing else uses, or keeps a new one. The
buffers are ``dtensor.buffers.KeptBuffer``s, handed out under that module's [Note: the buffer
safety rule] (fsdp2's buffer pool keeps its buffers by the same rule): a buffer is in use
while anything but the workspace references its storage - a tensor, a view, an autograd
saved tensor, a collective in flight, a storage handle someone kept. A storage moved to
shared memory (``share_memory_()``, ``torch.multiprocessing``) or resized leaves the
workspace for good. So a result that is kept is never handed out twice, and no caller has to
give anything back.
Exact sizes mean a tensor from the workspace spans its whole storage, every byte of which
the collective writes: ``torch.save`` or ``copy.deepcopy`` of it carries nothing stale.

Bounds, so a workspace never holds much memory idle:

* only CPU buffers from ``MIN_BYTES`` to ``MAX_BYTES``: smaller ones sit well in malloc's bins,
  larger ones malloc maps and unmaps by itself (its mmap threshold stops rising at 32 MiB);
* at most ``PER_SIZE`` buffers of one size;
* at most ``budget`` bytes in all (default ``DEFAULT_BUDGET``). Past it, a free buffer unused
  for ``STALE_AFTER`` requests is evicted to make room; buffers in recent use never are, so a
  working set larger than the budget does not churn: the requests over it are plain
  allocations (counted in ``plain``).

``parallelize_module`` makes a workspace for its tensor-parallel mesh dim, where the same
redistributions come back every step; ``collective_workspace(mesh, mesh_dim)`` makes one for
any dim. Other dims (FSDP's data-parallel ones) have none. ``DTensor.full_tensor()`` never
uses one: its result is the caller's to keep (a state dict, a saved file). A mesh rebuilt by
unpickling, or a second mesh over the same ranks, starts without a workspace.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from dtensor.buffers import KeptBuffer, can_tell_free, nbytes_of

MIN_BYTES = 64 << 10
MAX_BYTES = 32 << 20
DEFAULT_BUDGET = 64 << 20
PER_SIZE = 8
STALE_AFTER = 4096  # requests; a 12-block TP step on the benchmark GPT makes about 300

_bypass = threading.local()
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every workspace still referenced


class Workspace:
    """Kept CPU buffers for one mesh dim's collectives ([Note: collective workspace]).

    ``empty(shape, dtype, device)`` is ``torch.empty`` over a kept buffer when one of that
    exact size is free and the request is within bounds. ``budget`` (bytes) may be changed
    at any time; 0 turns the workspace off. Counters: ``hits`` (served from a kept buffer),
    ``kept`` (served by a newly kept one), ``plain`` (within bounds, but no buffer free and
    no room: a plain allocation), ``evicted`` (stale buffers let go to make room).

    Example::

        >>> ws = Workspace()
        >>> a = ws.empty((256, 1024), torch.float32, "cpu")  # kept: 1 MiB
        >>> ptr = a.data_ptr()
        >>> del a                                           # free again
        >>> ws.empty((256, 1024), torch.float32, "cpu").data_ptr() == ptr
        True
    """

    #: the bounds ([Note: collective workspace]), for tools that predict what one keeps
    MIN_BYTES = MIN_BYTES
    MAX_BYTES = MAX_BYTES
    DEFAULT_BUDGET = DEFAULT_BUDGET

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self._buffers: list[KeptBuffer] = []
        self._clock = 0
        self._lock = threading.Lock()  # any thread may redistribute over the mesh
        self.hits = self.kept = self.plain = self.evicted = 0
        _LIVE.add(self)

    @property
    def storages(self) -> list[torch.UntypedStorage]:
        """The storages of the buffers kept now, free or in use (for memory tools).

        Example::

            >>> ws = Workspace()
            >>> a = ws.empty((256, 1024), torch.float32, "cpu")
            >>> ws.storages[0] is a.untyped_storage()
            True
        """
        return [b.storage for b in self._buffers]

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers kept now, free or in use."""
        return sum(b.nbytes for b in self._buffers)

    def empty(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """An uninitialized tensor, over a kept buffer when the request qualifies.

        Example::

            >>> Workspace().empty((4, 65536), torch.float32, "cpu").shape
            torch.Size([4, 65536])
        """
        need = nbytes_of(shape, dtype)
        device = torch.device(device)
        if (
            device.type != "cpu"
            or not MIN_BYTES <= need <= MAX_BYTES
            or not can_tell_free()
            or getattr(_bypass, "active", False)
        ):
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:  # the tensor that marks the buffer busy is made before letting go
            buf = self._take(need)
            if buf is not None:
                return buf.tensor(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=device)

    def clear(self) -> None:
        """Let every kept buffer go (those in use live on with their tensors).

        Example::

            >>> ws.clear(); ws.held_bytes
            0
        """
        with self._lock:
            self._buffers.clear()

    def _take(self, need: int) -> KeptBuffer | None:
        self._clock += 1
        gone = [b for b in self._buffers if b.nbytes == need and b.left_the_keeper()]
        if gone:  # e.g. freed by ``resize_(0)``: not ours to hand out any more
            self._buffers = [b for b in self._buffers if b not in gone]
        same = [b for b in self._buffers if b.nbytes == need]
        for buf in same:
            if buf.is_free():
                buf.last_use = self._clock
                self.hits += 1
                return buf
        if len(same) >= PER_SIZE or not self._make_room(need):
            self.plain += 1
            return None
        buf = KeptBuffer.new(need)
        buf.last_use = self._clock
        self._buffers.append(buf)
        self.kept += 1
        return buf

    def _make_room(self, need: int) -> bool:
        """Whether ``need`` more bytes fit the budget, evicting stale free buffers (the
        longest unused first) if that makes them fit; nothing is evicted otherwise."""
        self._buffers = [b for b in self._buffers if not b.left_the_keeper()]
        over = self.held_bytes + need - self.budget
        if over <= 0:
            return True
        stale = sorted(
            (b for b in self._buffers if self._clock - b.last_use > STALE_AFTER and b.is_free()),
            key=lambda b: b.last_use,
        )
        if sum(b.nbytes for b in stale) < over:
            return False
        for buf in stale:
            if over <= 0:
                break
            self._buffers.remove(buf)
            self.evicted += 1
            over -= buf.nbytes
        return True


@contextlib.contextmanager
def bypassed():
    """Within this block no workspace serves this thread: for results that the caller keeps
    (``DTensor.full_tensor()``), which would hold a kept buffer long after the call.

    Example::

        >>> with bypassed():
        ...     full = redistribute_dtensor(dt, (Replicate(),))._local()
    """
    before = getattr(_bypass, "active", False)
    _bypass.active = True
    try:
        yield
    finally:
        _bypass.active = before


class _MeshWorkspaces(dict):
    """One root mesh's workspaces, by process-group name, kept in the mesh's resources
    (``DeviceMesh.resources``: they go when the mesh does)."""


def collective_workspace(mesh, mesh_dim: int | str = 0) -> Workspace:
    """The workspace of ``mesh``'s dim ``mesh_dim``, made on first use: from then on the CPU
    collectives of DTensor redistributions over that dim reuse their buffers ([Note:
    collective workspace] in ``dtensor/_workspace.py``). ``parallelize_module`` calls this for
    its tensor-parallel mesh; set ``budget`` (bytes; 0 turns it off) or ``clear()`` it.

    Example:
        >>> ws = collective_workspace(mesh["tp"])
        >>> ws.budget = 128 << 20          # allow more for long sequences
        >>> ws.hits, ws.kept, ws.plain     # after some steps: (1800, 9, 0)
    """
    name = mesh.get_group(mesh_dim).group_name  # a name: the mesh holds groups weakly
    workspaces = mesh.resources.get(_MeshWorkspaces)
    found = workspaces.get(name)
    if found is None:
        found = workspaces.setdefault(name, Workspace())
    return found


def live_workspaces() -> list[Workspace]:
    """Every collective workspace still alive in this process, of any mesh (for memory
    tools that count the buffers they keep).

    Example::

        >>> ws = collective_workspace(mesh["tp"])
        >>> any(w is ws for w in live_workspaces())
        True
    """
    return list(_LIVE)


def workspace_of(mesh, mesh_dim: int | str) -> Workspace | None:
    """``mesh`` dim ``mesh_dim``'s workspace if one was made, else None (nothing is made).

    Example::

        >>> workspace_of(mesh["dp"], 0) is None   # only made on request
        True
    """
    return workspace_for_group(mesh, mesh.get_group(mesh_dim))


def workspace_for_group(mesh, group) -> Workspace | None:
    """``workspace_of`` for a collective that already has ``group`` (one of ``mesh``'s).

    Example::

        >>> workspace_for_group(mesh, mesh.get_group("tp")) is collective_workspace(mesh["tp"])
        True
    """
    workspaces = mesh.resources.peek(_MeshWorkspaces)
    if not workspaces:
        return None
    return workspaces.get(group.group_name)
