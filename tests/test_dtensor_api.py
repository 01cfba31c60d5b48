"""Factories, distribute_module, Parameter behaviour and CommDebugMode accounting."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dtensor
from device_mesh import init_device_mesh
from dtensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from dtensor.debug import CommDebugMode
from tests import _torch_compat as compat
from tests.harness import run_on_ranks


def _check_factories_module_and_counts():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    z = dtensor.zeros(7, 5, device_mesh=mesh, placements=[Shard(0)])
    assert z.shape == (7, 5) and torch.equal(z.full_tensor(), torch.zeros(7, 5))
    assert torch.equal(dtensor.ones((3,), device_mesh=mesh).full_tensor(), torch.ones(3))
    assert torch.equal(
        dtensor.full((2, 3), 7.0, device_mesh=mesh, placements=[Shard(1)]).full_tensor(),
        torch.full((2, 3), 7.0),
    )
    assert dtensor.empty(4, device_mesh=mesh).to_local().shape == (4,)
    torch.manual_seed(5)
    r = dtensor.randn(7, 5, device_mesh=mesh, placements=[Shard(0)])
    torch.manual_seed(5)
    assert torch.equal(r.full_tensor(), torch.randn(7, 5))
    torch.manual_seed(6)
    u = dtensor.rand(3, 4, device_mesh=mesh, placements=[Shard(1)])
    torch.manual_seed(6)
    assert torch.equal(u.full_tensor(), torch.rand(3, 4))

    model = nn.Linear(5, 3)
    ref = nn.Linear(5, 3)
    ref.load_state_dict(model.state_dict())
    seen = []
    distribute_module(model, mesh, input_fn=lambda m, inp, mesh: seen.append("in") or inp)
    assert all(isinstance(p, DTensor) and isinstance(p, nn.Parameter) for p in model.parameters())
    x = distribute_tensor(torch.randn(4, 5), mesh, [Replicate()])
    torch.testing.assert_close(model(x).full_tensor(), ref(x.full_tensor()))
    assert seen == ["in"]

    # bytes: an all-gather sends each rank's padded shard
    k = dist.get_world_size()
    dt = distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    with CommDebugMode() as comm:
        dt.full_tensor()
    pad_rows = -(-7 // k)
    assert comm.get_comm_counts() == {"all_gather": 1}
    assert comm.get_total_bytes() == pad_rows * 5 * 4
    assert comm.get_counts_by_mesh_dim() == {("all_gather", 0): 1}
    with CommDebugMode() as comm:
        moved = dt.redistribute(placements=[Shard(1)])
    assert comm.get_comm_counts() == {"all_to_all": 1}
    assert torch.equal(moved.full_tensor(), dt.full_tensor())


def test_factories_distribute_module_and_comm_counts():
    run_on_ranks(3, _check_factories_module_and_counts)


# ----------------------------------------------------------------------------- copy and pickle
def _check_copy_and_pickle():
    import copy
    import pickle

    from dtensor._spec import DTensorSpec
    from dtensor.placement import NormPartial, Partial

    for p in (Shard(1), Replicate(), Partial(), Partial("max"), NormPartial(3.0)):
        for clone in (copy.copy(p), copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
            assert clone == p and type(clone) is type(p) and hash(clone) == hash(p), p
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = mesh.flatten("dp_tp")
    for m in (mesh, mesh["tp"], mesh["dp"], flat):
        assert copy.copy(m) is m and copy.deepcopy(m) is m
        back = pickle.loads(pickle.dumps(m))
        assert back == m and back.get_coordinate() == m.get_coordinate()
        for d in range(m.ndim):  # rebuilt on the very same process groups
            assert back.get_group(d) is m.get_group(d)
    dt = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0), Shard(1)])
    spec = dt._spec
    hash(spec)  # caches a per-process hash that must not travel
    for clone in (copy.copy(spec), copy.deepcopy(spec), pickle.loads(pickle.dumps(spec))):
        assert isinstance(clone, DTensorSpec) and clone == spec and hash(clone) == hash(spec)
    twin = copy.deepcopy(dt)
    assert twin.placements == dt.placements and torch.equal(twin.full_tensor(), dt.full_tensor())
    twin.to_local().add_(1)  # a real copy
    assert not torch.equal(twin.to_local(), dt.to_local())
    # a mesh over groups this process never created cannot be rebuilt: an error, no collective
    from device_mesh.mesh import _rebuild_mesh

    if dist.get_rank() in (0, 3):  # members need the group ...
        with pytest.raises(RuntimeError, match="cannot unpickle"):
            _rebuild_mesh(("root", "cpu", [[0, 3]], None))
    else:  # ... other ranks only learn they are not in the mesh
        assert _rebuild_mesh(("root", "cpu", [[0, 3]], None)).get_coordinate() is None


def test_placements_specs_meshes_and_dtensors_copy_and_pickle():
    run_on_ranks(4, _check_copy_and_pickle)


# ----------------------------------------------------------------------------- random factories
def _check_random_factories_agree():
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("a", "b"))
    for make, plain in ((dtensor.rand, torch.rand), (dtensor.randn, torch.randn)):
        for placements in (
            [Replicate(), Replicate()],
            [Shard(0), Replicate()],
            [Replicate(), Shard(1)],
        ):
            torch.manual_seed(100 + rank)  # every rank seeded differently
            dt = make(5, 3, device_mesh=mesh, placements=placements)
            full = dt.full_tensor()
            everyone = [torch.empty_like(full) for _ in range(ws)]
            dist.all_gather(everyone, full)
            assert all(torch.equal(e, full) for e in everyone), (make, placements)
            if any(isinstance(p, Replicate) for p in placements):
                # replicas of one block hold the same values (no per-rank draw)
                local = dt.to_local().contiguous()
                blocks = [None] * ws
                dist.all_gather_object(blocks, local)  # shards differ in size
                coords = [divmod(r, ws // 2) for r in range(ws)]
                mine = divmod(rank, ws // 2)
                for r, c in enumerate(coords):
                    same_block = all(
                        c[i] == mine[i] for i, p in enumerate(placements) if isinstance(p, Shard)
                    )
                    if same_block:
                        assert torch.equal(blocks[r], local)
            # and the draw is the one the mesh's first rank makes alone
            torch.manual_seed(100)
            assert torch.equal(full, plain(5, 3))


def test_replicated_random_factories_agree_across_differently_seeded_ranks():
    run_on_ranks(4, _check_random_factories_agree)


# ----------------------------------------------------------------------------- recipe APIs
def _check_from_local_grad_placements_and_dtypes():
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    from dtensor import Partial

    ws = dist.get_world_size()
    ours_mesh, their_mesh = init_device_mesh("cpu", (ws,)), torch_init("cpu", (ws,))
    torch.manual_seed(1)
    w = torch.randn(6, 4)
    results = []
    arms = [("ours", ours_mesh, Replicate, Partial, Shard, DTensor.from_local)]
    if compat.FROM_LOCAL_HAS_GRAD_PLACEMENTS:  # PyTorch 2.12 and later
        arms.append(
            ("torch", their_mesh, TorchReplicate, TorchPartial, TorchShard, TorchDTensor.from_local)
        )
    for mod, mesh, R, P, S, from_local in arms:
        distribute = torch_distribute if mod == "torch" else distribute_tensor
        local = torch.full((6, 4), float(dist.get_rank() + 1), requires_grad=True)
        # the gradient of a replicated input is left as a partial: no all-reduce in backward
        x = from_local(local, mesh, [R()], grad_placements=[P()])
        loss = (x * distribute(w, mesh, [R()])).sum()
        with CommDebugMode() as comm:
            loss.backward()
        if mod == "ours":
            assert comm.get_total_counts() == 0
        reduced = local.grad.clone()
        dist.all_reduce(reduced)  # partials differ in how they split, not in their sum
        # forward in bf16, backward collective in fp64, gradient back in fp32
        src = distribute(w, mesh, [S(0)])
        src.requires_grad_(True)
        y = src.redistribute(
            mesh, [R()], forward_dtype=torch.bfloat16, backward_dtype=torch.float64
        )
        (y.to_local().float() * 3).sum().backward()
        results.append((reduced, y.dtype, y.to_local(), src.grad.dtype, src.grad.to_local()))
    ours = results[0]
    torch.testing.assert_close(ours[0], w)  # the one global gradient
    assert ours[1] is torch.bfloat16 and ours[3] is torch.float32
    if len(results) == 1:  # PyTorch 2.11: ours alone, checked against the full tensors
        torch.testing.assert_close(ours[2], w.to(torch.bfloat16), rtol=0, atol=0)
        torch.testing.assert_close(ours[4], torch.full_like(w, 3.0).chunk(2)[dist.get_rank()])
        return
    theirs = results[1]
    torch.testing.assert_close(ours[0], theirs[0])
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_from_local_grad_placements_and_redistribute_dtypes_match_torch():
    run_on_ranks(2, _check_from_local_grad_placements_and_dtypes)
