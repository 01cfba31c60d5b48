"""Initialization on shards equals initialization of the full tensor in one process.

Every ``torch.nn.init`` function, the ``reset_parameters()`` of the standard layers, and the
``_init_weights`` styles of Hugging Face and torchtitan models, run on sharded DTensors
(``Shard(0)``, ``Shard(1)``, and two mesh dims at once), must give exactly the values the
same call gives a plain tensor under the same seed: random fills draw the whole tensor and
keep the local block, and writes through views of a shard (``weight[padding_idx].zero_()``,
``dirac_``'s indexing) must reach the shard.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from device_mesh import init_device_mesh
from dtensor import DTensor, Replicate, Shard, distribute_tensor
from tests.harness import run_on_ranks

INITS = {
    "uniform_": lambda t: nn.init.uniform_(t, -0.3, 0.7),
    "normal_": lambda t: nn.init.normal_(t, 0.1, 0.02),
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.5, a=-0.6, b=0.6),
    "trunc_normal_narrow": lambda t: nn.init.trunc_normal_(t, std=1.0, a=-0.1, b=0.2),
    "constant_": lambda t: nn.init.constant_(t, 0.25),
    "ones_": nn.init.ones_,
    "zeros_": nn.init.zeros_,
    "eye_": nn.init.eye_,
    "dirac_": nn.init.dirac_,
    "xavier_uniform_": lambda t: nn.init.xavier_uniform_(t, gain=nn.init.calculate_gain("tanh")),
    "xavier_normal_": nn.init.xavier_normal_,
    "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_normal_": lambda t: nn.init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu"),
    "orthogonal_": nn.init.orthogonal_,
    "sparse_": lambda t: nn.init.sparse_(t, sparsity=0.3),
}
ONLY_2D = {"eye_", "sparse_"}
ONLY_3D_UP = {"dirac_"}


def _placement_sets(mesh_1d, mesh_2d, ndim):
    out = [(mesh_1d, [Shard(0)]), (mesh_1d, [Shard(1)]), (mesh_2d, [Shard(0), Shard(1)])]
    if ndim > 2:
        out.append((mesh_2d, [Replicate(), Shard(2)]))
    return out


def _check_init_functions(name):
    ws = dist.get_world_size()
    mesh_1d = init_device_mesh("cpu", (ws,))
    mesh_2d = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("a", "b"))
    fn = INITS[name]
    shapes = [(7, 5), (3, 11)] if name in ONLY_2D else [(6, 4, 3), (5, 3, 3, 3)]
    if name not in ONLY_2D | ONLY_3D_UP:
        shapes = [(7, 5), (3, 11), (5, 3, 3, 3)]
    for shape in shapes:
        for mesh, placements in _placement_sets(mesh_1d, mesh_2d, len(shape)):
            torch.manual_seed(7)
            ref = fn(torch.empty(shape))
            torch.manual_seed(7)
            dt = distribute_tensor(torch.empty(shape), mesh, placements)
            out = fn(dt)
            assert out is dt, name
            got = dt.full_tensor()
            msg = f"{name} {shape} {placements}"
            torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=msg)
            # the generator ends where one process's does: the next draw agrees too
            nxt = torch.rand(2)
            torch.manual_seed(7)
            fn(torch.empty(shape))
            assert torch.equal(nxt, torch.rand(2)), msg


@pytest.mark.parametrize("name", sorted(INITS))
def test_every_nn_init_function_on_shards(name):
    run_on_ranks(4, _check_init_functions, name=name)


# ----------------------------------------------------------------------------- layers
def _layers():
    return {
        "Linear": lambda: nn.Linear(5, 7),
        "Bilinear": lambda: nn.Bilinear(3, 4, 5),
        "Conv1d": lambda: nn.Conv1d(3, 5, 3),
        "Conv2d": lambda: nn.Conv2d(3, 6, (3, 2), groups=3),
        "Embedding": lambda: nn.Embedding(9, 5, padding_idx=6),
        "EmbeddingBag": lambda: nn.EmbeddingBag(9, 5, padding_idx=1),
        "LayerNorm": lambda: nn.LayerNorm(5),
        "RMSNorm": lambda: nn.RMSNorm(5),
        "GroupNorm": lambda: nn.GroupNorm(2, 6),
        "BatchNorm1d": lambda: nn.BatchNorm1d(5),
        "MultiheadAttention": lambda: nn.MultiheadAttention(6, 2, bias=True, add_bias_kv=True),
        "LSTM": lambda: nn.LSTM(4, 3),
        "GRU": lambda: nn.GRU(4, 3),
        "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(6, 2, 10, dropout=0.0),
    }


def _shard_all(module: nn.Module, mesh, flip: bool) -> None:
    """Every parameter becomes a DTensor: Shard(0) (Shard(1) for matrices when ``flip``)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            dim = 1 if flip and p.ndim > 1 else 0
            dt = distribute_tensor(p.detach(), mesh, [Shard(dim)])
            m._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)


def _reset(module: nn.Module) -> None:
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
        if reset is not None:
            reset()


def _check_reset_parameters(layer, flip):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    build = _layers()[layer]
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    ours = build()
    _shard_all(ours, mesh, flip)
    torch.manual_seed(3)
    _reset(ref)
    torch.manual_seed(3)
    _reset(ours)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        assert isinstance(q, DTensor), name
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("flip", [False, True], ids=["shard0", "shard1"])
@pytest.mark.parametrize("layer", sorted(_layers()))
def test_reset_parameters_of_standard_layers_on_shards(layer, flip):
    run_on_ranks(3, _check_reset_parameters, layer=layer, flip=flip)


# ----------------------------------------------------------------------------- model inits
class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 6, padding_idx=3)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 9)
        self.out = nn.Linear(9, 6, bias=False)


def hf_init_weights(module: nn.Module, std: float = 0.02) -> None:
    """The shape of Hugging Face's ``PreTrainedModel._init_weights`` (GPT-2, Llama)."""
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=std)
        if module.bias is not None:
            module.bias.data.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=std)
        if module.padding_idx is not None:
            module.weight.data[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        module.bias.data.zero_()
        module.weight.data.fill_(1.0)


def titan_init_weights(model: nn.Module) -> None:
    """The shape of torchtitan's ``init_weights``: normal embeddings, truncated-normal
    projections with depth-scaled std, ones for norms."""
    nn.init.normal_(model.wte.weight)
    nn.init.ones_(model.ln.weight)
    nn.init.zeros_(model.ln.bias)
    for i, lin in enumerate((model.fc, model.out)):
        std = 0.02 / (2 * (i + 1)) ** 0.5
        nn.init.trunc_normal_(lin.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        if lin.bias is not None:
            nn.init.zeros_(lin.bias)


def _check_model_inits(style):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = _Tiny()
    torch.manual_seed(0)
    ours = _Tiny()
    _shard_all(ours, mesh, flip=False)
    for model in (ref, ours):
        torch.manual_seed(5)
        if style == "hf":
            model.apply(hf_init_weights)
        else:
            titan_init_weights(model)
    assert ours.wte.weight.full_tensor()[3].abs().sum() == 0 or style != "hf"
    for (name, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("style", ["hf", "torchtitan"])
def test_model_init_functions_on_shards(style):
    run_on_ranks(3, _check_model_inits, style=style)
