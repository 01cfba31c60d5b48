"""The analytic expectation of one training step's collectives: pure maths, no process group.

What this library's collectives send, per step, follows from the model's structure and the
settings alone. This module computes it, in the units ``dtensor.debug.CommDebugMode``
records: one entry per collective with its kind, the mesh dim it runs over (the dim's name
when the mesh names its dims, else its index), the group size, and ``bytes`` - what *each
rank contributes* (an all-gather's input, a reduce-scatter's or all-reduce's input).

[Note: what fully_shard sends per step] For one ``fully_shard`` group, with ``N`` the sum
of its parameters' padded numels (``ceil(rows / shard_size) * row_numel`` each, rows along
the shard dim: the last ranks' shards are padded to the largest) and ``n`` the number of its
parameters that require a gradient (``N_g`` their padded numels):

* forward: one all-gather over the shard dim, ``N x itemsize(param_dtype)`` bytes (a group
  mixing dtypes sends one row of bytes, each slot rounded up to the group's alignment);
* backward: one more all-gather when the group resharded after forward
  (``reshard_after_forward=True``); with an int ``k`` it re-gathers only within groups of
  ``k`` ranks, ``shard_size / k`` rows of the forward's row width; with False none;
* backward: one reduce-scatter over the shard dim of ``shard_size x (N_g + n) x
  itemsize(reduce_dtype)`` bytes - every rank's row of gradients plus one "had a gradient"
  flag per parameter, so a parameter no rank used keeps ``grad=None``;
* HSDP: one all-reduce over the replicate dim of this rank's reduced row, ``(N_g + n) x
  itemsize(reduce_dtype)`` bytes.

``reshard_after_forward=None`` (the default) means True for every group but the root's:
the root's backward starts right after its forward, so resharding it would only gather it
again at once. An explicit True on the root is honoured (it gathers twice). This is
PyTorch's FSDP2 behaviour too (its ``_auto_reshard_after_forward``). A group with one
data-parallel rank and no dtype cast sends nothing; a group without trainable parameters
is not reduced. Gradient accumulation over ``m`` micro-batches repeats the gathers per
micro-batch; the reductions run once (``set_requires_gradient_sync(False)`` on all but the
last micro-batch) or per micro-batch (``sync_every_micro_batch=True``); HSDP's all-reduce
may wait for the last one (``all_reduce_every_micro_batch=False``: the micro-batches before
it ran with ``set_requires_all_reduce(False)``).

[Note: tensor parallelism per block] ``TransformerTP`` gives the collectives of the
Megatron-style plan with sequence parallelism (``examples.gpt.tp_plan``, torchtitan's
plan) over a ``tp`` dim of ``k`` ranks, derived from ``dtensor/parallel/style.py``; see its
docstring.

Example:
    >>> from fsdp2.tools.comm_model import GroupSpec, ParamSpec, expected_step_comms
    >>> block = GroupSpec([ParamSpec((7, 3)), ParamSpec((7,))], shard_size=2, mesh_dim="dp")
    >>> exp = expected_step_comms([block])
    >>> exp.by_mesh_dim()[("all_gather", "dp")]    # (count, bytes): forward + backward
    (2, 128)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fsdp2.tools._records import CommExpectation, ExpectedCollective, _ceil_div, summarize
from fsdp2.tools._tp_model import TransformerTP

__all__ = [
    "ParamSpec",
    "GroupSpec",
    "ExpectedCollective",
    "CommExpectation",
    "TransformerTP",
    "fsdp_group_comms",
    "groups_of",
    "expected_step_comms",
    "clip_grad_comms",
    "summarize",
]

# Route choice of fsdp2/_collectives.py: a gloo group on host memory whose parameters
# average at least this many unsharded bytes sends point-to-point (its all-gather bytes are
# unaligned for a group that mixes dtypes).
_DIRECT_MIN_BYTES_PER_PARAM = 1 << 20


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as ``fully_shard`` sees it.

    ``shape`` is the tensor FSDP shards: the full shape, or under tensor parallelism the
    tensor-parallel *local* shape (``tp_mesh_dim`` and ``tp_size`` then name the
    tensor-parallel dim and its size). ``dtype`` is the parameter's own dtype (the all-gather
    uses ``param_dtype`` when the group's policy sets one).

    Example:
        >>> ParamSpec((50, 16), torch.float32).padded_numel(4)    # 13 rows of 16 per rank
        208
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    requires_grad: bool = True
    shard_dim: int = 0
    tp_mesh_dim: str | int | None = None
    tp_size: int = 1

    def padded_numel(self, shard_size: int) -> int:
        """Elements this parameter adds to one rank's row of a grouped collective."""
        rows = self.shape[self.shard_dim] if self.shape else 1
        row_numel = math.prod(self.shape) // rows if rows else 0
        return _ceil_div(rows, shard_size) * row_numel


