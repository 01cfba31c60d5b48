"""DTensor: a ``torch.Tensor`` subclass holding this rank's shard plus a global spec.

It is a *wrapper* subclass: the outer tensor has the global shape and no storage; every aten
op that reaches it goes through ``__torch_dispatch__`` (see ``dtensor._dispatch``), which
finds the op's sharding rule, redistributes inputs when the rule asks, runs the op on the
local tensors and wraps the results. Autograd runs on the outer tensors, so gradients are
DTensors too and stock optimizers see ordinary tensors.
"""

from __future__ import annotations

import sys

import torch

from device_mesh import DeviceMesh, as_device_mesh
from dtensor import _collectives as C
from dtensor import _workspace, debug
from dtensor._redistribute import redistribute_local
from dtensor._spec import DTensorSpec, TensorMeta, contiguous_stride
from dtensor.placement import (
    Partial,
    Replicate,
    format_placements,
    is_shard_like,
    normalize_placements,
)


def is_torch_dtensor(obj) -> bool:
    """Whether ``obj`` is PyTorch's DTensor (``torch.distributed.tensor.DTensor``), which our
    APIs cannot take in: its local tensor and spec live in another library.

    Example:
        >>> is_torch_dtensor(distribute_tensor(torch.ones(2), mesh, [Shard(0)]))   # ours
        False
    """
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    # a port that rebinds PyTorch's name to ours must not make ours look like PyTorch's
    return isinstance(cls, type) and cls.__module__.startswith("torch.") and isinstance(obj, cls)


def torch_dtensor_message(api: str, argument: str, obj) -> str:
    """The error for PyTorch's DTensor handed to one of our APIs: which library is which."""
    placements = ", ".join(repr(p) for p in obj.placements)
    return (
        f"{api}: {argument} is PyTorch's DTensor (torch.distributed.tensor.DTensor, shape "
        f"{tuple(obj.shape)}, placements ({placements})), but this is ours (dtensor.DTensor): "
        "the two libraries' DTensors do not mix. Build the tensor with dtensor "
        "(from dtensor import distribute_tensor), or pass PyTorch's .full_tensor()."
    )


# [Note: DTensor under torch.compile] DTensor is a traceable subclass: dynamo passes it into
# graphs through ``__tensor_flatten__`` / ``__tensor_unflatten__`` and AOTAutograd traces
# ``__torch_dispatch__`` with fake local tensors, so a compiled graph holds the local ops.
# Dynamo itself must never compile *our* Python as a frame of its own: an op that runs
# eagerly while a compiled function is active (a graph break, a runtime wrapper building its
# DTensor outputs) would call into dispatch or ``__new__`` with dynamo's frame hook set, and
# dynamo would try to compile them. ``torch.compiler.disable`` on those entry points runs
# them, and everything they call, as plain Python (about a microsecond per call).
# ``__tensor_flatten__`` first finishes an ``async_op`` redistribution still in flight, so a
# graph never reads the local tensor from before the collective.


def _dispatcher_not_set(func, args, kwargs):
    raise AssertionError(
        f"DTensor: {func} reached __torch_dispatch__ before dtensor._dispatch set the "
        "dispatcher (it does when it is imported, and `import dtensor` imports it)."
    )


# [Note: the dispatcher is set from above] Every op on a DTensor goes to
# ``dtensor._dispatch.dispatch``, which builds on this module (it wraps outputs in DTensors,
# redistributes inputs). So this module does not import it: ``dtensor._dispatch`` hands its
# entry point to ``set_dispatch`` when it is imported (``dtensor/__init__.py`` imports it
# before anything can make a DTensor), and ``__torch_dispatch__`` calls it directly.
_dispatch_impl = _dispatcher_not_set


def set_dispatch(fn) -> None:
    """Make ``fn(func, args, kwargs)`` the handler of every aten op on a DTensor ([Note: the
    dispatcher is set from above] in ``dtensor/tensor.py``).

    Example:
        >>> from dtensor._dispatch import dispatch
        >>> set_dispatch(dispatch)     # what importing dtensor._dispatch does
    """
    global _dispatch_impl
    _dispatch_impl = fn


