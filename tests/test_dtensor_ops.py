"""Ops on DTensors equal the same ops on plain tensors; unsupported ops fail loudly."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks


def _close(dt, ref, tol=1e-5):
    got = dt.full_tensor() if isinstance(dt, DTensor) else dt
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def _layouts(mesh, ndim):
    opts = [Replicate()] + [Shard(d) for d in range(ndim)]
    if mesh.ndim == 1:
        return [(p,) for p in opts]
    return [(a, b) for a in opts for b in opts]


def _check_pointwise_and_reductions(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    x, y = torch.randn(7, 5), torch.randn(7, 5)
    row, bias = torch.randn(1, 5), torch.randn(5)
    for pl in _layouts(mesh, 2):
        dx = distribute_tensor(x, mesh, pl)
        dy = distribute_tensor(y, mesh, _layouts(mesh, 2)[-1])
        drow = distribute_tensor(row, mesh, [Replicate()] * mesh.ndim)
        dbias = distribute_tensor(bias, mesh, [Shard(0)] * mesh.ndim)
        _close(dx + dy, x + y)
        _close(dx * 2 - 1, x * 2 - 1)
        _close(torch.tanh(dx) / (dy.abs() + 1), torch.tanh(x) / (y.abs() + 1))
        _close(dx * drow + dbias, x * row + bias)
        _close(torch.where(dx > 0, dx, dy), torch.where(x > 0, x, y))
        _close(dx.sum(), x.sum())
        _close(dx.sum(dim=1), x.sum(dim=1))
        _close(dx.mean(), x.mean())
        _close(dx.mean(dim=0, keepdim=True), x.mean(dim=0, keepdim=True))
        _close(dx.amax(dim=0), x.amax(dim=0))
        _close(dx.amin(), x.amin())
        for p in (1.0, 2.0, float("inf")):
            _close(torch.linalg.vector_norm(dx, p), torch.linalg.vector_norm(x, p))
        _close(torch.stack([dx, dx * 2]), torch.stack([x, x * 2]))
        _close(torch.cat([dx, dx], dim=1), torch.cat([x, x], dim=1))
        z = dx.clone()
        z.mul_(3).add_(dx)
        _close(z, x * 4)
        assert torch.equal(dx, distribute_tensor(x, mesh, pl)) and not torch.equal(dx, dx + 1)
        assert abs(dx.sum().item() - x.sum().item()) < 1e-4
        _close(torch.zeros_like(dx), torch.zeros_like(x))
        _close(dx.to(torch.float64), x.to(torch.float64))
        _close(dx.detach(), x)
        w = torch.empty_like(dx)
        w.copy_(dy)
        _close(w, y)
        w.zero_()
        _close(w, torch.zeros_like(x))
        w.fill_(2.5)
        _close(w, torch.full_like(x, 2.5))


@pytest.mark.parametrize("world,mesh_shape", [(3, (3,)), (4, (2, 2))], ids=str)
def test_pointwise_and_reductions(world, mesh_shape):
    run_on_ranks(world, _check_pointwise_and_reductions, mesh_shape=mesh_shape)


def _check_partial_stays_partial_when_linear():
    mesh = init_device_mesh("cpu", (2,))
    a = DTensor.from_local(torch.full((3,), float(dist.get_rank() + 1)), mesh, [Partial()])
    b = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    with CommDebugMode() as comm:
        c = (a + b) * 2
        d = -c
    assert comm.get_total_counts() == 0
    assert c.placements == (Partial(),) and d.placements == (Partial(),)
    _close(c, torch.full((3,), 2.0 * (3 + 2)))
    # a non-linear op reduces first
    with CommDebugMode() as comm:
        e = torch.exp(a)
    assert comm.get_comm_counts() == {"all_reduce": 1} and e.placements == (Replicate(),)
    _close(e, torch.exp(torch.full((3,), 3.0)))
    # adding a number to a partial would count it on every rank: it must reduce first
    _close(a + 1, torch.full((3,), 4.0))
    # stacking partials with replicated values keeps the partial (the replicated inputs become
    # partial locally) for sums and for norms; a finite p-norm counts the value once
    r = DTensor.from_local(torch.full((3,), 5.0), mesh, [Replicate()])
    x = torch.arange(6.0) - 2.5
    sx = distribute_tensor(x, mesh, [Shard(0)])
    for p in (2.0, 1.0, float("inf")):
        with CommDebugMode() as comm:
            s = torch.stack([a, r])
            norms = torch.stack([torch.linalg.vector_norm(sx, p), r[0]])
        assert comm.get_total_counts() == 0, (p, comm)
        assert s.placements == (Partial(),) and isinstance(norms.placements[0], Partial)
        _close(s, torch.stack([torch.full((3,), 3.0), torch.full((3,), 5.0)]))
        want = torch.stack([torch.linalg.vector_norm(x, p), torch.tensor(5.0)])
        _close(torch.linalg.vector_norm(norms, p), torch.linalg.vector_norm(want, p))


def test_partial_stays_partial_only_when_linear():
    run_on_ranks(2, _check_partial_stays_partial_when_linear)


def _check_matmul_views_nn(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    x, w, b = torch.randn(6, 7), torch.randn(5, 7), torch.randn(5)
    for pa in _layouts(mesh, 2):
        for pw in _layouts(mesh, 2):
            dx, dw = distribute_tensor(x, mesh, pa), distribute_tensor(w, mesh, pw)
            _close(dx @ dw.t(), x @ w.t())
            db = distribute_tensor(b, mesh, [Replicate()] * mesh.ndim)
            _close(F.linear(dx, dw, db), F.linear(x, w, b))
    h = torch.randn(4, 3, 8)
    for pl in _layouts(mesh, 3):
        dh = distribute_tensor(h, mesh, pl)
        _close(dh.view(12, 8), h.view(12, 8))
        _close(dh.reshape(4, 3, 2, 4).transpose(1, 2), h.reshape(4, 3, 2, 4).transpose(1, 2))
        _close(dh.permute(2, 0, 1), h.permute(2, 0, 1))
        _close(dh.unsqueeze(1).flatten(0, 1), h.unsqueeze(1).flatten(0, 1))
        _close(torch.bmm(dh, dh.transpose(1, 2)), torch.bmm(h, h.transpose(1, 2)))
        q, k, v = dh.split(3, dim=2)[:3]
        _close(q, h.split(3, dim=2)[0])
        _close(dh[:, 1], h[:, 1])
        _close(F.softmax(dh, dim=-1), F.softmax(h, dim=-1))
        _close(F.layer_norm(dh, (8,)), F.layer_norm(h, (8,)))
    table, idx = torch.randn(11, 6), torch.tensor([[0, 10, 3], [5, 5, 9]])
    for pt in _layouts(mesh, 2):
        for pi in [(Replicate(),) * mesh.ndim, (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)]:
            dt_, di = distribute_tensor(table, mesh, pt), distribute_tensor(idx, mesh, pi)
            _close(F.embedding(di, dt_), F.embedding(idx, table))


@pytest.mark.parametrize("world,mesh_shape", [(3, (3,)), (4, (2, 2))], ids=str)
def test_matmul_views_and_nn_ops(world, mesh_shape):
    run_on_ranks(world, _check_matmul_views_nn, mesh_shape=mesh_shape)


def _check_errors():
    mesh = init_device_mesh("cpu", (2,))
    dx = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    with pytest.raises(
        NotImplementedError, match=r"no sharding rule for aten\.renorm.*\(4, 3\) \(S\(0\)\)"
    ):
        torch.renorm(dx, 2, 0, 1.0)
    with pytest.raises(
        ValueError,
        match=r"plain torch.Tensor of shape \(4, 3\) mixed with DTensors.*distribute_tensor",
    ):
        dx + torch.randn(4, 3)
    _close(dx + torch.tensor(2.0), dx.full_tensor() + 2)  # a one-element tensor is a scalar
    other = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    dy = distribute_tensor(torch.randn(4, 3), other, [Replicate(), Shard(0)])
    with pytest.raises(ValueError, match="all DTensor inputs must be on one mesh"):
        dx + dy
    # an op with no rule names itself and the placements; its meta kernel is never reached
    ints = distribute_tensor(torch.tensor([3, 1, 3, 2, 1]), mesh, [Shard(0)])
    with pytest.raises(
        NotImplementedError, match=r"no sharding rule for aten\._unique2.*\(5,\) \(S\(0\)\)"
    ):
        torch.unique(ints)
    # replicated inputs need no rule: every rank computes the same answer
    rep = ints.redistribute(placements=[Replicate()])
    u = torch.unique(rep)
    assert isinstance(u, DTensor) and u.placements == (Replicate(),)
    assert torch.equal(u.to_local(), torch.tensor([1, 2, 3]))
    # a plain in-place target with DTensor operands would lose the result
    with pytest.raises(ValueError, match="in-place target is a plain torch.Tensor"):
        torch.zeros(1).add_(dx.sum())


def test_unsupported_and_mixed_inputs_fail_clearly():
    run_on_ranks(2, _check_errors)


def _check_one_element_tensors_and_in_place_views():
    mesh = init_device_mesh("cpu", (3,))
    table = torch.randn(7, 4)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        dt = distribute_tensor(table, mesh, placements)
        idx = torch.tensor([5])  # a one-element index is a replicated index, not a scalar
        _close(F.embedding(idx, dt), F.embedding(idx, table))
        _close(F.embedding(torch.tensor(2), dt), F.embedding(torch.tensor(2), table))
    # writes through views that had to gather their base reach the shards
    for placements in ([Shard(0)], [Shard(1)]):
        ref = table.clone()
        dt = distribute_tensor(table, mesh, placements)
        dt[2].zero_()  # one rank's row (Shard(0)); every rank's piece of it (Shard(1))
        ref[2].zero_()
        dt[4:6, 1].fill_(7.0)
        ref[4:6, 1].fill_(7.0)
        dt.t()[3].mul_(2)  # a view of a view
        ref.t()[3].mul_(2)
        _close(dt, ref, tol=0)
        # in-place ops that change the shape keep the wrapper and the shards consistent
        t = distribute_tensor(table.clone(), mesh, placements)
        t.t_()
        assert t.shape == (4, 7) and t.to_local().dim() == 2
        _close(t, table.t(), tol=0)
        # an in-place op with no rule (index_put_) runs on the full tensor
        u = distribute_tensor(table.clone(), mesh, placements)
        rows, cols = torch.tensor([0, 6, 3]), torch.tensor([1, 1, 2])
        u[rows, cols] = -1.0
        want = table.clone()
        want[rows, cols] = -1.0
        _close(u, want, tol=0)


def test_one_element_indices_and_writes_through_views():
    run_on_ranks(3, _check_one_element_tensors_and_in_place_views)


def _check_meta_to_device_keeps_no_global_tensor():
    from dtensor import _dispatch

    mesh = init_device_mesh("cpu", (2,))
    rows = 3 if dist.get_rank() == 0 else 2
    local = torch.empty(rows, 4, device="meta")
    meta = DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 4), stride=(4, 1))
    _dispatch.clear_cache()
    real = torch.empty_like(meta, device="cpu")  # what module.to_empty() calls
    assert real.to_local().device.type == "cpu" and real.shape == (5, 4)
    assert real.to_local().shape == (rows, 4)
    # The shape-only pass must run on meta: a real tensor there would be the *global* size,
    # allocated on every rank and then kept alive by the dispatch cache.
    rules = _dispatch._caches_of(mesh).rules
    cached = [m for _, metas in rules.values() for m in metas if m is not None]
    assert cached and all(m.device.type == "meta" for m in cached)


def test_meta_to_device_allocates_only_the_shard():
    run_on_ranks(2, _check_meta_to_device_keeps_no_global_tensor)


def _check_complex_views_for_rotary_embeddings():
    """Rotary embeddings (torchtitan's, Llama's) turn pairs of features into complex numbers:
    view_as_complex / view_as_real keep shards of every dim but the pairs' own."""
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_init

    ws = dist.get_world_size()
    mesh, their_mesh = init_device_mesh("cpu", (ws,)), torch_init("cpu", (ws,))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 2 * ws, 6, generator=g)  # (batch, seq, heads, head_dim)
    angles = torch.randn(5, 3, generator=g)
    freqs = torch.polar(torch.ones_like(angles), angles).view(1, 5, 1, 3)

    def rotate(x, f):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * f).flatten(3)

    ref_q = q.clone().requires_grad_()
    ref = rotate(ref_q, freqs)
    ref.pow(2).sum().backward()
    for dim in (0, 1, 2):  # batch, sequence (sequence parallel), heads (tensor parallel)
        results = []
        for m, dist_fn, S, R in (
            (mesh, distribute_tensor, Shard, Replicate),
            (their_mesh, tdt.distribute_tensor, tdt.Shard, tdt.Replicate),
        ):
            dq = dist_fn(q, m, [S(dim)]).requires_grad_()
            out = rotate(dq, dist_fn(freqs, m, [R()]))
            out.full_tensor().pow(2).sum().backward()
            results.append((out.placements, out.full_tensor(), dq.grad.full_tensor()))
        (pl, out, grad), (t_pl, t_out, t_grad) = results
        assert pl == t_pl == (Shard(dim),), (dim, pl, t_pl)  # no gather on the way
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, t_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_q.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, t_grad, rtol=1e-6, atol=1e-6)
    # a lazy conjugate (a flag on the local tensor, what mul's backward takes) is honoured
    pairs = torch.view_as_complex(q.reshape(2, 5, 2 * ws, 3, 2))
    dpairs = distribute_tensor(pairs, mesh, [Shard(2)])
    dfreqs = distribute_tensor(freqs, mesh, [Replicate()])
    assert dfreqs.conj().is_conj()
    _close(dpairs * dfreqs.conj(), pairs * freqs.conj())
    _close((dpairs.conj() * dfreqs).conj(), pairs * freqs.conj())
    # the pairs themselves split over the ranks: gathered first, still right
    dq = distribute_tensor(q, mesh, [Shard(3)])
    _close(rotate(dq, distribute_tensor(freqs, mesh, [Replicate()])), ref.detach())


def test_complex_views_for_rotary_embeddings_match_torch():
    run_on_ranks(2, _check_complex_views_for_rotary_embeddings)
