"""Linear algebra (``torch.linalg`` factorizations, solves, ``cross``) and FFTs.

Factorizations and solves (svd, eig/eigh, qr, lu, ldl, cholesky, inv, det/slogdet, pinv,
matrix_exp, householder products, triangular and general solves) mix every entry of each
matrix, so the two matrix dims (the last two; the last one for vectors such as pivots,
eigenvalues or ``tau``) must be whole. The leading *batch* dims are independent problems:
each rank may solve its own block of the batch, given every operand's block of the same
batch entries. Operands broadcast over the batch (aligned from the right, as torch does): one
whose batch dim has size 1 where the result's does not is taken whole. So, per mesh dim:

- a shard of batch dim ``j`` of the (broadcast) batch shape: every operand and output that
  has that dim at full size keeps ``Shard`` of it, the others are replicated;
- solves are linear in the right-hand side ``B``: with the matrix whole, a shard of ``B``'s
  columns (rows for ``left=False``, where ``X A = B``) gives the same shard of the solution,
  and a linear ``Partial`` of ``B`` passes through. Factorization outputs that come along
  (``LU``, ``pivots``, ``info``) are computed from the whole matrix: replicated.
- anything else is gathered (the op then runs on whole tensors).

Every linear algebra kernel here accepts an empty batch, so ranks whose block of the batch is
empty need no special case. ``_linalg_check_errors`` gathers its (tiny) ``info`` first, so
that either every rank or none raises. torch has no meta kernel for ``geqrf``, which dispatch
needs for the global shapes: this module registers one ([Note: a meta kernel for geqrf]).

``linalg_cross`` works on triples along one dim (size 3): any other dim may stay sharded,
broadcast as a pointwise op.

FFTs (``_fft_c2c``, ``_fft_r2c``, ``_fft_c2r``, what every ``torch.fft`` function runs) mix
the transformed dims only: a shard of any other dim stays, and since a transform is linear
(over the reals for r2c / c2r) a linear ``Partial`` passes through. A transformed dim that is
sharded is gathered. A rank whose block is empty skips the kernel (MKL refuses an empty
batch), and on CPU meshes the global strides are the CPU kernel's ([Note: fft strides on
CPU]).
"""

from __future__ import annotations

import math

import torch

from dtensor._ops._common import (
    OpSchema,
    Option,
    OutputSharding,
    expand_per_mesh_dim,
    map_to,
    register,
    register_per_mesh_dim,
    register_replicated,
)
from dtensor._spec import DTensorSpec
from dtensor.placement import Partial, Replicate, Shard

aten = torch.ops.aten

_LINEAR = (Partial("sum"), Partial("avg"))


def _specs(schema: OpSchema) -> list[DTensorSpec]:
    return [schema.leaves[i] for i in schema.spec_indices()]


# --------------------------------------------------------------------------- batch dims


def _batch_options(schema: OpSchema, in_core: list[int], out_core: list[int]) -> list:
    """One ``Option`` per batch dim of the broadcast batch shape. ``in_core`` / ``out_core``:
    per DTensor input / per output, how many trailing dims are matrix (or vector) dims; the
    dims before them are batch dims, aligned from the right.

    A tensor whose aligned dim has the batch's full size keeps a shard of it; any other (one
    that broadcasts there, or has no such dim) is whole. An output follows the batch of the
    operands it comes from (``LU`` of a solve has ``A``'s batch, not ``B``'s): where it is
    not full-sized, neither are they, so they are whole and it comes out whole too."""
    specs = _specs(schema)
    if len(in_core) != len(specs) or len(out_core) != len(schema.out_meta):
        return []
    in_batch = [tuple(s.shape[: max(s.ndim - c, 0)]) for s, c in zip(specs, in_core)]
    try:
        batch = tuple(torch.broadcast_shapes(*in_batch))
    except RuntimeError:
        return []
    n = len(batch)

    def place(shape, core, j):
        d = j - n + len(shape) - core
        if len(shape) - core > 0 and d >= 0 and shape[d] == batch[j]:
            return Shard(d)
        return Replicate()

    opts = []
    for j in range(n):
        ins = tuple(place(tuple(s.shape), c, j) for s, c in zip(specs, in_core))
        outs = tuple(
            None if m is None else place(tuple(m.shape), c, j)
            for m, c in zip(schema.out_meta, out_core)
        )
        opts.append(Option(outs, ins))
    return opts


def _rhs_options(schema: OpSchema, rhs: int, result: int, *, columns: bool) -> list:
    """Options of an op linear in its right-hand side (the ``rhs``-th DTensor input; the
    solution is output ``result``): a shard of the rhs's columns (``columns``) or rows gives
    the same shard of the solution with every other operand whole, and a linear ``Partial``
    of the rhs passes through. The other outputs come out replicated."""
    specs = _specs(schema)
    if rhs >= len(specs):
        return []
    b = specs[rhs]
    if b.ndim < 2:
        return []
    d_in = b.ndim - 1 if columns else b.ndim - 2
    out = schema.out_meta[result]
    d_out = out.ndim - 1 if columns else out.ndim - 2
    opts = []
    for p_in, p_out in [(Shard(d_in), Shard(d_out)), *[(p, p) for p in _LINEAR]]:
        ins = tuple(p_in if k == rhs else Replicate() for k in range(len(specs)))
        os = tuple(
            None if m is None else (p_out if k == result else Replicate())
            for k, m in enumerate(schema.out_meta)
        )
        opts.append(Option(os, ins))
    return opts


