"""Placements (how a tensor is laid out over one mesh dim) and the pure chunk maths behind them.

Sharding follows ``torch.chunk``: a tensor dim of size ``n`` split over ``k`` ranks gives
every rank ``ceil(n / k)`` entries except the last ones, which may get fewer or none. For
collectives that need equal sizes, shards are padded up to ``ceil(n / k)`` (the *padded
shard size*); the padded full size is ``ceil(n / k) * k``.

Nothing here talks to a process group.
"""

from __future__ import annotations

import sys

_REDUCE_OPS = ("sum", "avg", "min", "max", "product")
_LINEAR_REDUCE_OPS = ("sum", "avg")


class _PlacementKind(type):
    """The metaclass of our placements: ``isinstance(p, Shard)`` (``Replicate``, ...) also
    holds for PyTorch's placement of that kind, or of any subclass of its types ([Note:
    PyTorch's placements])."""

    def __instancecheck__(cls, obj):
        if type.__instancecheck__(cls, obj):
            return True
        if type(type(obj)) is _PlacementKind:  # ours, of another kind
            return False
        ours = from_torch_placement(obj)
        return ours is not obj and type.__instancecheck__(cls, ours)


class Placement(metaclass=_PlacementKind):
    """Base class of ``Shard``, ``Replicate`` and ``Partial``; instances are immutable.

    Immutable values copy as themselves and pickle as their constructor call, so
    ``copy``, ``deepcopy``, ``pickle`` and ``torch.compile`` (which copies them while
    tracing) all work.

    A placement compares equal to PyTorch's placement of the same meaning, in either order
    and whatever subclass of PyTorch's types it is, and hashes alike ([Note: PyTorch's
    placements]).

    Example:
        >>> import copy, pickle
        >>> copy.deepcopy(Shard(1)) == pickle.loads(pickle.dumps(Shard(1))) == Shard(1)
        True
    """

    __slots__ = ()

    def _ctor_args(self) -> tuple:
        return ()

    def __reduce__(self):
        return (type(self), self._ctor_args())

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _to_torch(self):
        """PyTorch's placement of the same meaning (its DTensor is loaded), or None."""
        return None

    def _equals_torch(self, other) -> bool:
        """``self == other`` for one of PyTorch's placements, by PyTorch's own ``__eq__``
        ([Note: PyTorch's placements])."""
        if type(type(other)) is _PlacementKind or not is_torch_placement(other):
            return False  # ours of another kind (the common case: no lookup), or a stranger
        theirs = self._to_torch()
        return theirs is not None and bool(other == theirs)

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


class Shard(Placement):
    """The tensor is split along tensor dim ``dim`` over the mesh dim, ``torch.chunk`` style.

    Example:
        >>> Shard(0).local_size(7, num_chunks=4, index=3)   # chunks of 7 rows: 2, 2, 2, 1
        1
    """

    __slots__ = ("dim",)

    def __init__(self, dim: int) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"Shard: dim must be an int, got {dim!r}.")
        object.__setattr__(self, "dim", dim)

    def _ctor_args(self) -> tuple:
        return (self.dim,)

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def normalized(self, ndim: int, *, api: str = "Shard") -> Shard:
        """This placement with a non-negative dim for a tensor of ``ndim`` dims."""
        if not -ndim <= self.dim < max(ndim, 1) or ndim == 0:
            raise ValueError(
                f"{api}: Shard(dim={self.dim}) is out of range for a tensor with {ndim} dims. "
                f"Pick a dim in [{-ndim}, {ndim})."
            )
        return self if self.dim >= 0 else Shard(self.dim + ndim)

    @staticmethod
    def local_size(size: int, num_chunks: int, index: int) -> int:
        return chunk_sizes(size, num_chunks)[index]

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int):
        """``(size, offset)`` of chunk ``rank`` when a dim of ``curr_local_size`` is split
        into ``num_chunks``, ``torch.chunk`` style; the offset is relative to that dim (an
        empty chunk starts at ``curr_local_size``). PyTorch's static method of this name.

        Example:
            >>> Shard.local_shard_size_and_offset(7, 4, 3), Shard.local_shard_size_and_offset(3, 4, 3)
            ((1, 6), (0, 3))
        """
        return chunk_sizes(curr_local_size, num_chunks)[rank], chunk_offsets(
            curr_local_size, num_chunks
        )[rank]

    def _to_torch(self):
        return _torch_module().Shard(self.dim)

    def __eq__(self, other):
        if type(other) is Shard:
            return other.dim == self.dim
        return self._equals_torch(other)

    def __hash__(self):
        return hash(self.dim)  # as PyTorch's Shard: equal placements hash alike

    def __repr__(self):
        return f"Shard(dim={self.dim})"

    def __str__(self):
        return f"S({self.dim})"


