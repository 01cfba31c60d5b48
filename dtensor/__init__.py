"""dtensor: a sharded tensor over a DeviceMesh, with placements, redistribution and op rules.

Example:
    >>> from device_mesh import init_device_mesh
    >>> from dtensor import Shard, distribute_tensor
    >>> mesh = init_device_mesh("cpu", (2,))
    >>> dt = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    >>> (dt * 2).sum().full_tensor()
"""

import torch.optim.optimizer as _optim_optimizer
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
from dtensor._workspace import Workspace, collective_workspace, live_workspaces
from dtensor.placement import Partial, Placement, Replicate, Shard
from dtensor.tensor import DTensor

# Let torch.optim and clip_grad_norm_ default to their foreach (multi-tensor) paths for
# DTensors as they do for plain tensors on devices with foreach kernels (CUDA and the like;
# CPU defaults to the per-tensor loop either way). torch.optim and torch.utils keep two
# separate lists: without the first, AdamW on a GPU would loop over DTensor parameters one
# at a time while PyTorch's own DTensor gets the multi-tensor kernels.
for _types in (_optim_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
    if DTensor not in _types:
        _types.append(DTensor)

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
    "collective_workspace",
    "live_workspaces",
    "Workspace",
]