def _batched(in_core: list[int], out_core: list[int]):
    """Options for an op with fixed core dims per input / output: its batch dims."""

    def options(schema: OpSchema) -> list:
        return _batch_options(schema, in_core, out_core)

    return options


_FIXED = {
    # one matrix in
    aten.cholesky.default: ([2], [2]),
    aten.cholesky_inverse.default: ([2], [2]),
    aten.linalg_matrix_exp.default: ([2], [2]),
    aten.linalg_cholesky_ex.default: ([2], [2, 0]),
    aten.linalg_inv_ex.default: ([2], [2, 0]),
    aten.geqrf.default: ([2], [2, 1]),
    aten.linalg_eig.default: ([2], [1, 2]),
    aten._linalg_eigvals.default: ([2], [1]),
    aten._linalg_eigh.default: ([2], [1, 2]),
    aten._linalg_svd.default: ([2], [2, 1, 2]),
    aten.linalg_qr.default: ([2], [2, 2]),
    aten._linalg_det.default: ([2], [0, 2, 1]),
    aten._linalg_slogdet.default: ([2], [0, 0, 2, 1]),
    aten.linalg_lu_factor_ex.default: ([2], [2, 1, 0]),
    aten.linalg_ldl_factor_ex.default: ([2], [2, 1, 0]),
    aten.linalg_lu.default: ([2], [2, 2, 2]),
    aten.linalg_pinv.atol_rtol_float: ([2], [2]),
    aten.linalg_pinv.default: ([2], [2]),
    # a factorization and its vectors (pivots, tau)
    aten.lu_unpack.default: ([2, 1], [2, 2, 2]),
    aten.linalg_householder_product.default: ([2, 1], [2]),
}
for _op, (_in, _out) in _FIXED.items():
    register_per_mesh_dim(_op)(_batched(_in, _out))


@register_per_mesh_dim(aten.linalg_pinv.atol_rtol_tensor, aten.linalg_pinv.rcond_tensor)
def pinv_options(schema: OpSchema) -> list:
    """The tolerances (``atol``, ``rtol``, ``rcond``) are per batch entry: core 0."""
    n = len(_specs(schema))
    return _batch_options(schema, [2] + [0] * (n - 1), [2])


def _kwarg(schema: OpSchema, name: str, pos: int, default):
    if len(schema.args) > pos:
        return schema.args[pos]
    return schema.kwargs.get(name, default)


@register_per_mesh_dim(aten.linalg_lu_solve.default, aten.linalg_ldl_solve.default)
def lu_solve_options(schema: OpSchema) -> list:
    """``(LU, pivots, B)``: ``left`` solves ``A X = B`` (columns of ``B`` independent)."""
    left = schema.func is aten.linalg_ldl_solve.default or _kwarg(schema, "left", 3, True)
    return [
        *_batch_options(schema, [2, 1, 2], [2]),
        *_rhs_options(schema, 2, 0, columns=left),
    ]


@register_per_mesh_dim(aten.ormqr.default)
def ormqr_options(schema: OpSchema) -> list:
    """``ormqr(a, tau, C, left)``: ``Q C`` (columns of ``C`` independent) or ``C Q`` (rows)."""
    left = _kwarg(schema, "left", 3, True)
    return [
        *_batch_options(schema, [2, 1, 2], [2]),
        *_rhs_options(schema, 2, 0, columns=left),
    ]


@register_per_mesh_dim(aten.cholesky_solve.default)
def cholesky_solve_options(schema: OpSchema) -> list:
    """``cholesky_solve(B, L)``: ``A X = B``."""
    return [*_batch_options(schema, [2, 2], [2]), *_rhs_options(schema, 0, 0, columns=True)]


@register_per_mesh_dim(aten.triangular_solve.default)
def triangular_solve_options(schema: OpSchema) -> list:
    """``triangular_solve(B, A)`` -> (solution, copy of ``A``): ``A X = B``."""
    return [*_batch_options(schema, [2, 2], [2, 2]), *_rhs_options(schema, 0, 0, columns=True)]


@register_per_mesh_dim(aten.linalg_solve_triangular.default)
def solve_triangular_options(schema: OpSchema) -> list:
    """``solve_triangular(A, B, left)``."""
    left = schema.kwargs.get("left", True)
    return [
        *_batch_options(schema, [2, 2], [2]),
        *_rhs_options(schema, 1, 0, columns=left),
    ]


