"""Linear algebra and FFT rules on layouts the OpInfo coverage run does not build: batch
shards (uneven, with an empty block), right-hand sides sharded by column or Partial,
broadcast operands, and errors raised on every rank alike."""

import pytest
import torch

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tests.harness import run_on_ranks


def _close(dt, ref, placements=None):
    assert isinstance(dt, DTensor)
    if placements is not None:
        assert dt.placements == tuple(placements), (dt.placements, placements)
    assert dt.shape == ref.shape and dt.dtype == ref.dtype
    torch.testing.assert_close(dt.full_tensor(), ref, rtol=1e-4, atol=1e-4)


def _spd(*shape):
    a = torch.randn(*shape)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


def _check_batch_shards():
    mesh = init_device_mesh("cpu", (3,))
    S0, R = (Shard(0),), (Replicate(),)
    # batch of 4 over 3 ranks: blocks of 2, 2 and 0
    for nb in (4,):
        a, b = _spd(nb, 4, 4), torch.randn(nb, 4, 3)
        da, db = distribute_tensor(a, mesh, S0), distribute_tensor(b, mesh, S0)
        _close(torch.linalg.solve(da, db), torch.linalg.solve(a, b), S0)
        _close(torch.linalg.inv(da), torch.linalg.inv(a), S0)
        _close(torch.linalg.det(da), torch.linalg.det(a), S0)
        _close(torch.linalg.cholesky(da), torch.linalg.cholesky(a), S0)
        _close(torch.linalg.eigvalsh(da), torch.linalg.eigvalsh(a), S0)
        _close(torch.linalg.svdvals(da), torch.linalg.svdvals(a), S0)
        lu, piv = torch.linalg.lu_factor(a)
        dlu, dpiv = torch.linalg.lu_factor(da)
        _close(dlu, lu, S0)
        _close(dpiv, piv, S0)
        _close(torch.linalg.lu_solve(dlu, dpiv, db), torch.linalg.lu_solve(lu, piv, b), S0)
        # a vector right-hand side of the batch: B.shape == A.shape[:-1]
        v = torch.randn(nb, 4)
        dv = distribute_tensor(v, mesh, S0)
        _close(torch.linalg.solve(da, dv), torch.linalg.solve(a, v), S0)
        # tolerances per batch entry
        atol = torch.rand(nb)
        got = torch.linalg.pinv(da, atol=distribute_tensor(atol, mesh, S0))
        _close(got, torch.linalg.pinv(a, atol=atol), S0)
    # a matrix broadcast over the batch of the right-hand side is taken whole
    a, b = _spd(1, 4, 4), torch.randn(5, 4, 2)
    da, db = distribute_tensor(a, mesh, R), distribute_tensor(b, mesh, S0)
    _close(torch.linalg.solve(da, db), torch.linalg.solve(a, b), S0)
    _close(torch.linalg.solve(distribute_tensor(a, mesh, S0), db), torch.linalg.solve(a, b), S0)
    # B one dim shorter than A but a matrix: a rank's block of A's batch (3 of 9) would make
    # the local shapes read as a vector right-hand side, so this one is gathered
    a, b = _spd(9, 3, 3), torch.randn(3, 3)
    da = distribute_tensor(a, mesh, S0)
    got = torch.linalg.solve(da, distribute_tensor(b, mesh, R))
    _close(got, torch.linalg.solve(a, b))


def _check_right_hand_sides():
    mesh = init_device_mesh("cpu", (3,))
    a, b = _spd(4, 4), torch.randn(4, 5)
    da = distribute_tensor(a, mesh, [Replicate()])
    db = distribute_tensor(b, mesh, [Shard(1)])
    _close(torch.linalg.solve(da, db), torch.linalg.solve(a, b), [Shard(1)])
    # X A = B: rows of B are independent
    dbr = distribute_tensor(b.mT.contiguous(), mesh, [Shard(0)])
    got = torch.linalg.solve(da, dbr, left=False)
    _close(got, torch.linalg.solve(a, b.mT, left=False), [Shard(0)])
    u = torch.linalg.cholesky(a, upper=True)
    du = distribute_tensor(u, mesh, [Replicate()])
    got = torch.linalg.solve_triangular(du, db, upper=True)
    _close(got, torch.linalg.solve_triangular(u, b, upper=True), [Shard(1)])
    # a Partial right-hand side passes through a solve
    parts = [torch.randn(4, 5) for _ in range(3)]
    rank = mesh.get_local_rank(0)
    dp = DTensor.from_local(parts[rank], mesh, [Partial()])
    got = torch.linalg.solve(da, dp)
    assert got.placements == (Partial(),)
    _close(got, torch.linalg.solve(a, sum(parts)))