def _new_dtensor(cls, local_tensor: torch.Tensor, spec: DTensorSpec, requires_grad: bool):
    """``DTensor(...)`` without the ``torch.compiler.disable`` wrapper around ``__new__``:
    dispatch, already inside a disabled frame, wraps every op's outputs with it."""
    if local_tensor.requires_grad and not requires_grad:
        local_tensor = local_tensor.detach()
    meta = spec.meta
    r = torch.Tensor._make_wrapper_subclass(
        cls,
        meta.shape,
        strides=meta.stride,
        dtype=meta.dtype,
        device=local_tensor.device,
        layout=local_tensor.layout,
        requires_grad=requires_grad,
    )
    # [Note: conjugate and negative views] A lazy conjugate (``x.conj()`` of a complex
    # tensor; autograd's backward of ``mul`` takes one) or negation is a flag on the
    # local tensor, and ops run inside __torch_dispatch__ with those flags' handlers
    # switched off, so they would read the raw values. Set on the wrapper, the flags make
    # the dispatcher resolve them before an op reaches us (PyTorch's DTensor does so).
    if local_tensor.is_conj():
        torch._C._set_conj(r, True)
    if local_tensor.is_neg():
        torch._C._set_neg(r, True)
    r._local_value = local_tensor
    r._spec = spec
    r._pending = None
    r._view_of = None  # see [Note: writes through gathered views] in _inplace.py
    return r


