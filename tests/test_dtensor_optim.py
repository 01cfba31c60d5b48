"""Stock torch.optim and clip_grad_norm_ on DTensor parameters; gradients through conversions."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dtensor
from device_mesh import init_device_mesh
from dtensor import DTensor, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks

SHAPES = [(7, 5), (3, 4), (1,), (5, 3, 2)]


def _make(mesh, placements_for):
    torch.manual_seed(0)
    plain = [torch.randn(s) for s in SHAPES]
    ours = [nn.Parameter(distribute_tensor(t.clone(), mesh, placements_for(t))) for t in plain]
    return [nn.Parameter(t) for t in plain], ours


def _loss(params):
    # parameters meet only through their own (global) values
    return sum(((p * p).sum() * (i + 1) + p.sum()) for i, p in enumerate(params))


def _check_optimizers(mesh_shape, opt_name, foreach):
    mesh = init_device_mesh("cpu", mesh_shape)
    # foreach=None: the default path; "fused": the single-kernel Adam/AdamW (CPU has it too)
    kw = {"fused": True} if foreach == "fused" else {"foreach": foreach}

    def placements_for(t):
        return [Shard(0)] + [Shard(t.ndim - 1)] * (mesh.ndim - 1)

    plain, ours = _make(mesh, placements_for)
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, **kw),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, **kw),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw),
    }[opt_name]
    opt_plain, opt_ours = make(plain), make(ours)
    for _ in range(3):
        for params, opt in ((plain, opt_plain), (ours, opt_ours)):
            opt.zero_grad()
            _loss(params).backward()
        for p in ours:
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
        with CommDebugMode() as comm:
            opt_ours.step()
        assert comm.get_total_counts() == 0, comm
        opt_plain.step()
    for p, q in zip(plain, ours):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=1e-6, atol=1e-6)
    for q in ours:
        for v in opt_ours.state[q].values():
            if isinstance(v, torch.Tensor) and v.ndim:
                assert isinstance(v, DTensor) and v.placements == q.placements


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "adam"])
@pytest.mark.parametrize("world,mesh_shape", [(3, (3,)), (4, (2, 2))], ids=str)
def test_optimizers_match_plain(world, mesh_shape, opt_name, foreach):
    run_on_ranks(
        world, _check_optimizers, mesh_shape=mesh_shape, opt_name=opt_name, foreach=foreach
    )


@pytest.mark.parametrize("opt_name", ["adamw", "adam"])
def test_fused_adam_matches_plain(opt_name):
    run_on_ranks(3, _check_optimizers, mesh_shape=(3,), opt_name=opt_name, foreach="fused")


def test_dtensor_gets_the_default_multi_tensor_paths():
    # torch.optim and clip_grad_norm_ pick foreach by default (on CUDA and the like) only
    # for the tensor types on these two lists; ours must be on both, as PyTorch's DTensor is
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    assert DTensor in optimizer._foreach_supported_types
    assert DTensor in foreach_utils._foreach_supported_types


def _grads(params):
    # one backward per parameter: values on different meshes cannot be added together
    for i, p in enumerate(params):
        ((p * p).sum() * (i + 1) + p.sum()).backward()


def _check_clip(norm_type, mixed, foreach):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    norm_type = float(norm_type)
    for case in ("1d", "2d") + (("mixed",) if mixed else ()):
        torch.manual_seed(0)
        plain = [nn.Parameter(torch.randn(s)) for s in SHAPES]
        ours = []
        for i, t in enumerate(plain):
            # parameter 1 is replicated over "tp" (a norm weight under tensor parallelism)
            if case == "1d":
                tp = Replicate() if i == 1 else Shard(0)
                dt = distribute_tensor(t.detach().clone(), mesh["tp"], [tp])
            elif case == "2d" or i % 2 == 0:
                tp = Replicate() if i == 1 else Shard(t.ndim - 1)
                dt = distribute_tensor(t.detach().clone(), mesh, [Shard(0), tp])
            else:  # mixed: every other parameter on the 1-D sub-mesh
                dt = distribute_tensor(t.detach().clone(), mesh["dp"], [Replicate()])
            ours.append(nn.Parameter(dt))
        _grads(plain)
        _grads(ours)
        ref = torch.nn.utils.clip_grad_norm_(plain, 1.0, norm_type)
        if case == "mixed":
            total = dtensor.clip_grad_norm_(ours, 1.0, norm_type)
        else:
            # (1,) over 4 ranks: three ranks hold an empty shard, whose norm must count as 0
            with CommDebugMode() as comm:
                total = torch.nn.utils.clip_grad_norm_(ours, 1.0, norm_type, foreach=foreach)
            # the per-gradient norms stay partial through the stack: one reduction per
            # sharded mesh dim for the whole clip, not one per gradient
            assert comm.get_comm_counts() == {"all_reduce": 1 if case == "1d" else 2}, comm
            # replicated, as PyTorch's is: one rank may read it alone (logging on rank 0)
            assert all(isinstance(p, Replicate) for p in total.placements), total.placements
            total = total.full_tensor()
        torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-6)
        for p, q in zip(plain, ours):
            torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("norm_type", [2.0, "inf"])
def test_clip_grad_norm_matches_plain_on_1d_2d_and_mixed_meshes(norm_type, foreach):
    run_on_ranks(4, _check_clip, norm_type=float(norm_type), mixed=True, foreach=foreach)


def _check_autograd():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full = torch.randn(7, 5, requires_grad=True)
    weight = torch.randn(7, 5)
    # distribute -> redistribute -> full_tensor, against the same maths on plain tensors
    dt = distribute_tensor(full.detach(), mesh, [Shard(0)])
    dt.requires_grad_(True)
    out = dt.redistribute(placements=[Shard(1)]).redistribute(placements=[Replicate()])
    (out.full_tensor() * weight).sum().backward()
    (full * weight).sum().backward()
    assert dt.grad.placements == (Shard(0),)
    torch.testing.assert_close(dt.grad.full_tensor(), full.grad)
    # from_local / to_local: the local gradient is the local slice of the global one, on every
    # rank (7 rows over 3 ranks: 3, 3, 1)
    local = dt.to_local().detach().requires_grad_(True)
    wrapped = DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 5))
    (wrapped.full_tensor() * weight).sum().backward()
    pieces = torch.arange(7).chunk(dist.get_world_size())
    rows = pieces[dist.get_rank()] if dist.get_rank() < len(pieces) else torch.arange(0)
    assert local.grad.shape == (len(rows), 5)
    torch.testing.assert_close(local.grad, weight[rows])
    # to_local of a partial gradient layout
    x = distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])
    x.requires_grad_(True)
    x.to_local().sum().backward()
    assert x.grad.placements == (Replicate(),)


def test_gradients_through_conversions_match_plain_autograd():
    run_on_ranks(3, _check_autograd)
