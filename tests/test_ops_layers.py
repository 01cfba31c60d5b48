"""Rules of dtensor/_ops/layers.py the OpInfo coverage run does not reach: convolution over
sharded channels and spatial dims, grid sampling over a sharded grid, partial inputs of the
linear layers, and ranks left an empty channel block by an uneven split."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from dtensor.experimental import implicit_replication
from tests.harness import run_on_ranks


def _close(got, ref):
    got = got.full_tensor() if isinstance(got, DTensor) else got
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _grads(fn, tensors, placements, mesh, g):
    """fn on full tensors and on DTensors of ``placements``: outputs and input gradients
    must agree. Returns the DTensor output."""
    full = [t.detach().clone().requires_grad_() for t in tensors]
    ref = fn(*full)
    ref.backward(g)
    dts = [
        distribute_tensor(t.detach(), mesh, [p]).requires_grad_()
        for t, p in zip(tensors, placements)
    ]
    out = fn(*dts)
    (out.full_tensor() * g).sum().backward()
    _close(out, ref.detach())
    for d, f in zip(dts, full):
        _close(d.grad, f.grad)
    return out


def _check_layers():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    r = Replicate()
    # convolution over input channels (4 over 3 ranks: 2, 2, 0): a partial-sum output when
    # there is no bias; with a bias the forward runs over the batch instead, while the
    # backward still splits channels and must compute the bias gradient on the empty rank
    x, w, b = torch.randn(3, 4, 5, 4), torch.randn(3, 4, 3, 3), torch.randn(3)
    g = torch.randn(3, 3, 3, 2)
    out = _grads(F.conv2d, [x, w], [Shard(1), Shard(1)], mesh, g)
    assert out.placements == (Partial(),)
    _grads(F.conv2d, [x, w, b], [Shard(1), Shard(1), r], mesh, g)
    # groups, and the transposed form (weight (C_in, C_out, ...)) over either channel dim
    conv_g = lambda a, b_: F.conv2d(a, b_, groups=2)  # noqa: E731
    _grads(
        conv_g, [x, torch.randn(4, 2, 3, 3)], [Shard(1), Shard(0)], mesh, torch.randn(3, 4, 3, 2)
    )
    wt, gt = torch.randn(4, 3, 2, 2), torch.randn(3, 3, 6, 5)
    out = _grads(F.conv_transpose2d, [x, wt], [Shard(1), Shard(0)], mesh, gt)
    assert out.placements == (Partial(),)
    out = _grads(F.conv_transpose2d, [x, wt], [r, Shard(1)], mesh, gt)
    assert out.placements == (Shard(1),)
    # grid sampling: the grid sharded on an output location dim, the input on channels
    inp, grid = torch.randn(2, 3, 5, 6), torch.rand(2, 4, 7, 2) * 2 - 1
    sample = lambda a, b_: F.grid_sample(a, b_, align_corners=False)  # noqa: E731
    gg = torch.randn(2, 3, 4, 7)
    assert _grads(sample, [inp, grid], [r, Shard(2)], mesh, gg).placements == (Shard(3),)
    assert _grads(sample, [inp, grid], [Shard(1), r], mesh, gg).placements == (Shard(1),)
    # two channels over three ranks: one rank holds an empty block, which these kernels
    # refuse (the interpolation backward also takes the input's size as numbers)
    y = torch.randn(2, 2, 5, 5)
    for fn, gshape in [
        (lambda a: F.max_pool2d(a, 2), (2, 2, 2, 2)),
        (lambda a: F.interpolate(a, size=(7, 4), mode="bicubic"), (2, 2, 7, 4)),
    ]:
        assert _grads(fn, [y], [Shard(1)], mesh, torch.randn(gshape)).placements == (Shard(1),)
    # fractional max pooling: the random samples, (N, C, 2) or (1, C, 2) for an unbatched
    # input, follow the input's batch and channel blocks (F.fractional_max_pool2d passes them
    # as a plain tensor, hence implicit_replication)
    for shape, p in [((2, 3, 9, 9), Shard(1)), ((3, 9, 9), Shard(0))]:
        samples = torch.rand(2 if len(shape) == 4 else 1, 3, 2)

        def pool(a, samples=samples):
            with implicit_replication():
                return F.fractional_max_pool2d(a, 2, output_size=(4, 4), _random_samples=samples)

        out = _grads(pool, [torch.randn(shape)], [p], mesh, torch.randn(*shape[:-2], 4, 4))
        assert out.placements == (p,)
    # linear layers keep a partial input partial, without communication
    rank = dist.get_rank()
    part = torch.randn(2, 3, 6, 6)
    local = part * (rank + 1) / sum(range(1, dist.get_world_size() + 1))
    dp = DTensor.from_local(local, mesh, [Partial()])
    dw = distribute_tensor(w[:, :3], mesh, [r])
    with CommDebugMode() as comm:
        outs = [
            F.avg_pool2d(dp, 2),
            F.interpolate(dp, scale_factor=2, mode="bilinear"),
            F.adaptive_avg_pool2d(dp, 4),
            F.conv2d(dp, dw),
        ]
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert all(o.placements == (Partial(),) for o in outs)
    _close(outs[0], F.avg_pool2d(part, 2))
    _close(outs[1], F.interpolate(part, scale_factor=2, mode="bilinear"))
    _close(outs[2], F.adaptive_avg_pool2d(part, 4))
    _close(outs[3], F.conv2d(part, w[:, :3]))
    # a bias would be added once per rank: a partial input with a bias is reduced first
    out = F.conv2d(dp, dw, distribute_tensor(b, mesh, [r]))
    _close(out, F.conv2d(part, w[:, :3], b))


def test_layers_on_uneven_shards():
    run_on_ranks(3, _check_layers)
