"""What differs between the PyTorch releases the suite supports (2.11 to 2.13), in one place.

The library itself has no version-specific path (the whole suite passes on 2.11, 2.12 and
2.13 with the same code); what differs is PyTorch's own behaviour in the comparison arms of
the tests, and the releases a test-only client supports. Each difference is a named fact
here, with the release that changed it, so a test says which one it depends on.

Example:
    >>> from tests import _torch_compat as compat
    >>> compat.TORCH >= (2, 11)
    True
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor

#: (major, minor) of the PyTorch in use.
TORCH: tuple[int, int] = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

#: ``DTensor.from_local(..., grad_placements=...)``: PyTorch 2.12 and later.
FROM_LOCAL_HAS_GRAD_PLACEMENTS = (
    "grad_placements" in inspect.signature(DTensor.from_local).parameters
)

#: PyTorch's FSDP2 casts a checkpointed block's floating inputs (``cast_forward_inputs``) when
#: it recomputes the block, as in forward: 2.13. 2.11 and 2.12 skip the cast, and a block
#: given an fp32 tensor made outside it fails in backward (2.11: ``CheckpointError``, 2.12:
#: "mixed dtype (CPU): expect parameter to have scalar type of Float").
FSDP2_RECOMPUTE_CASTS_INPUTS = TORCH >= (2, 13)

#: torchtitan 0.3.0 (the pinned test client) imports ``DataParallelMeshDims`` from
#: ``torch.distributed.fsdp``, which PyTorch 2.12 added: on 2.11 it cannot be imported.
TORCHTITAN_RUNS = TORCH >= (2, 12)
TORCHTITAN_SKIP = (
    "torchtitan 0.3.0 needs PyTorch >= 2.12 (torch.distributed.fsdp.DataParallelMeshDims)"
)
#: ... and its sequence parallelism fails on PyTorch 2.12's own DTensor (the comparison arm:
#: "view size is not compatible with input tensor's size and stride" in its fused qkv linear).
TORCHTITAN_SP_RUNS = TORCH >= (2, 13)
TORCHTITAN_SP_SKIP = "torchtitan 0.3.0's sequence parallelism fails on PyTorch < 2.13's DTensor"


def in_range(versions: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether the PyTorch in use is within ``(oldest, newest)``, both included.

    Example:
        >>> in_range(((2, 11), (2, 11)))      # True only on PyTorch 2.11
    """
    return versions[0] <= TORCH <= versions[1]
