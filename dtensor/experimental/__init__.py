"""Experimental DTensor APIs, under the names PyTorch gives them
(``torch.distributed.tensor.experimental``).

Example:
    >>> from dtensor.experimental import local_map
    >>> scaled = local_map(lambda t: t * 2, out_placements=[Shard(0)])
    >>> scaled(distribute_tensor(torch.ones(6), mesh, [Shard(0)])).placements
    (Shard(dim=0),)
"""

from dtensor.experimental._local_map import local_map

__all__ = ["local_map"]
