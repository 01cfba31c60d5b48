"""Rules of dtensor/_ops/pointwise.py and random.py the OpInfo coverage run does not reach:
``out=`` tensors laid out unlike the inputs, partial inputs of linear and non-linear ops,
in-place ops found by their tag, per-channel ``prelu`` weights, a partial ``glu`` gradient,
and random ops whose sharded draw must be one draw of the full tensor (uneven and empty
blocks included) with every rank's generator left in step."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from tests.harness import run_on_ranks

aten = torch.ops.aten


def _close(got, ref):
    got = got.full_tensor() if isinstance(got, DTensor) else got
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def _check_pointwise():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, y = torch.randn(7, 5), torch.randn(5)
    dx, dy = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Replicate()])
    # out= keeps the out tensor's placements (a replicated out was left zero before)
    for pl in (Replicate(), Shard(0), Shard(1)):
        out = distribute_tensor(torch.zeros(7, 5), mesh, [pl])
        assert torch.add(dx, dy, out=out) is out and out.placements == (pl,)
        _close(out, x + y)
        m = distribute_tensor(torch.zeros(7, 5), mesh, [pl])
        e = distribute_tensor(torch.zeros(7, 5, dtype=torch.int32), mesh, [pl])
        torch.frexp(dx, out=(m, e))
        _close(m, torch.frexp(x)[0])
        _close(e, torch.frexp(x)[1])
    with pytest.raises(NotImplementedError, match="never resized"):
        torch.add(dx, dy, out=distribute_tensor(torch.zeros(3, 5), mesh, [Replicate()]))
    with pytest.raises(NotImplementedError, match="on a Partial DTensor"):
        torch.exp(dx, out=DTensor.from_local(torch.zeros(7, 5), mesh, [Partial()]))
    # a partial input stays partial through a linear op, is reduced before another
    px = DTensor.from_local(x / dist.get_world_size(), mesh, [Partial()])
    for fn, linear in [
        (torch.deg2rad, True),
        (lambda t: torch.complex(t, t), True),
        (torch.special.i0e, False),
        (torch.sinc, False),
    ]:
        r = fn(px)
        assert isinstance(r.placements[0], Partial) == linear
        _close(r, fn(x))
    # in-place ops found by the pointwise tag, whatever their name
    i = torch.arange(35).reshape(7, 5)
    di = distribute_tensor(i.clone(), mesh, [Shard(0)])
    di <<= 2
    _close(di, i << 2)
    a = distribute_tensor(x.abs() + 1, mesh, [Shard(1)])
    a.lgamma_()
    _close(a, (x.abs() + 1).lgamma())
    # prelu with a per-channel weight, sharded along channels or broadcast over a shard
    xx, w, g = torch.randn(4, 6, 5), torch.randn(6), torch.randn(4, 6, 5)
    xr, wr = xx.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.prelu(xr, wr)
    ref.backward(g)
    for pxl, pwl in [(Shard(1), Shard(0)), (Shard(2), Replicate())]:
        a = distribute_tensor(xx, mesh, [pxl]).requires_grad_()
        b = distribute_tensor(w, mesh, [pwl]).requires_grad_()
        out = F.prelu(a, b)
        out.backward(distribute_tensor(g, mesh, out.placements))
        _close(out, ref.detach())
        _close(a.grad, xr.grad)
        _close(b.grad, wr.grad)
    # glu's gradient is linear in the output gradient: a partial one stays partial
    xg, gg = torch.randn(5, 8), torch.randn(5, 4)
    gp = DTensor.from_local(gg / dist.get_world_size(), mesh, [Partial()])
    r = aten.glu_backward(gp, distribute_tensor(xg, mesh, [Replicate()]), 1)
    assert r.placements == (Partial(),)
    _close(r, aten.glu_backward(gg, xg, 1))


def test_pointwise_out_partial_inplace_and_layers():
    run_on_ranks(2, _check_pointwise)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(got[0], g) for g in got)


def _check_random():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    draws = [
        torch.randn_like,
        lambda t: torch.randint_like(t, 3, 10),
        lambda t: torch.randint_like(t, torch.tensor(9)),
        torch.bernoulli,
        lambda t: torch.native_dropout(t, 0.4, True),
        lambda t: torch.multinomial(t + 0.01, 3, replacement=True),
        lambda t: torch.poisson(t * 4),
        lambda t: F.rrelu(t - 0.5, training=True),
    ]
    # (1, 4) split on dim 0 leaves rank 1 an empty block
    for shape, pl in [((7, 5), Shard(0)), ((7, 5), Shard(1)), ((1, 4), Shard(0))]:
        x = torch.rand(shape)
        dx = distribute_tensor(x, mesh, [pl])
        for fn in draws:
            torch.manual_seed(5)
            ref, ref_next = fn(x), torch.rand(3)
            torch.manual_seed(5)
            got, got_next = fn(dx), torch.rand(3)
            for g, r in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, ref))):
                _close(g, r)  # one draw of the full tensor, as a single process makes it
            assert torch.equal(got_next, ref_next)  # the generator advanced as for the full draw
        # an in-place fill reading a tensor of probabilities laid out otherwise
        torch.manual_seed(5)
        ref = torch.zeros(shape).bernoulli_(x)
        torch.manual_seed(5)
        got = distribute_tensor(torch.zeros(shape), mesh, [pl])
        got.bernoulli_(distribute_tensor(x, mesh, [Shard(1) if pl == Shard(0) else Replicate()]))
        _close(got, ref)
        # rrelu writes its slopes into the caller's noise tensor, in place or not
        for inplace in (False, True):
            torch.manual_seed(5)
            xr, n_ref = x - 0.5, torch.empty(shape)
            op = aten.rrelu_with_noise_ if inplace else aten.rrelu_with_noise
            y_ref = op(xr, n_ref, 0.1, 0.3, True)
            torch.manual_seed(5)
            dxr = distribute_tensor(x - 0.5, mesh, [pl])
            dn = distribute_tensor(torch.zeros(shape), mesh, [Replicate() if inplace else pl])
            y = op(dxr, dn, 0.1, 0.3, True)
            _close(y, y_ref)
            _close(dn, n_ref)
    # a sharded draw differs between blocks; a replicated one (or one of a partial input)
    # is the same on every rank
    d = torch.randn_like(distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)]))
    assert not _same_on_every_rank(d.to_local())
    for src in (
        distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()]),
        DTensor.from_local(torch.ones(4, 3), mesh, [Partial()]),
    ):
        r = torch.randn_like(src)
        assert r.placements == (Replicate(),) and _same_on_every_rank(r.to_local())


def test_random_ops_draw_the_full_tensor():
    run_on_ranks(2, _check_random)
