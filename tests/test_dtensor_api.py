"""Factories, distribute_module, Parameter behaviour and CommDebugMode accounting."""

import torch
import torch.distributed as dist
import torch.nn as nn

import dtensor
from device_mesh import init_device_mesh
from dtensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from dtensor.debug import CommDebugMode
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
