"""Sharding rules, one module per op family. Importing this package registers them all."""

from dtensor._ops import (  # noqa: F401
    matmul,
    nn,
    pointwise,
    random,
    reductions,
    tensor_ops,
    views,
)
