"""``dtensor.experimental.local_map`` against PyTorch's ``local_map`` on the same inputs.

Each case runs the same local function once through ours (our DTensors, mesh and
placements) and once through PyTorch's (its DTensors): the outputs' full tensors and
placements, and the inputs' gradients, must agree, and both must match the computation on
whole tensors in one process. Inputs are uneven over the ranks where the local function
allows it (a contraction dim); outputs are even, as ``local_map`` builds them with
``from_local`` and no global shape, in both libraries.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.experimental import local_map
from tests.harness import run_on_ranks


def _libraries():
    """(name, mesh, distribute_tensor, local_map, Shard, Replicate, Partial) per library."""
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from torch.distributed.tensor.experimental import local_map as torch_local_map

    ws = dist.get_world_size()
    return [
        (
            "ours",
            init_device_mesh("cpu", (ws,)),
            distribute_tensor,
            local_map,
            Shard,
            Replicate,
            Partial,
        ),
        (
            "torch",
            torch_init("cpu", (ws,)),
            tdt.distribute_tensor,
            torch_local_map,
            tdt.Shard,
            tdt.Replicate,
            tdt.Partial,
        ),
    ]


def _run_cases(lib):
    name, mesh, distribute, lmap, S, R, P = lib
    ws = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 2 * ws + 1, generator=g)  # contraction dim uneven over the ranks
    x = torch.randn(2 * ws + 1, 3 * ws, generator=g)
    a = torch.randn(4 * ws, 3, generator=g)
    out = {}

    # 1. a partial-sum product: Shard(1) x Shard(0) -> Partial, gradients flow back sharded
    wd = distribute(w, mesh, [S(1)]).requires_grad_()
    xd = distribute(x, mesh, [S(0)]).requires_grad_()
    mm = lmap(torch.mm, out_placements=[P()], in_placements=([S(1)], [S(0)]), device_mesh=mesh)
    y = mm(wd, xd)
    y.full_tensor().pow(2).sum().backward()
    out["mm"] = (y.placements, y.full_tensor(), wd.grad.full_tensor(), xd.grad.full_tensor())

    # 2. a replicated input whose local gradients are partial sums (each rank scales its own
    # rows by it: in_grad_placements says so), and two outputs of which one is not a tensor
    def scale_rows(rows, gain):
        return rows * gain, rows.shape[1]

    rd = distribute(a, mesh, [S(0)]).requires_grad_()
    gd = distribute(torch.linspace(0.5, 2.0, 3), mesh, [R()]).requires_grad_()
    f = lmap(
        scale_rows,
        out_placements=([S(0)], None),
        in_placements=([S(0)], [R()]),
        in_grad_placements=([S(0)], [P()]),
    )
    z, width = f(rd, gd)
    (z.full_tensor() * torch.arange(3.0)).sum().backward()
    out["scale"] = (
        z.placements,
        z.full_tensor(),
        width,
        rd.grad.full_tensor(),
        gd.grad.full_tensor(),
    )

    @lmap(out_placements=[S(0)], in_placements=([S(0)],), redistribute_inputs=True)
    def double(t):
        return t * 2

    moved = double(distribute(a, mesh, [R()]))  # redistributed to Shard(0) first
    out["decorated"] = (moved.placements, moved.full_tensor())
    # no DTensor argument: the function runs on plain tensors and returns them as they are
    plain = double(a)
    out["plain"] = (type(plain) is torch.Tensor, plain)
    # a mismatched input without redistribute_inputs is refused
    strict = lmap(torch.neg, out_placements=[S(0)], in_placements=([S(0)],))
    with pytest.raises(ValueError, match="placements" if name == "torch" else r"in_placements"):
        strict(distribute(a, mesh, [R()]))
    return out, (w, x, a)


def _local_map_matches_pytorch():
    (ours, (w, x, a)), (theirs, _) = (_run_cases(lib) for lib in _libraries())
    assert ours.keys() == theirs.keys()
    for case in ours:
        for mine, their in zip(ours[case], theirs[case], strict=True):
            if isinstance(mine, torch.Tensor):
                torch.testing.assert_close(mine, their, rtol=1e-6, atol=1e-6, msg=case)
            else:
                assert mine == their, (case, mine, their)  # placements compare across libraries
    # and both are the computation on whole tensors
    w_, x_ = w.clone().requires_grad_(), x.clone().requires_grad_()
    (w_ @ x_).pow(2).sum().backward()
    torch.testing.assert_close(ours["mm"][1], w @ x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["mm"][2], w_.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["mm"][3], x_.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["decorated"][1], a * 2)
    a_, gain = a.clone().requires_grad_(), torch.linspace(0.5, 2.0, 3).requires_grad_()
    ((a_ * gain) * torch.arange(3.0)).sum().backward()
    torch.testing.assert_close(ours["scale"][1], a * gain.detach())
    torch.testing.assert_close(ours["scale"][3], a_.grad)
    torch.testing.assert_close(ours["scale"][4], gain.grad, rtol=1e-5, atol=1e-5)
    assert ours["scale"][2] == 3


@pytest.mark.parametrize("ws", [2, 3])
def test_local_map_matches_pytorch(ws):
    run_on_ranks(ws, _local_map_matches_pytorch)


def _local_map_errors():
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    t = distribute_tensor(torch.ones(2 * ws, 2), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"local_map: in_placements must have one entry per"):
        local_map(torch.neg, out_placements=[Shard(0)], in_placements=([Shard(0)], None))(t)
    with pytest.raises(ValueError, match=r"out_placements must have one entry per flattened"):
        local_map(lambda v: (v, v), out_placements=[Shard(0)])(t)
    with pytest.raises(TypeError, match=r"must return plain tensors, got a DTensor"):
        local_map(lambda v: t, out_placements=[Shard(0)])(t)
    with pytest.raises(TypeError, match=r"in_placements\[1\] must be None for the non-tensor"):
        local_map(torch.mul, out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]))(
            t, 2
        )
    with pytest.raises(TypeError, match=r"func must be callable"):
        local_map(3)
    out = local_map(torch.neg, out_placements=[Shard(0)])(t)
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)


def test_local_map_errors_name_the_argument():
    run_on_ranks(2, _local_map_errors)
