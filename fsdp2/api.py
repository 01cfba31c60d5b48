"""Policies passed to ``fully_shard``: mixed precision, offloading, and the data-parallel dims
of a full SPMD mesh (``DataParallelMeshDims``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the unsharded parameters, the gradient reduction and the forward outputs.

    The optimizer never sees these dtypes: sharded parameters and their gradients keep the
    dtype the model was built in.

    Attributes:
        param_dtype: dtype of the all-gathered parameters used by forward and backward
            (``None``: the original dtype).
        reduce_dtype: dtype in which gradients are summed across ranks (``None``: the
            ``param_dtype``, or the original dtype when that is ``None`` too).
        output_dtype: cast floating forward outputs to this dtype (``None``: no cast).
        cast_forward_inputs: cast floating forward inputs to ``param_dtype``.

    Example:
        >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> fully_shard(block, mp_policy=policy)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecisionPolicy: {name} must be a floating torch.dtype or None, "
                    f"got {value!r}."
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded state lives on the compute device (the default).

    Example:
        >>> fully_shard(model, offload_policy=OffloadPolicy())
    """


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state in host memory.

    Shards are copied to the compute device for each all-gather and gradients copied back
    after each reduction; the optimizer steps on CPU. With a CPU compute device (gloo) the
    state is already on the host and the policy costs nothing.

    Attributes:
        pin_memory: page-lock the host copies so device transfers can be asynchronous.

    Example:
        >>> fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=True))
    """

    pin_memory: bool = True


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data parallel, for ``fully_shard(mesh=...,
    dp_mesh_dims=...)`` (PyTorch's "full DTensor" mode, as in torchtitan).

    ``mesh`` is then the whole mesh the parameters already live on - data-parallel dims and
    tensor-parallel ones alike - and every parameter is a DTensor on it with ``Replicate()``
    on the data-parallel dims. ``fully_shard`` shards each parameter over the ``shard`` dim
    (its placement there becomes ``Shard(d)``), replicates it over the ``replicate`` dim
    (HSDP), and leaves the other dims' placements as they are.

    Attributes:
        shard: the mesh dim name FSDP shards over (required here; PyTorch also takes a tuple
            of names, flattened into one dim, and None for plain replication - not
            supported here yet: ``fully_shard`` raises NotImplementedError).
        replicate: the mesh dim name of HSDP's replication, or None.

    Raises:
        ValueError: neither is set, or a name is not a str (or a tuple of str).

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> # every parameter: a DTensor on mesh, Replicate() on "dp", TP placements on "tp"
        >>> fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims: set shard (the mesh dim name FSDP shards over), "
                "replicate (HSDP's replication dim), or both; got neither."
            )
        for field_name in ("shard", "replicate"):
            value = getattr(self, field_name)
            names = (value,) if isinstance(value, str) else value
            if names is not None and not (
                isinstance(names, tuple) and names and all(isinstance(n, str) for n in names)
            ):
                raise ValueError(
                    f"DataParallelMeshDims: {field_name} must be a mesh dim name (str), a "
                    f"non-empty tuple of names, or None; got {value!r}."
                )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """``shard`` as a tuple of names (empty when None)."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """``replicate`` as a tuple of names (empty when None)."""
        return _names(self.replicate)


def _names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def as_dp_mesh_dims(dims, *, api: str = "fully_shard") -> DataParallelMeshDims | None:
    """``dims`` as our ``DataParallelMeshDims`` (None stays None); PyTorch's is converted.

    Raises:
        TypeError: anything else, naming its type and the import to use.

    Example:
        >>> from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
        >>> as_dp_mesh_dims(TorchDims(shard="dp")).shard
        'dp'
    """
    if dims is None or isinstance(dims, DataParallelMeshDims):
        return dims
    if _is_torch_policy(dims, "DataParallelMeshDims"):
        return DataParallelMeshDims(shard=dims.shard, replicate=dims.replicate)
    raise TypeError(
        f"{api}: dp_mesh_dims must be an fsdp2.DataParallelMeshDims (or PyTorch's) or None, "
        f"got {type(dims).__module__}.{type(dims).__qualname__}. Use "
        "`from fsdp2 import DataParallelMeshDims`."
    )


def _is_torch_policy(obj, name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == name and cls.__module__.startswith("torch.distributed.fsdp")


def as_mp_policy(policy, *, api: str = "fully_shard") -> MixedPrecisionPolicy:
    """``policy`` as our ``MixedPrecisionPolicy``; PyTorch's (same fields) is converted.

    Raises:
        TypeError: anything else, naming its module and the import to use.

    Example:
        >>> from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        >>> as_mp_policy(TorchMP(param_dtype=torch.bfloat16)).param_dtype
        torch.bfloat16
    """
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if _is_torch_policy(policy, "MixedPrecisionPolicy"):
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
    raise TypeError(
        f"{api}: mp_policy must be an fsdp2.MixedPrecisionPolicy (or PyTorch's), got "
        f"{type(policy).__module__}.{type(policy).__qualname__}. Use "
        "`from fsdp2 import MixedPrecisionPolicy`."
    )


def as_offload_policy(policy, *, api: str = "fully_shard") -> OffloadPolicy:
    """``policy`` as our ``OffloadPolicy``/``CPUOffloadPolicy``; PyTorch's are converted.

    Raises:
        TypeError: anything else, naming its module and the import to use.

    Example:
        >>> from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
        >>> as_offload_policy(TorchOffload(pin_memory=False))
        CPUOffloadPolicy(pin_memory=False)
    """
    if isinstance(policy, OffloadPolicy):
        return policy
    if _is_torch_policy(policy, "CPUOffloadPolicy"):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if _is_torch_policy(policy, "OffloadPolicy"):
        return OffloadPolicy()
    raise TypeError(
        f"{api}: offload_policy must be an fsdp2.OffloadPolicy or CPUOffloadPolicy (or "
        f"PyTorch's), got {type(policy).__module__}.{type(policy).__qualname__}. Use "
        "`from fsdp2 import CPUOffloadPolicy`."
    )
