"""In-place random fills (``normal_``, ``uniform_``, ...), as ``nn.init`` uses them.

A replicated tensor runs the op locally: ranks that share a seed draw the same values. A
sharded tensor draws the *whole* tensor on every rank and keeps its own block, so a model
initialized after sharding (meta-device construction, then ``reset_parameters()``) gets
exactly the values a single process with the same seed would draw. The full draw is one
parameter at a time, never the whole model. Partial targets are refused: a random partial
sum has no meaning.
"""

from __future__ import annotations

import torch

from dtensor._ops._common import OpSchema, OutputSharding, register
from dtensor.placement import Partial, Shard

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
    if not any(isinstance(p, Shard) for p in spec.placements):
        return OutputSharding([spec.placements], keep)
    shape, offset = spec.local_shape_and_offset()
    box = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    func = schema.func

    def local_fn(local, *args, **kwargs):
        full = torch.empty(spec.shape, dtype=local.dtype, device=local.device)
        func(full, *args, **kwargs)
        local.copy_(full[box])
        return local

    return OutputSharding([spec.placements], keep, local_fn)
