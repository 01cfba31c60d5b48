"""Keep a gathered input as its shard for backward, and gather it again there.

[Note: regather in backward] In a sequence-parallel block the norms run on ``1/k`` of the
tokens and the column-parallel linears after them need every token: the styles all-gather
``Shard(1) -> Replicate()`` first. The linears save their input for the weight gradient, so
autograd would keep each gathered activation, ``k`` times the shard, alive from the forward to
the backward. Megatron-LM keeps the shard instead and all-gathers it again when the backward
reaches it; this module does the same for any style that gathers an input:

* while the module's forward runs, a ``saved_tensors_hooks`` pair is active; a tensor saved
  for backward that lives in a gathered input's storage is packed as a handle on the shard
  (plus its size, strides and offset), any other tensor is handed to the hooks that were
  active before (see below), or saved as usual when there were none;
* the first unpack in a backward pass all-gathers the shard once; the handle hands the same
  full tensor to every node that saved it (q, k and v share one gathered input) and lets go of
  it after the last of them.

Cost and gain, per gather site: one more all-gather in backward; ``(k - 1) / k`` of the
gathered activation not kept between forward and backward (``benchmarks/tp_bench.py`` and
docs/parallel.md give the measured figures). The values are the forward's, bit for bit: the
same shards gathered by the same collective.

[Note: regather under outer hooks] Autograd applies only the innermost pair of saved-tensor
hooks, so a pair pushed here would otherwise hide the pairs around it: non-reentrant
activation checkpointing (``torch.distributed._composable.checkpoint``,
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``), ``save_on_cpu``, a memory
tracer. Checkpointing would then keep everything saved inside attention and the MLP as plain
saved tensors, and its recomputation would stop early, before them. So ``SaveShards`` looks
up the pair on top of the stack when it is entered, and composes with it:

* a tensor that is not a gathered input is packed by the outer pack hook, and unpacked by
  the outer unpack hook: the outer hooks see exactly what they would see without tensor
  parallelism (the gathered inputs aside);
* a gathered input is still packed as a handle on its shard, and the shard itself, once per
  handle (at its first save), is packed by the outer pack hook and dropped here: under
  checkpointing, the shard is then recomputed in backward like any tensor of the block, and
  the block keeps only its input from forward to backward, as it does without tensor
  parallelism. The backward all-gathers the recomputed shard (after the recomputation's own
  all-gather, which it cannot hand over: Megatron-LM re-gathers the same way).

Measured on ``examples.gpt`` (dim 128, 4 blocks, 256 tokens, batch 4) at TP 2 with every
block checkpointed: ``MemoryTracker``'s activations at the peak 1.0 MiB (the blocks' inputs),
against 19.6 MiB without checkpointing and 18.5 MiB when this pair hid checkpointing's. A
checkpointed block's recomputation now runs up to the MLP's output linear: it re-issues
attention's input all-gather, its output reduce-scatter and the MLP's input all-gather, as
with ``regather_in_backward=False`` (``fsdp2/tools/_tp_model.py``). Reentrant checkpointing
runs the forward without grad, so nothing is saved there and nothing changes.

The order of the outer packs is the forward's order, so checkpointing's recomputation, which
enters this context again under its own hooks, packs the same tensors in the same order. An
in-place change of the shard after forward is caught when the outer hooks hand back the
tensor they were given (as without outer hooks); through hooks that copy or detach it, the
check is theirs to make, as autograd makes none through hooks.
"""

from __future__ import annotations

import weakref

import torch

from dtensor.placement import Replicate
from dtensor.tensor import DTensor, redistribute_dtensor


def _storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` lives in: its address, or on the meta device (where every
    address is 0) the storage object itself, so that a dry run on meta tensors saves and
    re-gathers exactly what a real run does."""
    storage = t.untyped_storage()
    return storage._cdata if t.device.type == "meta" else storage.data_ptr()


def _outer_hooks():
    """The saved-tensor hooks active now (``(pack, unpack)``), or ``None``."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(True)


class _Deferred:
    """A tensor packed by the hooks that were active when ``SaveShards`` was entered."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed, unpack):
        self.packed, self.unpack = packed, unpack


class _Gathered:
    """One gathered input: the shard it came from, and its full tensor while backward needs it."""

    def __init__(self, shard: torch.Tensor, mesh, placement, shape):
        self.shard: torch.Tensor | None = shard.detach()
        self.version = shard._version
        self.mesh, self.placement, self.shape = mesh, placement, shape
        self.saves = 0  # tensors packed as this handle
        self.left = 0  # unpacks still to come in this backward pass
        self.full: torch.Tensor | None = None
        self.outer: _Deferred | None = None  # the shard, packed by the outer hooks
        self.given = None  # a weak reference to the tensor they were given

    def defer(self, hooks) -> None:
        """Hand the shard to the outer ``hooks`` and keep only what their pack returns."""
        pack, unpack = hooks
        shard, self.shard = self.shard, None
        self.given = weakref.ref(shard)
        self.outer = _Deferred(pack(shard), unpack)

    def take(self) -> torch.Tensor:
        if self.full is None:
            if self.outer is None:
                shard = self.shard
            else:  # checked only if handed back as given: a copy or recomputation is not ours
                shard = self.outer.unpack(self.outer.packed)
            if (self.outer is None or shard is self.given()) and shard._version != self.version:
                raise RuntimeError(
                    "tensor parallelism: a sharded activation that a column-parallel layer "
                    "gathered in forward was modified in place before backward, which needs it "
                    "again to recompute the gathered input. Clone it before modifying it, or "
                    "pass regather_in_backward=False to the style that gathers it."
                )
            with torch.no_grad():
                dt = DTensor.from_local(shard, self.mesh, (self.placement,), shape=self.shape)
                self.full = redistribute_dtensor(dt, (Replicate(),))._local()
            self.left = self.saves
        full = self.full
        self.left -= 1
        if self.left <= 0:  # the last node that saved it: let the full tensor go with it
            self.full = None
        return full


class SaveShards:
    """A ``saved_tensors_hooks`` context that saves gathered inputs as their shards, and
    hands every other saved tensor to the hooks active when it is entered
    ([Note: regather under outer hooks]).

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
        self._outer = None  # the (pack, unpack) pair active when entered, if any

    def add(self, full: torch.Tensor, shard: torch.Tensor, mesh, placement, shape) -> None:
        if not full.dtype.is_floating_point:
            return
        key = _storage_key(full)
        self._inputs[key] = (full, _Gathered(shard, mesh, placement, shape))

    def __bool__(self) -> bool:
        return bool(self._inputs)

    def _pack(self, t: torch.Tensor):
        # A DTensor is a wrapper without storage: never a gathered input.
        entry = None if isinstance(t, DTensor) else self._inputs.get(_storage_key(t))
        if entry is None or entry[0].dtype != t.dtype:
            if self._outer is None:
                return t
            pack, unpack = self._outer
            return _Deferred(pack(t), unpack)
        handle = entry[1]
        if handle.saves == 0 and self._outer is not None:
            handle.defer(self._outer)  # in forward order, as the outer hooks' own packs
        handle.saves += 1
        return handle, t.size(), t.stride(), t.storage_offset()

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Deferred):
            return packed.unpack(packed.packed)
        handle, size, stride, offset = packed
        return handle.take().as_strided(size, stride, offset)

    def __enter__(self):
        self._outer = _outer_hooks()
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
        self._outer = None  # the packed tensors hold the unpack hooks they need
        return False
