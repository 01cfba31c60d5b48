"""Reductions, scans and sorts on DTensors: the combines over a sharded dim that the OpInfo
coverage (tests/test_dtensor_op_coverage.py) does not reach - a reduced dim split unevenly
with an empty block, ties and NaNs across blocks, partial inputs, and where the results are
left (replicated, still sharded, still partial)."""

import torch

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks

NAN = float("nan")


def _same(got, ref):
    if isinstance(ref, (tuple, list)):
        for g, r in zip(got, ref, strict=True):
            _same(g, r)
        return
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape)
    full = got.full_tensor()
    assert full.dtype == ref.dtype
    if ref.is_floating_point():
        torch.testing.assert_close(full, ref, equal_nan=True, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(full, ref), (full, ref)


def _check_extrema_with_indices():
    mesh = init_device_mesh("cpu", (3,))
    x = torch.randn(4, 2, 5)  # dim 1 (2 over 3 ranks) leaves the last rank an empty block
    x[0] = 0.5  # ties across every block: the first index wins, as on one tensor
    x[1, 1, 2] = x[2, 0, 3] = x[2, 1, 3] = x[3, :, 4] = NAN  # NaN wins, its first one
    ints = torch.randint(-2, 3, (4, 2, 5))
    for t, dims in ((x, (0, 1, 2)), (ints, (1,))):
        for dim in dims:
            d = distribute_tensor(t, mesh, [Shard(dim)])
            keepdim = dim == 2
            for op in (torch.max, torch.min):
                with CommDebugMode() as comm:
                    got = op(d, dim, keepdim)
                # one candidate (value, index) per output element from each rank
                assert comm.get_comm_counts() == {"all_gather": 2}, comm.get_comm_counts()
                assert got.values.placements == (Replicate(),)
                _same(got, op(t, dim, keepdim))
            _same(torch.argmin(d, dim, keepdim), torch.argmin(t, dim, keepdim))
        # the flat index of the whole tensor
        _same(torch.argmax(d), torch.argmax(t))
        _same(torch.argmin(d, keepdim=True), torch.argmin(t, keepdim=True))
    # a shard of another dim passes through, without communication
    d = distribute_tensor(x, mesh, [Shard(2)])
    with CommDebugMode() as comm:
        got = torch.max(d, 1)
    assert comm.get_total_counts() == 0 and got.indices.placements == (Shard(1),)
    _same(got, torch.max(x, 1))


def _check_variance_and_logsumexp():
    mesh = init_device_mesh("cpu", (3,))
    x = torch.randn(2, 7, 3) * 3 + 10  # uneven blocks of dim 1; dim 0 leaves one empty
    for dim in (1, [0, 2], None):
        for pl in (Shard(0), Shard(1)):
            d = distribute_tensor(x, mesh, [pl])
            for kw in ({"correction": 0}, {"correction": 2.5, "keepdim": True}):
                _same(torch.var_mean(d, dim, **kw), torch.var_mean(x, dim, **kw))
                _same(torch.std_mean(d, dim, **kw), torch.std_mean(x, dim, **kw))
    d = distribute_tensor(x, mesh, [Shard(1)])
    _same(torch.var(d, 1), torch.var(x, 1))
    _same(torch.std(d, keepdim=True), torch.std(x, keepdim=True))
    # the variance of one value divides by max(0, 1 - correction): nan or inf, as the kernel
    one = torch.randn(1, 4)
    _same(torch.var(distribute_tensor(one, mesh, [Shard(0)]), 0), torch.var(one, 0))
    # over an unsharded dim the shard stays and nothing moves
    d = distribute_tensor(x, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        v = torch.var(d, 2)
    assert comm.get_total_counts() == 0 and v.placements == (Shard(1),)
    # logsumexp: rows of -inf and of +inf, across uneven blocks
    y = torch.randn(5, 4)
    y[1] = float("-inf")
    y[2, 3] = float("inf")
    y[3, 0] = NAN
    for pl in (Shard(0), Shard(1)):
        d = distribute_tensor(y, mesh, [pl])
        for dim, keepdim in ((0, False), (1, True), ([0, 1], False)):
            _same(torch.logsumexp(d, dim, keepdim), torch.logsumexp(y, dim, keepdim))


def _check_scans_and_partials():
    mesh = init_device_mesh("cpu", (3,))
    x = torch.rand(2, 4) + 0.5
    ints = torch.randint(-3, 4, (2, 4))
    for t in (x, ints):
        for dim in (0, 1):
            d = distribute_tensor(t, mesh, [Shard(dim)])  # dim 0: an empty block
            for name, kwargs in (
                ("cumsum", {}),
                ("cumsum", {"dtype": torch.float64}),
                ("cumprod", {}),
                ("logcumsumexp", {}),
            ):
                op = getattr(torch, name)
                if name == "logcumsumexp" and not t.is_floating_point():
                    continue
                with CommDebugMode() as comm:
                    got = op(d, dim, **kwargs)
                # the shard stays: only each block's last scanned slice travels
                assert comm.get_comm_counts() == {"all_gather": 1}, (name, comm.get_comm_counts())
                assert got.placements == (Shard(dim),)
                _same(got, op(t, dim, **kwargs))
    # partial inputs the op is linear in stay partial, with no communication
    rank_val = torch.full((3, 4), 1.0) + torch.arange(12.0).view(3, 4) / 10
    s = DTensor.from_local(rank_val, mesh, [Partial("sum")])
    p = DTensor.from_local(rank_val, mesh, [Partial("product")])
    with CommDebugMode() as comm:
        cs, tr, cp, pr = torch.cumsum(s, 1), torch.trace(s), torch.cumprod(p, 0), torch.prod(p, 1)
    assert comm.get_total_counts() == 0
    assert cs.placements == tr.placements == (Partial("sum"),)
    assert cp.placements == pr.placements == (Partial("product"),)
    _same(cs, torch.cumsum(rank_val * 3, 1))
    _same(tr, torch.trace(rank_val * 3))
    _same(cp, torch.cumprod(rank_val**3, 0))
    _same(pr, torch.prod(rank_val**3, 1))
    # trace of a non-square matrix split on either dim: a partial sum of each diagonal part
    m = torch.randn(7, 4)
    for pl in (Shard(0), Shard(1)):
        got = torch.trace(distribute_tensor(m, mesh, [pl]))
        assert got.placements == (Partial("sum"),)
        _same(got, torch.trace(m))


def _check_foreach_and_dist():
    mesh = init_device_mesh("cpu", (3,))
    ts = [torch.randn(2, 3), torch.randn(5), torch.randn(1, 1)]  # empty blocks on some ranks
    ds = [distribute_tensor(t, mesh, [Shard(0)]) for t in ts]
    for ord_ in (0, 1, 2, float("inf")):
        # dtype given positionally, as dispatch passes it: every rank sends float64
        got = torch._foreach_norm(ds, ord_, torch.float64)
        assert all(g._local_tensor.dtype == torch.float64 for g in got)
        _same(got, torch._foreach_norm(ts, ord_, torch.float64))
    _same(torch._foreach_max(ds), torch._foreach_max(ts))
    ints = [torch.randint(-5, 5, (2, 2)), torch.randint(-5, 5, (1,))]
    _same(
        torch._foreach_max([distribute_tensor(t, mesh, [Shard(0)]) for t in ints]),
        torch._foreach_max(ints),
    )
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    da, db = (distribute_tensor(t, mesh, [Shard(0)]) for t in (a, b))
    for p in (0, 1, 2, 3.5, float("inf"), float("-inf"), -1):
        _same(torch.dist(da, db, p), torch.dist(a, b, p))
    # a row broadcast along the sharded dim is replicated
    row = torch.randn(1, 3)
    _same(torch.dist(da, distribute_tensor(row, mesh, [Replicate()])), torch.dist(a, row))
    # kthvalue / median / mode along a sharded dim gather it; along another they keep it
    x = torch.randn(5, 4)
    for pl in (Shard(0), Shard(1)):
        d = distribute_tensor(x, mesh, [pl])
        _same(torch.kthvalue(d, 2, 0), torch.kthvalue(x, 2, 0))
        _same(torch.median(d, 1, True), torch.median(x, 1, True))
        _same(torch.nanmedian(d, 0), torch.nanmedian(x, 0))
        _same(torch.median(d), torch.median(x))
        _same(torch.topk(d, 2, 0), torch.topk(x, 2, 0))
        _same(torch.cummax(d, 0), torch.cummax(x, 0))


def test_extrema_with_indices_over_a_sharded_dim():
    run_on_ranks(3, _check_extrema_with_indices)


def test_variance_and_logsumexp_over_a_sharded_dim():
    run_on_ranks(3, _check_variance_and_logsumexp)


def test_scans_keep_their_shard_and_partials():
    run_on_ranks(3, _check_scans_and_partials)


def test_foreach_norms_and_dist_on_empty_blocks():
    run_on_ranks(3, _check_foreach_and_dist)