class DTensor(torch.Tensor):
    """A tensor sharded or replicated over a ``DeviceMesh``.

    Build one with ``distribute_tensor`` (from a full tensor) or ``DTensor.from_local`` (from
    per-rank pieces). ``dt.shape`` is the global shape; ``dt.to_local()`` is this rank's piece.

    Example:
        >>> mesh = init_device_mesh("cpu", (2,))
        >>> dt = distribute_tensor(torch.arange(6.0).view(3, 2), mesh, [Shard(0)])
        >>> dt.to_local()            # rank 0: [[0, 1], [2, 3]]; rank 1: [[4, 5]]
        >>> (dt * 2).full_tensor()   # every rank: the whole doubled tensor
    """

    _local_value: torch.Tensor  # this rank's block; read it through _local()
    _spec: DTensorSpec

    @staticmethod
    @torch.compiler.disable  # [Note: DTensor under torch.compile]
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool):
        return _new_dtensor(cls, local_tensor, spec, requires_grad)

    # torch functions go straight to aten; sharding happens in __torch_dispatch__
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    @torch.compiler.disable  # [Note: DTensor under torch.compile]
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch_impl(func, args, kwargs or {})

    # ---------------------------------------------------------------------------- metadata
    @property
    def placements(self) -> tuple:
        """One placement per mesh dim, e.g. ``(Shard(0),)``."""
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh this tensor lives on."""
        return self._spec.mesh

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"placements={format_placements(self.placements)}, mesh={self.device_mesh!r})"
        )

    def __tensor_flatten__(self):
        self._local()  # finish a pending async redistribution: the graph reads _local_tensor
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    @torch.compiler.disable
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        spec, requires_grad = ctx
        meta = TensorMeta(torch.Size(outer_size), tuple(outer_stride), spec.meta.dtype)
        return DTensor(
            inner["_local_tensor"],
            DTensorSpec(spec.mesh, spec.placements, meta),
            requires_grad=requires_grad,
        )

    def __getstate__(self) -> dict:
        # Pickled (torch.save, copy.copy) as PyTorch pickles a wrapper subclass, with this
        # state: the finished local tensor, never an in-flight collective's handle.
        state = dict(self.__dict__)
        state["_local_value"] = self._local()
        state["_pending"] = None
        return state

    # PyTorch's distributed checkpoint (torch.distributed.checkpoint) asks any tensor it
    # saves or loads for these three (its "checkpointable" protocol); each rank holds one box
    # of the global tensor, described as PyTorch describes its own DTensor's.
    def __create_write_items__(self, fqn: str, object) -> list:
        """DCP's write items for this tensor: this rank's box, as one shard item (replicas
        write the same item on every rank; DCP's global plan keeps one).

        Example:
            >>> dt.__create_write_items__("w", dt)   # what torch.distributed.checkpoint.save asks
            [WriteItem(index=MetadataIndex(fqn='w', offset=torch.Size([0, 0]), ...), ...)]
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        _check_checkpointable(self, "__create_write_items__")
        chunks = self.__create_chunk_list__()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self.to_local()),
                    size=self.size(),
                ),
            )
            for chunk in chunks
        ]

    def __create_chunk_list__(self) -> list:
        """The boxes of the global tensor this rank holds (none off the mesh): DCP reads into
        them on load, resharding from whatever layout was saved.

        Example:
            >>> distribute_tensor(torch.ones(5, 3), mesh, [Shard(0)]).__create_chunk_list__()
            [ChunkStorageMetadata(offsets=torch.Size([3, 0]), sizes=torch.Size([2, 3]))]  # rank 1
        """
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        _check_checkpointable(self, "__create_chunk_list__")
        if self.device_mesh.get_coordinate() is None:
            return []
        sizes, offsets = self._spec.local_shape_and_offset()
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        """The local tensor DCP writes from or reads into (every ``index`` of this tensor
        names this rank's one box).

        Example:
            >>> dt.__get_tensor_shard__(MetadataIndex("w", (3, 0))) is dt.to_local()
            True
        """
        _check_checkpointable(self, "__get_tensor_shard__")
        return self._local()

    def _local(self) -> torch.Tensor:
        """The local tensor, waiting for an async redistribute if one is still running."""
        if self._pending is not None:
            self._local_value = self._pending.wait()
            self._pending = None
        return self._local_value

    @property
    def _local_tensor(self) -> torch.Tensor:
        """This rank's block under PyTorch's attribute name, which frameworks read
        (torchtitan, accelerate, PEFT): after ``redistribute(async_op=True)`` it waits for
        the collective, so it never shows the block from before the redistribution.

        Example::

            >>> dt.redistribute(placements=[Replicate()], async_op=True)._local_tensor.shape
            torch.Size([7, 4])
        """
        return self._local()

    @_local_tensor.setter
    def _local_tensor(self, value: torch.Tensor) -> None:
        self._local_value = value
        self._pending = None

    # ---------------------------------------------------------------------------- public API
    @staticmethod
    def from_local(
        local_tensor,
        device_mesh=None,
        placements=None,
        *,
        run_check=False,
        shape=None,
        stride=None,
        grad_placements=None,
    ) -> DTensor:
        """Wrap each rank's ``local_tensor`` as one DTensor (differentiable).

        Without ``shape``, shards are assumed even (global size = local size x mesh size);
        pass ``shape`` (and ``stride``) for uneven shards. ``run_check=True`` verifies every
        rank's local shape against the global shape and makes replicas equal by
        broadcasting from the first rank of each replicated mesh dim (collectives).
        ``grad_placements`` is the layout the gradient flowing back into ``local_tensor``
        is redistributed to (default: ``placements``, with partials as replicas).

        Raises:
            ValueError: no mesh, wrong placements, or (with ``run_check``) local shapes that
                do not fit ``shape``.

        Example:
            >>> dt = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])  # global (4, 3)
        """
        api = "DTensor.from_local"
        if device_mesh is None:
            raise ValueError(f"{api}: device_mesh is required, got None. Pass the mesh.")
        device_mesh = as_device_mesh(device_mesh, api=api, argument="device_mesh")
        if is_torch_dtensor(local_tensor):
            raise TypeError(torch_dtensor_message(api, "local_tensor", local_tensor))
        if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
            raise TypeError(
                f"{api}: local_tensor must be a plain torch.Tensor, got "
                f"{type(local_tensor).__name__}."
            )
        placements = normalize_placements(placements, device_mesh.ndim, local_tensor.ndim, api=api)
        if shape is None:
            global_shape = list(local_tensor.shape)
            for mesh_dim, p in enumerate(placements):
                if is_shard_like(p):
                    global_shape[p.dim] *= device_mesh.size(mesh_dim)
            shape = torch.Size(global_shape)
        shape = torch.Size(shape)
        stride = tuple(stride) if stride is not None else contiguous_stride(shape)
        spec = DTensorSpec(device_mesh, placements, TensorMeta(shape, stride, local_tensor.dtype))
        if grad_placements is not None:
            grad_placements = normalize_placements(
                grad_placements, device_mesh.ndim, local_tensor.ndim, api=api
            )
        if run_check:
            local_tensor = _check_local(local_tensor, spec, api)
        return _FromLocal.apply(local_tensor, spec, grad_placements)

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's piece, as a plain tensor (differentiable).

        ``grad_placements`` says how the gradient arriving at the local tensor is laid out
        (default: as this tensor).
        """
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._local()
        return _ToLocal.apply(self, grad_placements)

    def redistribute(
        self,
        device_mesh=None,
        placements=None,
        *,
        async_op=False,
        forward_dtype=None,
        backward_dtype=None,
    ) -> DTensor:
        """The same global tensor with new ``placements`` (differentiable).

        With ``async_op=True`` the last collective may still be running when this returns;
        the first use of the result waits for it. ``forward_dtype`` casts the local tensor
        before the collectives (the result has that dtype); ``backward_dtype`` casts the
        gradient before the backward collectives, and the gradient is cast back to this
        tensor's dtype after them.

        Raises:
            ValueError: another mesh, or a move to ``Partial`` from anything but that
                ``Partial`` (partials are produced by ops, not requested).

        Example:
            >>> dt.redistribute(placements=[Replicate()])    # all-gather of the shards
        """
        api = "DTensor.redistribute"
        mesh = self.device_mesh
        if device_mesh is not None:
            mesh = as_device_mesh(device_mesh, api=api, argument="device_mesh")
        if mesh != self.device_mesh:
            raise ValueError(
                f"{api}: device_mesh must be the tensor's mesh "
                f"{self.device_mesh!r}, got {mesh!r}. Moving between meshes is "
                "not supported; use full_tensor() and distribute_tensor()."
            )
        dst = normalize_placements(
            placements if placements is not None else self.placements, mesh.ndim, self.ndim, api=api
        )
        for i, (c, d) in enumerate(zip(self.placements, dst)):
            if isinstance(d, Partial) and c != d:
                raise ValueError(
                    f"{api}: cannot redistribute mesh dim {i} from {c} to {d}: a tensor only "
                    "becomes Partial as the result of an op. Redistribute to Replicate() or "
                    "Shard(dim) instead."
                )
        for name, dtype in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
            if dtype is not None and not isinstance(dtype, torch.dtype):
                raise TypeError(f"{api}: {name} must be a torch.dtype or None, got {dtype!r}.")
        return _Redistribute.apply(self, dst, async_op, forward_dtype, backward_dtype)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole global tensor on every rank, as a plain tensor (differentiable).

        Example:
            >>> distribute_tensor(t, mesh, [Shard(0)]).full_tensor().equal(t)
            True
        """
        placements = [Replicate()] * self.device_mesh.ndim
        if torch.compiler.is_compiling():  # traced collectives use no workspace anyway
            replicated = self.redistribute(placements=placements)
        else:  # the result is the caller's to keep: no kept buffer under it
            with _workspace.bypassed():
                replicated = self.redistribute(placements=placements)
        return replicated.to_local(grad_placements=grad_placements)


