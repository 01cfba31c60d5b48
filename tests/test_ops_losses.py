"""Normalization and loss rules where the OpInfo samples do not reach their logic: running
statistics written in place, the evaluation-mode layouts, the nll mean over uneven shards
with ignored targets and class weights, and the empty blocks of uneven splits."""

import torch
import torch.nn.functional as F

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks


def _close(dt, ref, tol=1e-5):
    got = dt.full_tensor() if isinstance(dt, DTensor) else dt
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol, equal_nan=True)


def _dist(mesh, *pairs):
    return [distribute_tensor(t.clone(), mesh, [p]) for t, p in pairs]


def _check_batch_norm():
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 4, 2), torch.randn(4), torch.randn(4)
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    # Training writes the running statistics in place: a replicated pair must stay the same
    # on every rank (the channel-sharded layout would update a temporary block of it), a
    # channel-sharded pair keeps the channel layout, each rank updating its own channels.
    for px, ps in [(Shard(1), Replicate()), (Shard(0), Shard(0)), (Shard(2), Shard(0))]:
        ref_m, ref_v = rm.clone(), rv.clone()
        ref = F.batch_norm(x, ref_m, ref_v, w, b, training=True, momentum=0.3)
        dx, dm, dv, dw, db = _dist(mesh, (x, px), (rm, ps), (rv, ps), (w, ps), (b, ps))
        out = F.batch_norm(dx, dm, dv, dw, db, training=True, momentum=0.3)
        _close(out, ref)
        assert dm.placements == (ps,) and dv.placements == (ps,)
        _close(dm, ref_m)
        _close(dv, ref_v)
        for t in (dm, dv):  # every replica alike
            assert torch.equal(t.redistribute(placements=[Shard(0)]).full_tensor(), t.full_tensor())
    try:
        dm, dv = _dist(mesh, (rm, Replicate()), (rv, Shard(0)))
        F.batch_norm(_dist(mesh, (x, Shard(1)))[0], dm, dv, training=True)
        raise AssertionError("running statistics laid out unlike each other were accepted")
    except NotImplementedError as e:
        assert "in place" in str(e)
    # Evaluation: a batch-sharded input stays sharded (uneven, one rank holds one sample),
    # the saved statistics are empty as the kernel's, and the weight and bias gradients are
    # partial sums.
    xe = torch.randn(2, 4, 3, requires_grad=True)
    we, be = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = F.batch_norm(xe, rm, rv, we, be, training=False)
    g = torch.randn_like(ref)
    ref.backward(g)
    dx, dm, dv, dw, db = _dist(
        mesh,
        (xe.detach(), Shard(0)),
        (rm, Replicate()),
        (rv, Replicate()),
        (we.detach(), Replicate()),
        (be.detach(), Replicate()),
    )
    for t in (dx, dw, db):
        t.requires_grad_()
    with CommDebugMode() as comm:
        out = F.batch_norm(dx, dm, dv, dw, db, training=False)
    assert comm.get_total_counts() == 0 and out.placements == (Shard(0),)
    _close(out, ref)
    _, saved_mean, _ = torch.ops.aten.native_batch_norm(dx, dw, db, dm, dv, False, 0.1, 1e-5)
    assert saved_mean.shape == (0,) and saved_mean.to_local().shape == (0,)
    out.backward(distribute_tensor(g, mesh, [Shard(0)]))
    for got, want in ((dx, xe), (dw, we), (db, be)):
        _close(got.grad, want.grad)


def test_batch_norm_running_stats_and_eval_layouts():
    run_on_ranks(3, _check_batch_norm)


def _check_group_norm_and_norms():
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    # two samples over three ranks: one rank holds none
    x = torch.randn(2, 6, 3, requires_grad=True)
    w, b = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    ref = F.group_norm(x, 3, w, b)
    ref.sum().backward()
    dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
    dw = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
    db = distribute_tensor(b.detach(), mesh, [Replicate()]).requires_grad_()
    with CommDebugMode() as comm:
        out = F.group_norm(dx, 3, dw, db)
    assert comm.get_total_counts() == 0 and out.placements == (Shard(0),)
    _close(out, ref)
    out.sum().backward()
    for got, want in ((dx, x), (dw, w), (db, b)):
        _close(got.grad, want.grad)
    # p-norms over a sharded dim with an empty block (two columns over three ranks)
    a, c = torch.randn(4, 2), torch.randn(4, 2)
    da, dc = _dist(mesh, (a, Shard(1)), (c, Shard(1)))
    for p in (1.0, 3.0, float("inf")):
        _close(F.pairwise_distance(da, dc, p=p), F.pairwise_distance(a, c, p=p))


def test_group_norm_batch_shards_and_norms_with_empty_blocks():
    run_on_ranks(3, _check_group_norm_and_norms)


def _check_losses():
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    # Uneven batch (2, 2, 1 rows); the ignored class sits on one rank only, and class
    # weights differ, so every rank's share of the total weight differs: an average of
    # per-rank means would be wrong.
    logits = torch.randn(5, 4, requires_grad=True)
    target = torch.tensor([3, 3, 1, 0, 2])
    cw = torch.tensor([0.5, 1.0, 2.0, 3.0])
    ref = F.cross_entropy(logits, target, cw, ignore_index=1)
    ref.backward()
    dl = distribute_tensor(logits.detach(), mesh, [Shard(0)]).requires_grad_()
    dt, dw = _dist(mesh, (target, Shard(0)), (cw, Replicate()))
    with CommDebugMode() as comm:
        loss = F.cross_entropy(dl, dt, dw, ignore_index=1)
    # one all-reduce of the total weight; the logits are never gathered
    assert comm.get_comm_counts() == {"all_reduce": 1}, comm.get_comm_counts()
    assert loss.placements == (Partial(),)
    _close(loss, ref)
    loss.backward()
    _close(dl.grad, logits.grad)
    # every target of the batch ignored: nan, as on one tensor
    _close(
        F.nll_loss(dl[:2], dt[:2], ignore_index=3),
        F.nll_loss(logits[:2], target[:2], ignore_index=3),
    )
    # a mean of an elementwise loss divides by the global count, not each rank's
    p, y = torch.rand(5, 2) * 0.9 + 0.05, torch.rand(5, 2)
    dp, dy = _dist(mesh, (p, Shard(0)), (y, Shard(0)))
    _close(F.binary_cross_entropy(dp, dy), F.binary_cross_entropy(p, y))
    _close(
        F.binary_cross_entropy_with_logits(dp, dy, pos_weight=torch.tensor(2.0)),
        F.binary_cross_entropy_with_logits(p, y, pos_weight=torch.tensor(2.0)),
    )


def test_losses_over_uneven_batch_shards():
    run_on_ranks(3, _check_losses)
