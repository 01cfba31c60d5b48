"""``fully_shard(mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``, PyTorch's "full
DTensor" mode: the parameters are DTensors on the whole mesh, ``Replicate()`` on the
data-parallel dims; fully_shard shards them over the ``shard`` dim (HSDP: replicates over
``replicate``) and the module computes with DTensors on the whole mesh. Trained against
PyTorch's FSDP2 doing the same at 4 ranks - FSDP x TP on ``("dp", "tp")`` and HSDP on
``("rep", "shard")`` - comparing losses, the sharded parameters' layouts and their values;
and the parts not supported here raise NotImplementedError before anything changes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.device_mesh as torch_device_mesh
import torch.distributed.tensor as torch_tensor
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

try:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
except ImportError:  # PyTorch < 2.12 has no dp_mesh_dims
    TorchDims = None

import device_mesh
import dtensor
from fsdp2 import DataParallelMeshDims, fully_shard
from tests.harness import run_on_ranks

DIM, HID, BATCH, STEPS = 6, 10, 8, 3  # HID 10 over tp=2 -> 5 rows, uneven over dp=2


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HID)
        self.fc2 = nn.Linear(HID, DIM, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _Model(nn.Module):
    """Two MLPs side by side, their sum brought back to the input's layout. (Chained, the
    first one's gradients differ from PyTorch's in the last bits already without FSDP: our
    DTensor and PyTorch's round the backward of the row-wise output's Partial -> Replicate
    differently.)"""

    def __init__(self, layout) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_MLP(), _MLP()])
        self.layout = layout

    def forward(self, x):
        out = self.layers[0](x) + self.layers[1](x)
        return out.redistribute(x.device_mesh, self.layout)


# (mesh dim names, dp_mesh_dims kwargs, input placements, parameter placements by suffix)
SETUPS = {
    "fsdp_tp": (
        ("dp", "tp"),
        {"shard": "dp"},
        lambda L: [L.Shard(0), L.Replicate()],
        lambda L: {
            "fc1.weight": [L.Replicate(), L.Shard(0)],  # column-wise
            "fc1.bias": [L.Replicate(), L.Shard(0)],
            "fc2.weight": [L.Replicate(), L.Shard(1)],  # row-wise
        },
    ),
    "hsdp": (
        ("rep", "shard"),
        {"shard": "shard", "replicate": "rep"},
        lambda L: [L.Shard(0), L.Shard(0)],
        lambda L: {
            "fc1.weight": [L.Replicate(), L.Replicate()],
            "fc1.bias": [L.Replicate(), L.Replicate()],
            "fc2.weight": [L.Replicate(), L.Replicate()],
        },
    ),
}


def _libs(ours: bool):
    if ours:
        return device_mesh.init_device_mesh, dtensor, fully_shard, DataParallelMeshDims
    return torch_device_mesh.init_device_mesh, torch_tensor, torch_fully_shard, TorchDims


def _build(setup: str, ours: bool, dims_cls=None):
    names, dims_kw, inputs, params = SETUPS[setup]
    init_mesh, L, shard, dims = _libs(ours)
    mesh = init_mesh("cpu", (2, 2), mesh_dim_names=names)
    torch.manual_seed(0)
    model = _Model(inputs(L))
    layout = params(L)
    for mod_name, module in model.named_modules():
        for attr, p in list(module._parameters.items()):
            if p is None:
                continue
            key = f"{mod_name.rsplit('.', 1)[-1]}.{attr}"
            dt = L.distribute_tensor(p.detach(), mesh, layout[key])
            module._parameters[attr] = nn.Parameter(dt)
    dp = (dims_cls or dims)(**dims_kw)
    for layer in model.layers:
        shard(layer, mesh=mesh, dp_mesh_dims=dp)
    shard(model, mesh=mesh, dp_mesh_dims=dp)
    return model, mesh, L


def _layout(p) -> tuple:
    """A sharded parameter's layout, comparable across the two libraries."""
    return tuple(
        (type(pl).__name__.lstrip("_"), getattr(pl, "dim", None), getattr(pl, "split_factor", 1))
        for pl in p.placements
    )


def _train(setup: str, ours: bool, dims_cls=None):
    model, mesh, L = _build(setup, ours, dims_cls)
    layouts = {n: (_layout(p), p.to_local().shape) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        x = L.distribute_tensor(torch.randn(BATCH, DIM, generator=g), mesh, model.layout)
        loss = model(x).to_local().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return losses, layouts, params


def _parity(setup: str) -> None:
    ours = _train(setup, True, dims_cls=TorchDims)  # PyTorch's dims object, converted
    theirs = _train(setup, False)
    assert ours[1] == theirs[1], (ours[1], theirs[1])  # the same sharded layouts
    assert ours[0] == theirs[0], (ours[0], theirs[0])
    for n, p in ours[2].items():
        assert torch.equal(p, theirs[2][n]), n


@pytest.mark.skipif(TorchDims is None, reason="PyTorch < 2.12 has no dp_mesh_dims")
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_dp_mesh_dims_matches_pytorch(setup):
    run_on_ranks(4, _parity, setup=setup)


def _raises(exc, pattern, fn) -> None:
    with pytest.raises(exc, match=pattern):
        fn()


def _errors() -> None:
    mesh = device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    L = dtensor

    def model(placements=None):
        m = nn.Linear(4, 4)
        if placements is not None:
            m.weight = nn.Parameter(L.distribute_tensor(m.weight.detach(), mesh, placements))
            m.bias = nn.Parameter(L.distribute_tensor(m.bias.detach(), mesh, placements))
        return m

    ok = [L.Replicate(), L.Shard(0)]
    dp = DataParallelMeshDims(shard="dp")
    _raises(ValueError, r"neither", lambda: DataParallelMeshDims())
    _raises(
        TypeError,
        r"dp_mesh_dims must be",
        lambda: fully_shard(model(ok), mesh=mesh, dp_mesh_dims="dp"),
    )
    _raises(
        ValueError,
        r"'weight' is a plain tensor",
        lambda: fully_shard(model(), mesh=mesh, dp_mesh_dims=dp),
    )
    _raises(
        ValueError,
        r"'weight' has placement Shard\(dim=0\) on the data-parallel mesh dim 'dp'",
        lambda: fully_shard(model([L.Shard(0), L.Replicate()]), mesh=mesh, dp_mesh_dims=dp),
    )
    _raises(
        ValueError,
        r"'cp'.*not a dim",
        lambda: fully_shard(model(ok), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="cp")),
    )
    _raises(
        NotImplementedError,
        r"no shard dim",
        lambda: fully_shard(
            model(ok), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp")
        ),
    )
    _raises(
        NotImplementedError,
        r"several mesh dims",
        lambda: fully_shard(
            model(ok), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("dp", "tp"))
        ),
    )
    _raises(
        NotImplementedError,
        r"reshard_after_forward=2",
        lambda: fully_shard(model(ok), mesh=mesh, dp_mesh_dims=dp, reshard_after_forward=2),
    )
    m = model(ok)
    before = dict(m.named_parameters())
    _raises(
        ValueError, r"plain tensor", lambda: fully_shard([m, model()], mesh=mesh, dp_mesh_dims=dp)
    )
    assert dict(m.named_parameters()) == before  # a failing call changes nothing


def test_dp_mesh_dims_errors():
    run_on_ranks(4, _errors)
