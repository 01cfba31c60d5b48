"""Index ops on sharded dims: what the OpInfo samples of the coverage test do not reach.

Rows a rank does not hold (writes into a sharded dim, reads from one), blocks that are empty
or uneven, an index smaller than the input on a sharded dim, and two mesh dims that split a
dim in an order the local blocks cannot follow (``dtensor/_ops/indexing.py``).
"""

import contextlib

import torch

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks


def _close(dt, ref):
    got = dt.full_tensor() if isinstance(dt, DTensor) else dt
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def _local_only():
    """The ops inside run without any communication."""
    with CommDebugMode() as comm:
        yield
    assert comm.get_total_counts() == 0, comm.get_comm_counts()


def _check(out, ref, *placements):
    assert out.placements == placements, out.placements
    _close(out, ref)


def _check_sharded_indexed_dims():
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    R, S0 = [Replicate()], [Shard(0)]
    # 2 rows on 4 ranks: two ranks hold no row; 7 rows: blocks of 2, 2, 2, 1
    for rows in (2, 7):
        x = torch.randn(rows, 3)
        dx = distribute_tensor(x, mesh, S0)
        idx = torch.randint(0, rows, (5,))
        di = distribute_tensor(idx, mesh, R)
        src = torch.randn(5, 3)
        ds = distribute_tensor(src, mesh, R)
        # writes: each rank applies the entries that land in its rows
        with _local_only():
            out = dx.index_add(0, di, ds, alpha=2.0)
        _check(out, x.index_add(0, idx, src, alpha=2.0), Shard(0))
        for red in ("amax", "mean", "prod"):
            with _local_only():
                out = dx.index_reduce(0, di, ds, red, include_self=False)
            _check(out, x.index_reduce(0, idx, src, red, include_self=False), Shard(0))
        i2 = idx[:, None].expand(5, 3)
        di2 = distribute_tensor(i2.contiguous(), mesh, R)
        with _local_only():
            out = dx.scatter_add(0, di2, ds)
        _check(out, x.scatter_add(0, i2, src), Shard(0))
        # index and index_put also take indices counted from the end
        mixed = torch.where(torch.arange(5) % 2 == 0, idx - rows, idx)
        dm = distribute_tensor(mixed, mesh, R)
        with _local_only():
            out = dx.index_put((dm,), ds, accumulate=True)
        _check(out, x.index_put((mixed,), src, accumulate=True), Shard(0))
        with _local_only():
            out = dx.slice_scatter(ds[:1], 0, rows - 1)
        _check(out, x.slice_scatter(src[:1], 0, rows - 1), Shard(0))
        with _local_only():
            out = dx.select_scatter(ds[0], 0, -1)
        _check(out, x.select_scatter(src[0], 0, -1), Shard(0))
        # reads: a rank answers for the rows it holds, zero elsewhere: a partial sum
        with _local_only():
            out = dx.index_select(0, di)
        _check(out, x.index_select(0, idx), Partial())
        with _local_only():
            out = dx.gather(0, di2)
        _check(out, x.gather(0, i2), Partial())
        with _local_only():
            out = dx[dm]
        _check(out, x[mixed], Partial())
    # a sharded index splits the work: every rank adds its own entries into a partial sum
    x, idx, src = torch.randn(6, 4), torch.randint(0, 6, (9, 4)), torch.randn(9, 4)
    dx = distribute_tensor(x, mesh, R)
    di, ds = (distribute_tensor(t, mesh, S0) for t in (idx, src))
    with _local_only():
        out = dx.scatter_add(0, di, ds)
    _check(out, x.scatter_add(0, idx, src), Partial())
    # sorted boundaries split over ranks: each counts its own, the counts add up
    bounds, v = torch.sort(torch.randn(3)).values, torch.randn(4, 5)
    db, dv = distribute_tensor(bounds, mesh, S0), distribute_tensor(v, mesh, R)
    with _local_only():
        out = torch.bucketize(dv, db, right=True)
    _check(out, torch.bucketize(v, bounds, right=True), Partial())
    # an index smaller than the input on a dim both are sharded on: blocks differ, so the
    # input is gathered on that dim (PyTorch's DTensor answers wrongly here)
    x, idx = torch.randn(7, 5), torch.randint(0, 7, (4, 3))
    dx, di = (distribute_tensor(t, mesh, [Shard(1)]) for t in (x, idx))
    _close(dx.gather(0, di), x.gather(0, idx))
    # and an input replicated on it is cut to the index's block, without communication
    dx = distribute_tensor(x, mesh, R)
    with _local_only():
        out = dx.gather(0, di)
    _check(out, x.gather(0, idx), Shard(1))

    # two mesh dims splitting dim 1 in another order for input and index: the index's block
    # is not inside the input's, so the op runs on gathered tensors rather than misread
    mesh2 = init_device_mesh("cpu", (2, 2))
    x, idx = torch.randn(6, 8), torch.randint(0, 6, (4, 8))
    dx = distribute_tensor(x, mesh2, [Replicate(), Shard(1)])
    di = distribute_tensor(idx, mesh2, [Shard(1), Shard(1)])
    _close(dx.gather(0, di), x.gather(0, idx))


def test_index_ops_on_sharded_indexed_dims():
    run_on_ranks(4, _check_sharded_indexed_dims)
