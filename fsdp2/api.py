"""Policies passed to ``fully_shard``: mixed precision and offloading."""

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