@register_per_mesh_dim(aten._linalg_solve_ex.default)
def solve_options(schema: OpSchema) -> list:
    """``_linalg_solve_ex(A, B, left)`` -> (result, LU, pivots, info). ``B`` is a vector
    (batch) when it is 1-D or has ``A``'s shape without the last dim, else a matrix (batch);
    torch decides this from the shapes it sees, so a layout must not let a rank's local
    shapes read differently from the global ones. Sharding the same batch dims of ``A`` and
    ``B`` keeps ``B.shape == A.shape[:-1]`` as it was; with ``B`` one dim shorter than ``A``
    as a matrix, shrinking a dim of either could make the shapes read as the vector case, so
    that case is only gathered."""
    a, b = _specs(schema)[:2]
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    if not vector and b.ndim == a.ndim - 1:
        return []
    core_b = 1 if vector else 2
    opts = _batch_options(schema, [2, core_b], [core_b, 2, 1, 0])
    if not vector:
        opts += _rhs_options(schema, 1, 0, columns=schema.kwargs.get("left", True))
    return opts


register_replicated(aten._linalg_check_errors.default)


# --------------------------------------------------------------------------- cross
@register_per_mesh_dim(aten.linalg_cross.default)
def cross_options(schema: OpSchema) -> list:
    """Any dim but the one holding the triples, as a broadcasting pointwise op."""
    out = schema.out_meta[0]
    out_shape = tuple(out.shape)
    dim = schema.kwargs.get("dim", -1) % out.ndim
    specs = _specs(schema)
    return [
        Option(
            (Shard(d),),
            tuple(map_to(Shard(d), out.ndim, tuple(s.shape), out_shape) for s in specs),
        )
        for d in range(out.ndim)
        if d != dim
    ]


# --------------------------------------------------------------------------- fft
_FFT_OPS = (aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default)


def fft_options(schema: OpSchema) -> list:
    """Dims not transformed keep their shard; linear Partials pass through."""
    x = schema.args[0]
    dims = {d % x.ndim for d in schema.args[1]}
    opts = [Option((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d not in dims]
    return opts + [Option((p,), (p,)) for p in _LINEAR]


@register(*_FFT_OPS)
def fft_rule(schema: OpSchema) -> OutputSharding:
    _fix_fft_strides(schema)
    sharding = expand_per_mesh_dim(schema, fft_options(schema))
    if math.prod(schema.args[0].shape) != 0:
        sharding.local_fn = _empty_block_guard(schema.func)
    return sharding


def _empty_block_guard(func):
    """MKL refuses to transform an empty batch, which a rank gets when a dim it does not
    transform has fewer entries than ranks: such a rank returns its (empty) block without
    calling the kernel. A global input that is empty is left to the kernel, as torch does."""

    def local(x, *args, **kwargs):
        if x.numel() == 0:
            meta = func(x.to("meta"), *args, **kwargs)
            return x.new_empty(meta.shape, dtype=meta.dtype)
        return func(x, *args, **kwargs)

    return local


def _fix_fft_strides(schema: OpSchema) -> None:
    """[Note: fft strides on CPU] The strides of an FFT's result depend on the backend
    (MKL / pocketfft on CPU, cuFFT on CUDA), and torch's meta kernels, seeing the meta
    device, model cuFFT: for some dims (``rfftn`` over every dim) they give strides the CPU
    kernel does not. On a CPU mesh the global metas are computed again on fake CPU tensors,
    which the same kernels model as the CPU backend. Dispatch keeps ``schema.out_meta`` as
    the outputs' global metas, so they are replaced in place."""
    x = schema.args[0]
    if getattr(schema.mesh, "device_type", "cpu") != "cpu":
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty_strided(tuple(x.shape), tuple(x.stride), dtype=x.meta.dtype)
        out = schema.func(fake, *schema.args[1:], **schema.kwargs)
    old = schema.out_meta[0]
    if tuple(out.stride()) != tuple(old.stride()):
        schema.out_meta[0] = torch.empty_strided(
            tuple(old.shape), tuple(out.stride()), dtype=old.dtype, device="meta"
        )


# --------------------------------------------------------------------------- geqrf's meta
# [Note: a meta kernel for geqrf] Dispatch derives every output's global shape by running the
# op on meta tensors; torch has no meta kernel for ``geqrf`` (the first step of a
# Householder QR), so without one every DTensor call of it fails. Ours follows the CPU and
# CUDA kernels: ``a`` keeps the input's shape with each matrix column-major (as LAPACK
# writes it), ``tau`` is contiguous with ``min(m, n)`` entries per matrix. Registered only
# where torch has none.


def _geqrf_meta(a: torch.Tensor):
    from torch._prims_common import make_contiguous_strides_for

    shape = tuple(a.shape)
    if len(shape) < 2:
        raise RuntimeError(f"geqrf: input must have at least 2 dimensions, got {len(shape)}")
    m, n = shape[-2:]
    out = a.new_empty_strided(shape, make_contiguous_strides_for(shape, row_major=False))
    return out, a.new_empty((*shape[:-2], min(m, n)))


_META_LIB = None
if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::geqrf", "Meta"):
    _META_LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901  (kept alive here)
    _META_LIB.impl("geqrf", _geqrf_meta, "Meta")
