"""Sharding rules, one module per op family. Importing this package registers them all."""

from dtensor._ops import (  # noqa: F401
    indexing,
    layers,
    linalg,
    losses,
    matmul,
    nn,
    pointwise,
    random,
    reductions,
    scans,
    shape_ops,
    tensor_ops,
    views,
)