class _StridedShard(Placement):
    """``Shard(dim)`` taken *inside* the shards of the later mesh dims that shard ``dim``.

    Plain shards of one tensor dim nest in mesh-dim order: mesh dim 0 takes its chunk first.
    ``fully_shard`` over a tensor-parallel parameter does the opposite: tensor parallelism
    (a later mesh dim) chunked the tensor first, and FSDP (an earlier mesh dim) chunks that
    chunk again. This placement records that order; ``split_factor`` is the number of pieces
    the later mesh dims cut the dim into (PyTorch's ``_StridedShard`` has the same meaning).

    As in PyTorch it is not a ``Shard``: ``isinstance(_StridedShard(0, split_factor=2),
    Shard)`` and ``is_shard()`` are False; ``is_shard_like`` holds for both.

    Example:
        >>> # 8 rows on a (dp=2, tp=2) mesh; rank (dp=i, tp=j) holds chunk i of chunk j:
        >>> local_shape_and_offset((8,), (2, 2), (1, 0), (_StridedShard(0, 2), Shard(0)))
        ((2,), (2,))
    """

    __slots__ = ("dim", "split_factor")

    def __init__(self, dim: int, split_factor: int = 1, *, sf: int | None = None) -> None:
        if sf is not None:
            if split_factor != 1:
                raise TypeError(
                    f"_StridedShard: pass split_factor or sf, not both (got {split_factor!r} "
                    f"and {sf!r})."
                )
            split_factor = sf
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"_StridedShard: dim must be an int, got {dim!r}.")
        if not isinstance(split_factor, int) or isinstance(split_factor, bool) or split_factor < 1:
            raise ValueError(
                f"_StridedShard: split_factor must be an int >= 1, got {split_factor!r}."
            )
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", split_factor)

    def _ctor_args(self) -> tuple:
        return (self.dim, self.split_factor)

    def normalized(self, ndim: int, *, api: str = "Shard") -> _StridedShard:
        plain = Shard(self.dim).normalized(ndim, api=api)
        return self if plain.dim == self.dim else _StridedShard(plain.dim, self.split_factor)

    def local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int):
        """``(size, first offset)`` of what rank ``rank`` of ``num_chunks`` holds of a dim of
        ``curr_local_size``: chunk ``rank`` of each of the ``split_factor`` pieces. The offset
        is -1 for an empty shard (PyTorch's answer).

        Example:
            >>> _StridedShard(0, split_factor=2).local_shard_size_and_offset(9, 2, 1)
            (4, 3)
        """
        size, first = 0, -1
        pieces = zip(
            chunk_sizes(curr_local_size, self.split_factor),
            chunk_offsets(curr_local_size, self.split_factor),
        )
        for piece, start in pieces:
            n = chunk_sizes(piece, num_chunks)[rank]
            if n and first < 0:
                first = start + chunk_offsets(piece, num_chunks)[rank]
            size += n
        return size, first

    def _to_torch(self):
        return _torch_module()._StridedShard(self.dim, split_factor=self.split_factor)

    def __eq__(self, other):
        if type(other) is _StridedShard:
            return other.dim == self.dim and other.split_factor == self.split_factor
        return self._equals_torch(other)

    def __hash__(self):
        return hash((self.dim, self.split_factor))  # as PyTorch's _StridedShard

    def __repr__(self):
        return f"_StridedShard(dim={self.dim}, split_factor={self.split_factor})"

    def __str__(self):
        return f"_S({self.dim}, {self.split_factor})"


