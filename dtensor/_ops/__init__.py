"""Sharding rules, one module per op family. Importing this package registers them all."""

from dtensor._ops import matmul, nn, pointwise, reductions, tensor_ops, views  # noqa: F401
