"""The forward of a tensor-parallel ``nn.Linear`` / ``nn.Embedding`` on local tensors.

[Note: local compute] A planned module's parameters are DTensors on the tensor-parallel mesh
(so FSDP, the optimizer, clipping and checkpoints see them), and its inputs and outputs are
DTensors at the module boundary (so layouts compose between styles). Inside, the matmul or
lookup runs on the local tensors with the Megatron collectives made explicit, instead of
sending ``F.linear`` through DTensor's op rules:

* column-parallel: ``y_r = x @ W_r^T`` needs nothing forward; the input gradients of the
  ranks are partial sums, which ``to_local(grad_placements=[Partial()])`` declares, so the
  input's redistribute does the all-reduce (or reduce-scatter) backward;
* row-parallel: ``x_r @ W_r^T`` is a partial sum, declared ``Partial`` and redistributed to
  the output layout (all-reduce, or reduce-scatter for a sequence-sharded output) before the
  bias is added once;
* vocab-parallel embedding: ids outside this rank's rows look up nothing (zeros), and the
  partial results are summed the same way.

The answer and the collectives are those of the DTensor route; what changes is the count of
Python dispatches per step (one ``F.linear`` call instead of the ``t``/``mm``/``view``/
``add`` ops of forward and backward each going through the rule pipeline). PyTorch's styles
take the rule route; ``benchmarks/tp_bench.py`` times both on the same plan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtensor.placement import Partial, Shard, chunk_offsets, chunk_sizes, is_shard_like
from dtensor.tensor import DTensor

_PARTIAL = (Partial(),)


def _replicated_input(x) -> torch.Tensor:
    """A replicated DTensor input as a local tensor whose gradient is a partial sum."""
    if not isinstance(x, DTensor):
        return x
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return x.to_local(grad_placements=_PARTIAL)
    return x.to_local()


def _local(x) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _sharded_last(y: torch.Tensor, mesh, full_last: int) -> DTensor:
    shape = (*y.shape[:-1], full_last)
    return DTensor.from_local(y, mesh, (Shard(y.ndim - 1),), shape=shape)


def _reduced(y: torch.Tensor, mesh, layout, bias) -> DTensor:
    """Sum the partial results ``y`` into ``layout``; add ``bias`` once, after the sum."""
    out = DTensor.from_local(y, mesh, _PARTIAL, shape=y.shape).redistribute(placements=(layout,))
    if bias is None:
        return out
    grad_layout = _PARTIAL if is_shard_like(layout) else None  # each rank saw some rows
    local = out.to_local() + bias.to_local(grad_placements=grad_layout)
    return DTensor.from_local(local, mesh, out.placements, shape=out.shape)


def colwise_linear(module, x) -> DTensor:
    w = module.weight
    bias = None if module.bias is None else module.bias.to_local()
    y = F.linear(_replicated_input(x), w.to_local(), bias)
    return _sharded_last(y, w.device_mesh, w.shape[0])


def colwise_embedding(module, ids) -> DTensor:
    w = module.weight
    y = F.embedding(
        _local(ids),
        w.to_local(),
        module.padding_idx,
        None,
        module.norm_type,
        module.scale_grad_by_freq,
        module.sparse,
    )
    return _sharded_last(y, w.device_mesh, w.shape[1])


def rowwise_linear(module, x, output_layout) -> DTensor:
    w = module.weight
    y = F.linear(_local(x), w.to_local())
    return _reduced(y, w.device_mesh, output_layout, module.bias)


def rowwise_embedding(module, ids, output_layout) -> DTensor:
    w = module.weight
    mesh = w.device_mesh
    ids = _local(ids)
    rank, k, n = mesh.get_local_rank(), mesh.size(), w.shape[0]
    lo, rows = chunk_offsets(n, k)[rank], chunk_sizes(n, k)[rank]
    local_w = w.to_local()
    outside = (ids < lo) | (ids >= lo + rows)
    if rows == 0:  # this rank holds no rows of the table: it contributes zeros
        y = local_w.new_zeros((*ids.shape, w.shape[1]))
    else:
        y = F.embedding((ids - lo).masked_fill(outside, 0), local_w)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
    return _reduced(y, mesh, output_layout, None)