def is_shard_like(p) -> bool:
    """Whether ``p`` splits a tensor dim: a ``Shard`` or a ``_StridedShard`` (which, as in
    PyTorch, is no ``Shard``).

    Example:
        >>> is_shard_like(_StridedShard(0, split_factor=2)), isinstance(_StridedShard(0, 2), Shard)
        (True, False)
    """
    return isinstance(p, (Shard, _StridedShard))


# The public name of ``_StridedShard``, for libraries that lay out FSDP over tensor
# parallelism (fsdp2); the class keeps PyTorch's private name, which its repr shows.
StridedShard = _StridedShard


class Replicate(Placement):
    """Every rank of the mesh dim holds the whole tensor.

    Example:
        >>> dt = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
        >>> dt.to_local().shape   # every rank holds all of it
        torch.Size([4, 4])
    """

    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def _to_torch(self):
        return _torch_module().Replicate()

    def __eq__(self, other):
        if type(other) is Replicate:
            return True
        return self._equals_torch(other)

    def __hash__(self):
        return hash(-1)  # as PyTorch's Replicate

    def __repr__(self):
        return "Replicate()"

    def __str__(self):
        return "R"


class Partial(Placement):
    """Every rank holds a partial value; the tensor is their reduction (``reduce_op``).

    Args:
        reduce_op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"product"`` (PyTorch's
            ``Partial.ALL_REDUCE_OPS``; ``LINEAR_REDUCE_OPS`` are the ones linear ops may
            act on).

    Example:
        >>> str(Partial())
        'P(sum)'
    """

    __slots__ = ("reduce_op",)
    LINEAR_REDUCE_OPS: tuple[str, ...] = _LINEAR_REDUCE_OPS
    ALL_REDUCE_OPS: tuple[str, ...] = _REDUCE_OPS

    def __init__(self, reduce_op: str = "sum") -> None:
        if reduce_op not in self._valid_ops():
            raise ValueError(
                f"Partial: reduce_op must be one of {self._valid_ops()}, got {reduce_op!r}."
            )
        object.__setattr__(self, "reduce_op", reduce_op)

    @classmethod
    def _valid_ops(cls) -> tuple[str, ...]:
        return _REDUCE_OPS

    def _ctor_args(self) -> tuple:
        return (self.reduce_op,)

    def is_partial(self) -> bool:
        return True

    @property
    def is_linear(self) -> bool:
        """True when the reduction is a (scaled) sum, so linear ops may act on partials."""
        return self.reduce_op in _LINEAR_REDUCE_OPS

    def _to_torch(self):
        return _torch_module().Partial(self.reduce_op)

    def __eq__(self, other):
        if type(other) is type(self):
            return other.reduce_op == self.reduce_op
        return self._equals_torch(other)

    def __hash__(self):
        return 1 + hash(self.reduce_op)  # as PyTorch's Partial

    def __repr__(self):
        return f"Partial({self.reduce_op!r})"

    def __str__(self):
        return f"P({self.reduce_op})"


class NormPartial(Partial):
    """Partial p-norms: the tensor is the p-norm of the per-rank values.

    Produced by norm reductions over a sharded dim. Partial norms stack without
    communication, and the norm of the stack (what ``clip_grad_norm_`` computes) reduces them
    once and stays exact: ``||(||a||, ||b||)||_p == ||(a, b)||_p``.
    """

    __slots__ = ()

    def __init__(self, norm_type: float = 2.0) -> None:
        object.__setattr__(self, "reduce_op", float(norm_type))

    @classmethod
    def _valid_ops(cls):
        return ()

    @property
    def norm_type(self) -> float:
        return self.reduce_op

    def _to_torch(self):
        math_ops = sys.modules.get("torch.distributed.tensor._ops._math_ops")
        return None if math_ops is None else math_ops._NormPartial(self.norm_type)

    @property
    def is_linear(self) -> bool:
        return False

    def __repr__(self):
        return f"NormPartial({self.reduce_op})"

    def __str__(self):
        return f"P(norm{self.reduce_op:g})"


