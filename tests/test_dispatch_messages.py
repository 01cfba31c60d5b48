"""What a user sees when a tensor that is not one of our DTensors meets DTensors: the likely
causes, named (not only "convert it"), and PyTorch's DTensor called by its name."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from device_mesh import init_device_mesh
from dtensor import Shard, distribute_tensor
from fsdp2 import fully_shard
from tests.harness import run_on_ranks


def _check_mixed_messages():
    mesh = init_device_mesh("cpu", (2,))
    # a parameter of a fully_shard module read outside its forward: a sharded DTensor there
    lin = nn.Linear(5, 7)
    fully_shard(lin, mesh=mesh)
    with pytest.raises(ValueError, match=r"plain torch.Tensor of shape \(3, 5\)") as info:
        F.linear(torch.randn(3, 5), lin.weight)
    message = str(info.value)
    for cause in ("outside its forward or backward", "recomputation", "two libraries"):
        assert cause in message, message
    assert "module.unshard()" in message, message
    assert lin(torch.randn(3, 5)).shape == (3, 7)  # inside forward it is a plain tensor
    lin.unshard()  # ... and after unshard(), as the message says
    assert F.linear(torch.randn(3, 5), lin.weight).shape == (3, 7)
    lin.reshard()
    # PyTorch's DTensor is not a plain tensor: the message says what it is
    ours = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    theirs = torch_distribute_tensor(
        torch.randn(4, 3), torch_init_device_mesh("cpu", (2,)), [TorchShard(0)]
    )
    with pytest.raises(ValueError, match=r"PyTorch's DTensor \(torch\.distributed\.tensor"):
        ours + theirs


def test_mixed_tensor_message_names_the_likely_causes():
    run_on_ranks(2, _check_mixed_messages)
