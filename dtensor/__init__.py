"""dtensor: a sharded tensor over a DeviceMesh, with placements, redistribution and op rules.

Example:
    >>> from device_mesh import init_device_mesh
    >>> from dtensor import Shard, distribute_tensor
    >>> mesh = init_device_mesh("cpu", (2,))
    >>> dt = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    >>> (dt * 2).sum().full_tensor()
"""

import torch.utils._foreach_utils as _foreach_utils

from dtensor import _dispatch  # noqa: F401  (registers the op rules)
from dtensor._api import (
    distribute_module,
    distribute_tensor,
    empty,
    full,
    ones,
    rand,
    randn,
    zeros,
)
from dtensor._clip import clip_grad_norm_, get_total_norm
from dtensor.placement import Partial, Placement, Replicate, Shard
from dtensor.tensor import DTensor

# Let torch.optim and clip_grad_norm_ take their foreach (multi-tensor) paths for DTensors.
if DTensor not in _foreach_utils._foreach_supported_types:
    _foreach_utils._foreach_supported_types.append(DTensor)

__all__ = [
    "DTensor",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "distribute_tensor",
    "distribute_module",
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "clip_grad_norm_",
    "get_total_norm",
]