# --------------------------------------------------------------------------- chunk maths
def chunk_sizes(size: int, num_chunks: int) -> list[int]:
    """Sizes of the ``num_chunks`` shards of a dim of ``size``, ``torch.chunk`` style.

    Example:
        >>> chunk_sizes(7, 4), chunk_sizes(3, 4)
        ([2, 2, 2, 1], [1, 1, 1, 0])
    """
    step = padded_chunk_size(size, num_chunks)
    return [max(0, min(step, size - i * step)) for i in range(num_chunks)]


def chunk_offsets(size: int, num_chunks: int) -> list[int]:
    """Start index of every shard (empty shards start at ``size``).

    Example:
        >>> chunk_offsets(7, 4)
        [0, 2, 4, 6]
    """
    step = padded_chunk_size(size, num_chunks)
    return [min(i * step, size) for i in range(num_chunks)]


def padded_chunk_size(size: int, num_chunks: int) -> int:
    """The largest shard: ``ceil(size / num_chunks)``; every padded shard has this size."""
    return -(-size // num_chunks) if size else 0


def normalize_placements(placements, mesh_ndim: int, tensor_ndim: int, *, api: str):
    """Validate user placements and return them as a tuple with non-negative shard dims.

    Raises:
        TypeError: a placement class was passed instead of an instance, or a non-placement.
        ValueError: the number of placements differs from the mesh ndim, or a shard dim is
            out of range.
    """
    if placements is None:
        return (Replicate(),) * mesh_ndim
    if isinstance(placements, Placement) or is_torch_placement(placements):
        placements = (placements,)
    placements = tuple(from_torch_placement(p) for p in placements)
    for p in placements:
        if isinstance(p, type) and issubclass(p, Placement):
            raise TypeError(
                f"{api}: placements must hold Placement instances, got the class "
                f"{p.__name__}. Write {p.__name__}() (e.g. Shard(0), Replicate())."
            )
        if not isinstance(p, Placement) or is_torch_placement(p):  # one ours lacks
            raise TypeError(
                f"{api}: placements must hold dtensor Shard/Replicate/Partial instances, got "
                f"{p!r} ({type(p).__module__}.{type(p).__qualname__}). Use "
                "`from dtensor import Shard, Replicate, Partial`."
            )
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{api}: placements must have one entry per mesh dim ({mesh_ndim}), got "
            f"{len(placements)}: {format_placements(placements)}. Add or remove entries."
        )
    placements = tuple(
        p.normalized(tensor_ndim, api=api) if is_shard_like(p) else p for p in placements
    )
    _check_strided(placements, api=api)
    return placements


def _check_strided(placements, *, api: str) -> None:
    """A ``_StridedShard`` needs a later plain ``Shard`` of the same dim to sit inside."""
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            later = [q for q in placements[i + 1 :] if type(q) is Shard and q.dim == p.dim]
            if not later:
                raise ValueError(
                    f"{api}: {p!r} on mesh dim {i} needs a later mesh dim with Shard({p.dim}) "
                    f"to split inside, got {format_placements(placements)}. Use Shard({p.dim})."
                )


def shard_order(placements, tensor_dim: int) -> list[int]:
    """The mesh dims sharding ``tensor_dim``, in the order they split it (outermost first):
    plain shards in mesh-dim order, then strided ones ([Note: nested shards]).

    Example:
        >>> shard_order((_StridedShard(0, 2), Shard(0)), 0)
        [1, 0]
    """
    plain, strided = [], []
    for i, p in enumerate(placements):
        if is_shard_like(p) and p.dim == tensor_dim:
            (strided if isinstance(p, _StridedShard) else plain).append(i)
    return plain + strided


