"""In-place random fills (``normal_``, ``uniform_``, ...), as ``nn.init`` uses them.

A replicated tensor runs the op locally: ranks that share a seed draw the same values. A
sharded tensor draws the *whole* tensor on every rank and keeps its own block, so a model
initialized after sharding (meta-device construction, then ``reset_parameters()``) gets
exactly the values a single process with the same seed would draw. The full draw is one
parameter at a time, never the whole model. Partial targets are refused: a random partial
sum has no meaning.

On CPU a large full draw lives in its own anonymous memory mapping (`_scratch`), which goes
back to the operating system the moment the draw is dropped. From the ordinary allocator,
glibc would keep the freed block in the process heap, and it would show in the peak RSS of
the whole run (about 25 MB for the benchmark GPT's embedding, measured with mallinfo2).
"""

from __future__ import annotations

import math
import mmap

import torch

from dtensor._ops._common import OpSchema, OutputSharding, register
from dtensor.placement import Partial, is_shard_like

aten = torch.ops.aten

_RANDOM_INPLACE = (
    aten.normal_,
    aten.uniform_,
    aten.exponential_,
    aten.log_normal_,
    aten.cauchy_,
    aten.geometric_,
    aten.random_,
    aten.bernoulli_,
)


@register(*_RANDOM_INPLACE)
def random_inplace(schema: OpSchema) -> OutputSharding:
    spec = schema.leaves[0]
    if any(isinstance(p, Partial) for p in spec.placements):
        raise NotImplementedError(
            f"{schema.name}: cannot fill a Partial DTensor with random values; "
            "redistribute it to Shard or Replicate first."
        )
    keep = {i: spec.placements for i in schema.spec_indices()}
    if not any(is_shard_like(p) for p in spec.placements):
        return OutputSharding([spec.placements], keep)
    shape, offset = spec.local_shape_and_offset()
    box = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    func = schema.func

    def local_fn(local, *args, **kwargs):
        full = _scratch(spec.shape, local.dtype, local.device)
        func(full, *args, **kwargs)
        local.copy_(full[box])
        return local

    return OutputSharding([spec.placements], keep, local_fn)


# Below this size a draw is served from the allocator's small-block pools and costs nothing
# that lasts; above it, a private mapping is worth the system call.
_MAPPED_MIN_BYTES = 1 << 20


def _scratch(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor for a throw-away full draw.

    On CPU, when it is large, its memory is an anonymous ``mmap`` rather than a heap block,
    so dropping the tensor unmaps it. The values a random fill writes do not depend on where
    the memory lives.

    Example::

        >>> buf = _scratch(torch.Size([1024, 1024]), torch.float32, torch.device("cpu"))
        >>> buf.shape
        torch.Size([1024, 1024])
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MAPPED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    # The tensor keeps the mapping alive through the buffer protocol; the mapping is
    # released when the last view of the tensor goes.
    region = mmap.mmap(-1, nbytes)
    return torch.frombuffer(region, dtype=dtype).view(shape)