def _check_products_cross_fft():
    mesh = init_device_mesh("cpu", (3,))
    x, y = torch.randn(7), torch.randn(7)
    dx, dy = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
    _close(torch.dot(dx, dy), torch.dot(x, y), [Partial()])
    m = torch.randn(5, 7)
    dm = distribute_tensor(m, mesh, [Shard(1)])
    _close(torch.mv(dm, dx), torch.mv(m, x), [Partial()])
    bias = torch.randn(5)
    dbias = distribute_tensor(bias, mesh, [Replicate()])
    _close(
        torch.addmv(dbias, dm, dx, beta=0.5, alpha=2), torch.addmv(bias, m, x, beta=0.5, alpha=2)
    )
    # a rank whose block of the rows is empty (2 rows, 3 ranks), self broadcast
    m2, one = torch.randn(2, 7), torch.randn(1)
    got = torch.addmv(
        distribute_tensor(one, mesh, [Replicate()]),
        distribute_tensor(m2, mesh, [Shard(0)]),
        distribute_tensor(x, mesh, [Replicate()]),
    )
    _close(got, torch.addmv(one, m2, x), [Shard(0)])
    # addr sharded on its second vector: columns of the result
    c = torch.randn(5, 7)
    got = torch.addr(
        distribute_tensor(c, mesh, [Shard(1)]), distribute_tensor(bias, mesh, [Replicate()]), dx
    )
    _close(got, torch.addr(c, bias, x), [Shard(1)])
    # cross with a broadcast operand, sharded on the batch dim
    p, q = torch.randn(4, 3), torch.randn(1, 3)
    dp = distribute_tensor(p, mesh, [Shard(0)])
    dq = distribute_tensor(q, mesh, [Replicate()])
    _close(torch.linalg.cross(dp, dq), torch.linalg.cross(p, q), [Shard(0)])
    # fft keeps a shard of a dim it does not transform, passes a Partial through
    z = torch.randn(5, 6, 8)
    dz = distribute_tensor(z, mesh, [Shard(0)])
    _close(torch.fft.rfftn(dz, dim=(1, 2)), torch.fft.rfftn(z, dim=(1, 2)), [Shard(0)])
    _close(torch.fft.rfftn(dz), torch.fft.rfftn(z))
    # a dim not transformed with fewer entries than ranks: one rank's block is empty
    w = torch.randn(5, 2, 6)
    dw = distribute_tensor(w, mesh, [Shard(1)])
    _close(torch.fft.rfft(dw, dim=0), torch.fft.rfft(w, dim=0), [Shard(1)])
    parts = [torch.randn(5, 8) for _ in range(3)]
    dpart = DTensor.from_local(parts[mesh.get_local_rank(0)], mesh, [Partial()])
    got = torch.fft.fft(dpart)
    assert got.placements == (Partial(),)
    _close(got, torch.fft.fft(sum(parts)))


def _check_errors_on_every_rank():
    mesh = init_device_mesh("cpu", (3,))
    a = _spd(3, 4, 4)
    a[2] = 0.0  # singular: only the last rank's block of the batch
    da = distribute_tensor(a, mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="singular"):
        torch.linalg.inv(da)


@pytest.mark.parametrize(
    "check",
    [
        _check_batch_shards,
        _check_right_hand_sides,
        _check_products_cross_fft,
        _check_errors_on_every_rank,
    ],
)
def test_linalg_rules(check):
    run_on_ranks(3, check)