# [Note: PyTorch's placements] PyTorch's Shard, _StridedShard, Replicate and Partial mean
# what ours do. Code that mixes the libraries (a recipe half ported, or torchtitan, whose
# spmd_types dependency builds PyTorch's placements that it then checks against the
# placements of our DTensors) compares them. So one of ours equals one of PyTorch's (or of a
# subclass of its types) exactly when PyTorch would find that object equal to its own
# version of ours, and hashes as PyTorch's do: PyTorch's ``__eq__`` answers NotImplemented
# for a foreign object, and Python then asks ours, so ``==`` and ``!=`` agree in either
# order. (PyTorch's ``_StridedShard``, ``_MaskPartial`` and ``_NormPartial`` answer False instead; for them
# only ours-first comparisons are true.) Nothing here imports PyTorch's DTensor: if it was
# never imported, no object can be one of its placements.


def _torch_module():
    """``torch.distributed.tensor.placement_types``, loaded (a PyTorch placement exists)."""
    return sys.modules["torch.distributed.tensor.placement_types"]


def is_torch_placement(obj) -> bool:
    """Whether ``obj`` is one of PyTorch's placements (``torch.distributed.tensor``), of any
    subclass of its placement types.

    Example:
        >>> from torch.distributed.tensor import Shard as TorchShard
        >>> is_torch_placement(TorchShard(0)), is_torch_placement(Shard(0))
        (True, False)
    """
    module = sys.modules.get("torch.distributed.tensor.placement_types")
    cls = getattr(module, "Placement", None)
    # a port that rebinds PyTorch's name to ours must not make ours look like PyTorch's
    return isinstance(cls, type) and cls.__module__.startswith("torch.") and isinstance(obj, cls)


def from_torch_placement(p):
    """PyTorch's ``Shard``/``_StridedShard``/``Replicate``/``Partial`` (or a subclass) as ours,
    with the same meaning; anything else unchanged ([Note: PyTorch's placements]).

    PyTorch's partial norms (``_NormPartial``) become ``NormPartial``. Its ``_MaskPartial``
    (a vocabulary-parallel embedding's partial, reduced through a mask it carries) has no
    equivalent here and stays as it is, as does a Partial with a reduction ours lacks.

    Example:
        >>> from torch.distributed.tensor import Shard as TorchShard
        >>> from_torch_placement(TorchShard(1))
        Shard(dim=1)
    """
    if not is_torch_placement(p):
        return p
    import torch._C._distributed as kinds  # the base classes of PyTorch's placements

    if isinstance(p, kinds.StridedShard):
        return _StridedShard(p.dim, int(p.split_factor))
    if isinstance(p, kinds.Shard):
        return Shard(p.dim)
    if isinstance(p, kinds.Replicate):
        return Replicate()
    if isinstance(p, kinds.Partial) and not isinstance(p, _torch_module()._MaskPartial):
        norm_type = getattr(p, "norm_type", None)
        if norm_type is not None:
            return NormPartial(norm_type)
        if p.reduce_op in _REDUCE_OPS:
            return Partial(p.reduce_op)
    return p


def format_placements(placements) -> str:
    """Short form for logs and errors, e.g. ``(S(0), R)``."""
    return "(" + ", ".join(str(p) for p in placements) + ")"


def local_shape_and_offset(global_shape, mesh_shape, coordinate, placements):
    """This rank's local shape and its offset in the global tensor.

    Several mesh dims may shard the same tensor dim; they split it in ``shard_order`` (plain
    shards in mesh-dim order - the shard of mesh dim 0 is split again by mesh dim 1 - then
    ``_StridedShard`` ones). Every local piece is one contiguous box of the global tensor.

    Example:
        >>> local_shape_and_offset((7, 5), (2, 2), (1, 1), (Shard(0), Shard(0)))
        ((1, 5), (6, 0))
    """
    shape = list(global_shape)
    offset = [0] * len(shape)
    for tdim in sorted({p.dim for p in placements if is_shard_like(p)}):
        for mesh_dim in shard_order(placements, tdim):
            n, k = shape[tdim], mesh_shape[mesh_dim]
            i = coordinate[mesh_dim]
            offset[tdim] += chunk_offsets(n, k)[i]
            shape[tdim] = chunk_sizes(n, k)[i]
    return tuple(shape), tuple(offset)
