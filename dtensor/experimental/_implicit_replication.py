"""``implicit_replication``: plain tensors met by DTensors are taken as replicated DTensors.

Outside the context a plain tensor of more than one element mixed with DTensors is refused
(most often it is a sharded parameter read at the wrong time, and treating its local block
as the whole tensor would compute garbage). Inside it, every such tensor is trusted to hold
the same values on every rank and becomes a ``Replicate()`` DTensor on the mesh of the
op's DTensors, as PyTorch's context manager of the same name does. The switch is per thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dtensor import _dispatch


@contextmanager
def implicit_replication() -> Iterator[None]:
    """Within the ``with`` block (on this thread), plain ``torch.Tensor`` arguments of an op
    that also takes DTensors are used as replicated DTensors on those DTensors' mesh.

    Nothing checks that the tensor really is the same on every rank: a tensor that differs
    between ranks silently gives wrong results. The flag is per thread; on exit it returns
    to what it was on entry, so nested blocks compose. It does not apply to ``_foreach_``
    ops (their list positions may live on different meshes). Autograd saves the plain
    tensor as it is, so run the backward of ops recorded inside the block inside it too (on
    CPU autograd runs on the calling thread and sees the flag; a CUDA backward runs on a
    device thread that does not, as with PyTorch's thread-local flag). Also usable as a
    decorator.

    Example:
        >>> dx = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        >>> bias = torch.arange(12.0).reshape(4, 3)   # the same tensor on every rank
        >>> with implicit_replication():
        ...     out = dx + bias                        # bias taken as Replicate()
        >>> out.placements, torch.equal(out.full_tensor(), 1 + bias)
        ((Shard(dim=0),), True)
    """
    state = _dispatch._IMPLICIT
    before = state.on
    state.on = True
    try:
        yield
    finally:
        state.on = before