def _grad_target(placements):
    """Gradient placements for an input laid out as ``placements``: partials become replicas."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def redistribute_dtensor(dt: DTensor, placements, *, async_op=False) -> DTensor:
    """Non-differentiable redistribute used inside dispatch (autograd is above us there)."""
    placements = tuple(placements)
    if placements == dt.placements:
        return dt
    pending = redistribute_local(dt._local(), dt._spec, placements, async_op=async_op)
    out = DTensor(dt._local_tensor, dt._spec.with_placements(placements), requires_grad=False)
    if async_op:
        out._pending = pending
    else:
        out._local_tensor = pending.wait()
    return out


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, spec, grad_placements):
        ctx.spec = spec
        ctx.grad_placements = grad_placements
        return DTensor(local.view_as(local), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        target = ctx.grad_placements or _grad_target(ctx.spec.placements)
        if grad.placements != target:
            grad = redistribute_dtensor(grad, target)
        return grad._local(), None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, grad_placements):
        ctx.spec = dt._spec
        ctx.grad_placements = grad_placements
        return dt._local().view_as(dt._local())

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        placements = spec.placements
        if ctx.grad_placements is not None:
            placements = normalize_placements(
                ctx.grad_placements, spec.mesh.ndim, spec.ndim, api="DTensor.to_local"
            )
        grad_spec = DTensorSpec(
            spec.mesh, placements, TensorMeta(spec.shape, contiguous_stride(spec.shape), grad.dtype)
        )
        return DTensor(grad, grad_spec, requires_grad=False), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, placements, async_op, forward_dtype, backward_dtype):
        ctx.src = dt.placements
        ctx.src_dtype = dt.dtype
        ctx.backward_dtype = backward_dtype
        if forward_dtype is not None and forward_dtype != dt.dtype:
            dt = cast_dtensor(dt, forward_dtype)
        out = redistribute_dtensor(dt, placements, async_op=async_op)
        if out is dt:
            # Nothing to move. A new wrapper of the same local tensor, as PyTorch's DTensor
            # returns: handed back as itself, the input would be aliased by autograd through
            # a view op, which runs a sharding rule (a zero-element tensor's view even came
            # back Replicate, not the placements asked for).
            out = DTensor(dt._local(), dt._spec, requires_grad=False)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_dtype is not None and ctx.backward_dtype != grad.dtype:
            grad = cast_dtensor(grad, ctx.backward_dtype)
        grad = redistribute_dtensor(grad, _grad_target(ctx.src))
        if grad.dtype != ctx.src_dtype:
            grad = cast_dtensor(grad, ctx.src_dtype)
        return grad, None, None, None, None


def cast_dtensor(dt: DTensor, dtype: torch.dtype) -> DTensor:
    """``dt`` with its local tensor cast to ``dtype`` (no communication, no autograd)."""
    meta = TensorMeta(dt.shape, dt._spec.meta.stride, dtype)
    spec = DTensorSpec(dt.device_mesh, dt.placements, meta)
    return DTensor(dt._local().to(dtype), spec, requires_grad=False)


def _check_local(local: torch.Tensor, spec: DTensorSpec, api: str) -> torch.Tensor:
    """Check every rank's local shape against ``spec``; broadcast replicas from the first rank.

    Over the mesh's own groups only (a mesh may cover part of the world), with tensors, not
    pickled objects: each rank's record (its rank, its local shape, the shape ``spec`` gives
    it) is all-gathered along mesh dim 0, the gathered records along dim 1, and so on, so
    that every rank of the mesh ends with every record and all raise alike.
    """
    import torch.distributed as dist

    mesh = spec.mesh
    expected, _ = spec.local_shape_and_offset()
    n = len(expected)
    got = (list(local.shape) + [-1] * n)[:n]  # padded: a rank may have another ndim
    row = [dist.get_rank(), local.ndim, *got, *expected]
    records = torch.tensor([row], dtype=torch.int64, device=local.device)
    with debug.annotate_failures():
        for mesh_dim in range(mesh.ndim):
            k = mesh.size(mesh_dim)
            if k > 1:
                records = C.all_gather(records, mesh, mesh_dim, 0, k * records.size(0)).wait()
    bad = []
    for rank, ndim, *shapes in sorted(records.tolist()):
        mine, want = tuple(shapes[:n]), tuple(shapes[n:])
        if ndim != n:
            bad.append(f"rank {rank}: local of {ndim} dims, expected {want}")
        elif mine != want:
            bad.append(f"rank {rank}: local {mine}, expected {want}")
    if bad:
        raise ValueError(
            f"{api}: local shapes do not fit shape={tuple(spec.shape)} with placements "
            f"{format_placements(spec.placements)}: " + "; ".join(bad) + ". Pass the right "
            "shape= or make each rank's local tensor its torch.chunk shard."
        )
    for mesh_dim, p in enumerate(spec.placements):
        if isinstance(p, Replicate) and mesh.size(mesh_dim) > 1:
            local = C.broadcast(local.clone(), mesh, mesh_dim, 0)
    return local


def _check_checkpointable(dt: DTensor, hook: str) -> None:
    """Raise if ``dt`` cannot be saved or loaded box by box: pending partial sums."""
    if any(isinstance(p, Partial) for p in dt.placements):
        raise ValueError(
            f"torch.distributed.checkpoint (DTensor.{hook}): this DTensor (dtensor.DTensor, "
            f"shape {tuple(dt.shape)}, placements {format_placements(dt.placements)}) holds "
            "pending partial sums, which a checkpoint cannot store. Redistribute it first: "
            "dt.redistribute(placements=[Replicate()] * dt.device_mesh.ndim)."
        )