@dataclass(frozen=True)
class GroupSpec:
    """One ``fully_shard`` call's parameter group and its settings, resolved.

    Args:
        params: the group's parameters.
        shard_size: ranks along the shard mesh dim.
        mesh_dim: the label collectives over the shard dim are recorded under (the dim's
            name, e.g. ``"dp"`` or ``"dp_shard"``, or its index on an unnamed mesh).
        replicate_size / replicate_mesh_dim: HSDP's replicate dim (size 1: plain FSDP).
        reshard_after_forward: resolved: True, False or an int ``k`` (a root given None
            is False; see ``groups_of``).
        param_dtype / reduce_dtype: the mixed-precision policy's (None: as PyTorch).
        name: for reports (the module path).
        device_type / backend: decide the route, which matters only for the all-gather
            bytes of a group mixing dtypes.
        offload: CPU offload on an accelerator (a group of one rank then still moves).

    Example:
        >>> GroupSpec([ParamSpec((64, 64))], shard_size=8, mesh_dim="dp", name="blocks.0")
    """

    params: Sequence[ParamSpec]
    shard_size: int
    mesh_dim: str | int | None = 0
    replicate_size: int = 1
    replicate_mesh_dim: str | int | None = None
    reshard_after_forward: bool | int = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    name: str = ""
    device_type: str = "cpu"
    backend: str = "gloo"
    offload: bool = False

    def compute_dtype(self, p: ParamSpec) -> torch.dtype:
        return self.param_dtype or p.dtype

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        """The one dtype of the group's reduction, as ``FSDPParamGroup.reduce_dtype``."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        dtypes = {self.compute_dtype(p) for p in self.params if p.requires_grad}
        dtypes = dtypes or {self.compute_dtype(p) for p in self.params}
        return functools.reduce(torch.promote_types, sorted(dtypes, key=str))

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicate_size

    @property
    def trivial(self) -> bool:
        """One data-parallel rank and no cast: the shard is the parameter, nothing moves."""
        return (
            self.data_parallel_size == 1
            and all(self.compute_dtype(p) == p.dtype for p in self.params)
            and not self.offload
        )

    def gather_row_bytes(self) -> int:
        """Bytes of one rank's row of the group's all-gather."""
        ws = self.shard_size
        numels = [p.padded_numel(ws) for p in self.params]
        dtypes = [self.compute_dtype(p) for p in self.params]
        if len(set(dtypes)) <= 1:
            return sum(numels) * (dtypes[0].itemsize if dtypes else 4)
        # one row of bytes, each slot aligned (RowLayout); the direct route sends each
        # parameter in its own dtype, unaligned
        align = max(8, *(d.itemsize for d in dtypes))
        aligned = sum(_ceil_div(n * d.itemsize, align) * align for n, d in zip(numels, dtypes))
        if self._direct(aligned * ws):
            return sum(n * d.itemsize for n, d in zip(numels, dtypes))
        return aligned

    def _direct(self, unsharded_bytes: int) -> bool:
        return (
            self.device_type == "cpu"
            and self.backend == "gloo"
            and unsharded_bytes >= _DIRECT_MIN_BYTES_PER_PARAM * len(self.params)
        )

    def reduce_row_numel(self) -> int:
        """Elements of one rank's row of the gradient reduction (values, then flags)."""
        trained = [p for p in self.params if p.requires_grad]
        return sum(p.padded_numel(self.shard_size) for p in trained) + len(trained)


