"""Keep a gathered input as its shard for backward, and gather it again there.

[Note: regather in backward] In a sequence-parallel block the norms run on ``1/k`` of the
tokens and the column-parallel linears after them need every token: the styles all-gather
``Shard(1) -> Replicate()`` first. The linears save their input for the weight gradient, so
autograd would keep each gathered activation, ``k`` times the shard, alive from the forward to
the backward. Megatron-LM keeps the shard instead and all-gathers it again when the backward
reaches it; this module does the same for any style that gathers an input:

* while the module's forward runs, a ``saved_tensors_hooks`` pair is active; a tensor saved
  for backward that lives in a gathered input's storage is packed as a handle on the shard
  (plus its size, strides and offset), any other tensor is saved as usual;
* the first unpack in a backward pass all-gathers the shard once; the handle hands the same
  full tensor to every node that saved it (q, k and v share one gathered input) and lets go of
  it after the last of them.

Cost and gain, per gather site: one more all-gather in backward; ``(k - 1) / k`` of the
gathered activation not kept between forward and backward (``benchmarks/tp_bench.py`` and
docs/parallel.md give the measured figures). The values are the forward's, bit for bit: the
same shards gathered by the same collective.
"""

from __future__ import annotations

import torch

from dtensor.placement import Replicate
from dtensor.tensor import DTensor, redistribute_dtensor


def _storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` lives in: its address, or on the meta device (where every
    address is 0) the storage object itself, so that a dry run on meta tensors saves and
    re-gathers exactly what a real run does."""
    storage = t.untyped_storage()
    return storage._cdata if t.device.type == "meta" else storage.data_ptr()


class _Gathered:
    """One gathered input: the shard it came from, and its full tensor while backward needs it."""

    def __init__(self, shard: torch.Tensor, mesh, placement, shape):
        self.shard = shard.detach()
        self.version = shard._version
        self.mesh, self.placement, self.shape = mesh, placement, shape
        self.saves = 0  # tensors packed as this handle
        self.left = 0  # unpacks still to come in this backward pass
        self.full: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        if self.shard._version != self.version:
            raise RuntimeError(
                "tensor parallelism: a sharded activation that a column-parallel layer gathered "
                "in forward was modified in place before backward, which needs it again to "
                "recompute the gathered input. Clone it before modifying it, or pass "
                "regather_in_backward=False to the style that gathers it."
            )
        if self.full is None:
            with torch.no_grad():
                dt = DTensor.from_local(self.shard, self.mesh, (self.placement,), shape=self.shape)
                self.full = redistribute_dtensor(dt, (Replicate(),))._local()
            self.left = self.saves
        full = self.full
        self.left -= 1
        if self.left <= 0:  # the last node that saved it: let the full tensor go with it
            self.full = None
        return full


class SaveShards:
    """A ``saved_tensors_hooks`` context that saves gathered inputs as their shards.

    ``add`` each gathered input (its local full tensor and the shard it came from) before
    entering; leaving forgets them, so the graph keeps only the shards.

    Example:
        >>> saver = SaveShards()
        >>> saver.add(full_local, shard_local, mesh, Shard(1), global_shape)
        >>> with saver:
        ...     y = module_forward(full)      # saves a handle on the shard, not ``full``
    """

    def __init__(self):
        self._inputs: dict[int, tuple[torch.Tensor, _Gathered]] = {}
        self._hooks = None

    def add(self, full: torch.Tensor, shard: torch.Tensor, mesh, placement, shape) -> None:
        if not full.dtype.is_floating_point:
            return
        key = _storage_key(full)
        self._inputs[key] = (full, _Gathered(shard, mesh, placement, shape))

    def __bool__(self) -> bool:
        return bool(self._inputs)

    def _pack(self, t: torch.Tensor):
        if isinstance(t, DTensor):  # a wrapper without storage: never a gathered input
            return t
        entry = self._inputs.get(_storage_key(t))
        if entry is None or entry[0].dtype != t.dtype:
            return t
        handle = entry[1]
        handle.saves += 1
        return handle, t.size(), t.stride(), t.storage_offset()

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        handle, size, stride, offset = packed
        return handle.take().as_strided(size, stride, offset)

    def __enter__(self):
        # Outside dynamo, like the styles' hooks: traced, ``_pack`` guarded on the storage
        # addresses it looked up, recompiled for each new one and hit the recompile limit.
        pack, unpack = torch.compiler.disable(self._pack), torch.compiler.disable(self._unpack)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._inputs.clear()  # the graph holds the packed handles; the full tensors may go
        return False
