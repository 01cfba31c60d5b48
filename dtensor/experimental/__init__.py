"""Experimental DTensor APIs, under the names PyTorch gives them
(``torch.distributed.tensor.experimental``): ``local_map`` (run a plain-tensor function on
local shards), ``register_sharding`` (a sharding rule of one's own for an op) and
``implicit_replication`` (plain tensors mixed with DTensors taken as replicated).

Example:
    >>> from dtensor.experimental import local_map
    >>> scaled = local_map(lambda t: t * 2, out_placements=[Shard(0)])
    >>> scaled(distribute_tensor(torch.ones(6), mesh, [Shard(0)])).placements
    (Shard(dim=0),)
"""

from dtensor.experimental._implicit_replication import implicit_replication
from dtensor.experimental._local_map import local_map
from dtensor.experimental._register_sharding import register_sharding

__all__ = ["implicit_replication", "local_map", "register_sharding"]