# --------------------------------------------------------------------------- fully_shard
def fsdp_group_comms(
    group: GroupSpec,
    *,
    micro_batches: int = 1,
    sync_every_micro_batch: bool = False,
    all_reduce_every_micro_batch: bool | None = None,
) -> list[ExpectedCollective]:
    """The collectives of one ``fully_shard`` group over one step, in issue order per
    micro-batch ([Note: what fully_shard sends per step]).

    Example:
        >>> g = GroupSpec([ParamSpec((7, 3))], shard_size=2, mesh_dim="dp")
        >>> [(c.kind, c.bytes) for c in fsdp_group_comms(g)]
        [('all_gather', 48), ('all_gather', 48), ('reduce_scatter', 104)]
    """
    if not group.params or group.trivial:
        return []
    ws, label, name = group.shard_size, group.mesh_dim, group.name
    row = group.gather_row_bytes()
    rab = group.reshard_after_forward
    gather = ExpectedCollective("all_gather", label, ws, row, "forward", name)
    regather: ExpectedCollective | None = None
    if rab is True or (not isinstance(rab, bool) and rab in (1, ws)):
        regather = ExpectedCollective("all_gather", label, ws, row, "backward", name)
    elif rab is not False and not isinstance(rab, bool):
        # reshard_after_forward=k: ws / k rows kept, gathered within groups of k
        regather = ExpectedCollective("all_gather", label, rab, ws // rab * row, "backward", name)
    trained = any(p.requires_grad for p in group.params)
    itemsize = group.grad_reduce_dtype.itemsize
    reduce = ExpectedCollective(
        "reduce_scatter", label, ws, ws * group.reduce_row_numel() * itemsize, "backward", name
    )
    all_reduce = None
    if group.replicate_size > 1 or group.replicate_mesh_dim is not None:
        all_reduce = ExpectedCollective(
            "all_reduce",
            group.replicate_mesh_dim,
            group.replicate_size,
            group.reduce_row_numel() * itemsize,
            "backward",
            name,
        )
    if all_reduce_every_micro_batch is None:
        all_reduce_every_micro_batch = sync_every_micro_batch
    out: list[ExpectedCollective] = []
    for i in range(micro_batches):
        last = i == micro_batches - 1
        out.append(gather)
        if regather is not None:
            out.append(regather)
        if trained and (sync_every_micro_batch or last):
            out.append(reduce)
            if all_reduce is not None and (all_reduce_every_micro_batch or last):
                out.append(all_reduce)
    return out


def groups_of(model: torch.nn.Module) -> list[GroupSpec]:
    """The ``GroupSpec`` of every ``fully_shard`` group at or below ``model`` (wrapped by
    ``fully_shard`` / ``parallelize_transformer``, before or after its first forward;
    built on the meta device or a fake process group is fine: nothing is communicated).

    ``reshard_after_forward`` is resolved as the root's lazy init resolves it: None is
    False for the outermost call (the root) and True for the others.

    Raises:
        ValueError: ``model`` holds no ``fully_shard`` module.

    Example:
        >>> [g.name for g in groups_of(model)]     # outermost (the root) first
        ['', 'blocks.0', 'blocks.1']
    """
    from fsdp2._state import states_below  # fsdp2's own runtime: read, never changed

    states = states_below([model])
    if not states:
        raise ValueError(
            "groups_of: model has no fully_shard module below it; call fully_shard (or "
            "fsdp2.parallelize_transformer) on it first, or describe the groups with GroupSpec."
        )
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    return [
        _group_spec(s, paths.get(id(s.modules[0]), type(s.modules[0]).__name__))
        for s in states
        if s.group is not None
    ]


def _resolved_reshard_after_forward(s) -> bool | int:
    """State ``s``'s ``reshard_after_forward`` as its root's lazy init resolves it: None is
    False for the root and True for the others; a group that reshards after forward to
    groups of ``k`` ranks (its ``post_forward``) gives the int ``k``."""
    g = s.group
    root = s.is_root if s.ctx is not None else s.outer is None
    rab: bool | int = g.reshard_after_forward
    if rab is None:  # before the root's lazy init resolves it
        arg = s.reshard_after_forward_arg
        rab = (not root) if arg is None else bool(arg)
    if rab and g.post_forward is not None:  # an int k (kept rows, smaller regather)
        rab = g.post_forward.size
    return rab


def _group_spec(s, name: str) -> GroupSpec:
    """The ``GroupSpec`` of state ``s``'s ``fully_shard`` group, called ``name``."""
    g = s.group
    rab = _resolved_reshard_after_forward(s)
    info = g.mesh_info
    mesh = info.mesh
    names = mesh.mesh_dim_names

    def label(dim):
        return names[dim] if names else dim

    return GroupSpec(
        params=[
            ParamSpec(tuple(p.shape), p.dtype, p.requires_grad, p.shard_dim, *_tp_dim(p))
            for p in g.params
        ],
        shard_size=info.shard_size,
        mesh_dim=label(info.shard_mesh_dim),
        replicate_size=info.replicate_size,
        replicate_mesh_dim=(
            None if info.replicate_mesh_dim is None else label(info.replicate_mesh_dim)
        ),
        reshard_after_forward=rab,
        param_dtype=g.mp_policy.param_dtype,
        reduce_dtype=g.mp_policy.reduce_dtype,
        name=name,
        device_type=g.device.type,
        backend=_backend_of(mesh),
        offload=g.offload,
    )


def _tp_dim(p) -> tuple[str | int | None, int]:
    """The tensor-parallel dim a parameter is laid out over (label, size), or (None, 1)."""
    if p.tp_spec is None:
        return None, 1
    mesh = p.tp_spec.mesh
    return (mesh.mesh_dim_names[0] if mesh.mesh_dim_names else 0), mesh.size()


def _backend_of(mesh) -> str:
    return "gloo" if mesh.device_type == "cpu" else "nccl"


def expected_step_comms(
    model_or_groups: torch.nn.Module | Iterable[GroupSpec],
    *,
    tp: TransformerTP | None = None,
    micro_batches: int = 1,
    sync_every_micro_batch: bool = False,
    all_reduce_every_micro_batch: bool | None = None,
    clip_grad_norm: bool = False,
) -> CommExpectation:
    """The collectives one training step (forward, backward, optimizer step) is expected
    to issue on each rank.

    Args:
        model_or_groups: a module wrapped by ``fully_shard`` (its groups are read with
            ``groups_of``) or ``GroupSpec`` descriptions (a planner's, no model needed).
        tp: the tensor-parallel part (``TransformerTP``), if any.
        micro_batches: forward/backward passes per optimizer step (gradient accumulation).
        sync_every_micro_batch: reduce gradients after every micro-batch rather than only
            after the last (``set_requires_gradient_sync(False)`` on the others).
        all_reduce_every_micro_batch: HSDP: all-reduce after every reduction (None: as
            ``sync_every_micro_batch``); False when the micro-batches before the last ran
            with ``set_requires_all_reduce(False)``.
        clip_grad_norm: the step calls ``torch.nn.utils.clip_grad_norm_`` on the model's
            parameters (``clip_grad_comms``).

    Raises:
        ValueError: ``micro_batches`` below 1.

    Example:
        >>> exp = expected_step_comms(model)    # the GPT of docs/tools.md over 2 ranks
        >>> exp.by_mesh_dim()
        {('all_gather', 'dp'): (5, 419584), ('reduce_scatter', 'dp'): (3, 439528)}
    """
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(
            f"expected_step_comms: micro_batches must be an int >= 1, got {micro_batches!r}."
        )
    if isinstance(model_or_groups, torch.nn.Module):
        groups = groups_of(model_or_groups)
    else:
        groups = list(model_or_groups)
    records: list[ExpectedCollective] = []
    for g in groups:
        records += fsdp_group_comms(
            g,
            micro_batches=micro_batches,
            sync_every_micro_batch=sync_every_micro_batch,
            all_reduce_every_micro_batch=all_reduce_every_micro_batch,
        )
    if tp is not None:
        records += tp.comms() * micro_batches
    if clip_grad_norm:
        records += clip_grad_comms(groups)
    return CommExpectation(records)


def clip_grad_comms(groups: Iterable[GroupSpec]) -> list[ExpectedCollective]:
    """The collectives of ``clip_grad_norm_`` over the sharded parameters of ``groups``.

    ``dtensor``'s total norm takes the norms of the gradients on one mesh together and
    all-reduces the stacked per-parameter norms once over each mesh dim that shards them:
    the shard dim (not HSDP's replicate dim) and the tensor-parallel dim, ``n x itemsize``
    bytes for ``n`` trainable parameters on that mesh.

    Example:
        >>> [(c.kind, c.mesh_dim, c.bytes) for c in clip_grad_comms(groups_of(model))]
        [('all_reduce', 'dp', 116)]
    """
    meshes: dict[tuple, list[ParamSpec]] = {}
    for g in groups:
        for p in g.params:
            if p.requires_grad and g.data_parallel_size > 1:
                key = (g.mesh_dim, g.shard_size, p.tp_mesh_dim, p.tp_size, g.replicate_mesh_dim)
                meshes.setdefault(key, []).append(p)
    out = []
    for (label, size, tp_label, tp_size, _), params in meshes.items():
        nbytes = len(params) * max(p.dtype.itemsize for p in params)
        out.append(ExpectedCollective("all_reduce", label, size, nbytes, "optimizer", "clip"))
        if tp_label is not None:
            out.append(
                ExpectedCollective("all_reduce", tp_label, tp_size, nbytes, "optimizer", "clip")
            )
    return out
