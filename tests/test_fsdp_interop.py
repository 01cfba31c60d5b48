"""PyTorch's objects where ours are expected, and a PyTorch recipe ported by its imports.

* PyTorch's ``DeviceMesh``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` and a ``Shard``
  returned by ``shard_placement_fn`` mean the same as ours and are converted; anything else
  is an error naming the object's module and the import to use.
* ``fully_shard`` on a module inside one already sharded blames the order of the calls.
* ``RECIPE`` is written against ``torch.distributed`` the way torchtitan writes one (a named
  3-D mesh with a flattened shard dim, HSDP, explicit prefetching, gradient accumulation,
  clipping, a loss averaged over the data-parallel ranks with a DTensor). It runs once as
  written and once with only its import lines changed; the two runs agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from device_mesh import DeviceMesh, init_device_mesh
from dtensor import DTensor, Shard, distribute_tensor
from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.harness import run_on_ranks
from tests.test_fsdp_parity import _batches, _build, _cfg, _compare, _train


class NotAPolicy:
    pass


def _mixed_imports():
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    ws = dist.get_world_size()
    cfg = _cfg()
    batches = _batches(ws)
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs_objects = _build(
        cfg,
        fully_shard,
        mesh=torch_init("cpu", (ws,)),
        mp_policy=TorchMP(**bf16),
        offload_policy=TorchOffload(pin_memory=False),
        shard_placement_fn=lambda p: TorchShard(1) if p.ndim == 2 else None,
    )
    ours_objects = _build(
        cfg,
        fully_shard,
        mesh=init_device_mesh("cpu", (ws,)),
        mp_policy=MixedPrecisionPolicy(**bf16),
        offload_policy=CPUOffloadPolicy(pin_memory=False),
        shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None,
    )
    w = theirs_objects.blocks[0].attn.qkv.weight
    assert isinstance(w.device_mesh, DeviceMesh) and w.placements == (Shard(1),)
    a = _train(theirs_objects, batches, local=True)
    b = _train(ours_objects, batches, local=True)
    _compare(theirs_objects, ours_objects, a, b, exact=True)
    # DTensor entry points take PyTorch's mesh and placements too
    dt = distribute_tensor(torch.arange(6.0), torch_init("cpu", (ws,)), [TorchShard(0)])
    assert isinstance(dt, DTensor) and dt.placements == (Shard(0),)
    # anything else names its module and the import to use
    lin = nn.Linear(2, 2)
    with pytest.raises(
        TypeError,
        match=r"mp_policy must be an fsdp2\.MixedPrecisionPolicy \(or PyTorch's\), got "
        r"tests\.test_fsdp_interop\.NotAPolicy\. Use `from fsdp2 import MixedPrecisionPolicy`",
    ):
        fully_shard(lin, mp_policy=NotAPolicy())
    with pytest.raises(TypeError, match=r"offload_policy must be an fsdp2\.OffloadPolicy"):
        fully_shard(lin, offload_policy=NotAPolicy())
    with pytest.raises(
        TypeError, match=r"mesh must be a device_mesh\.DeviceMesh \(or PyTorch's\), got builtins"
    ):
        fully_shard(lin, mesh=[0, 1])
    with pytest.raises(ValueError, match=r"shard_placement_fn must return Shard\(dim\) or None"):
        fully_shard(lin, shard_placement_fn=lambda p: TorchReplicate())
    with pytest.raises(TypeError, match=r"dtensor Shard/Replicate/Partial.*`from dtensor import"):
        distribute_tensor(torch.ones(2), init_device_mesh("cpu", (ws,)), ["S(0)"])
    assert not isinstance(lin.weight, DTensor)  # nothing happened to it
    # a child after its root: the message is about the order of the calls
    from examples.gpt import GPT

    model = GPT(cfg)
    fully_shard(model)
    with pytest.raises(
        RuntimeError,
        match=r"'ln1\.weight' was already sharded by fully_shard on GPT, which "
        r"contains this module.*inner modules first",
    ):
        fully_shard(model.blocks[0])


def test_pytorch_objects_are_accepted_and_others_named():
    run_on_ranks(2, _mixed_imports)


# ----------------------------------------------------------------------------- mesh families
def _torch_mesh_family():
    """PyTorch meshes from two unflattenings of one root (as torchtitan's ParallelDims builds
    its data-parallel and tensor-parallel meshes) convert into one family of ours."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.device_mesh import init_device_mesh as torch_init

    from device_mesh import as_device_mesh
    from dtensor.parallel import ColwiseParallel, parallelize_module
    from dtensor.placement import _StridedShard

    world = torch_init("cpu", (4,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (2, 2), ("fsdp", "tp"))
    loading = world._unflatten(0, (2, 1, 2), ("batch", "cp", "tp"))
    dp = as_device_mesh(dense["fsdp"], api="t")
    tp = as_device_mesh(loading["tp"], api="t")
    # one conversion per PyTorch mesh (an equal PyTorch mesh included), one root per family
    assert (
        as_device_mesh(dense["fsdp"], api="t") is dp
        and as_device_mesh(loading["tp"], api="t") is tp
    )
    assert dp._get_root_mesh() is tp._get_root_mesh() is as_device_mesh(world, api="t")
    assert (
        dp.get_group() is dense["fsdp"].get_group() and tp.get_group() is loading["tp"].get_group()
    )
    # concatenated as PyTorch concatenates them, over the same process groups
    both = DeviceMesh._concatenate([dp, tp])
    theirs = TorchMesh._concatenate([dense["fsdp"], loading["tp"]])
    assert both.mesh.tolist() == theirs.mesh.tolist() == [[0, 1], [2, 3]]
    assert both.mesh_dim_names == ("fsdp", "tp") and both._get_root_mesh() is dp._get_root_mesh()
    assert both.get_group("fsdp") is dp.get_group() and both.get_group("tp") is tp.get_group()
    assert both["tp"] == tp and DeviceMesh._concatenate([dp, tp]) is both
    # so fully_shard takes a parameter made tensor-parallel on the other PyTorch mesh
    torch.manual_seed(0)
    plain = nn.Linear(6, 5)
    lin = nn.Linear(6, 5)
    lin.load_state_dict(plain.state_dict())
    parallelize_module(lin, loading["tp"], ColwiseParallel(use_local_output=False))
    fully_shard(lin, mesh=dense["fsdp"])
    assert lin.weight.device_mesh is both and lin.weight.placements == (
        _StridedShard(0, 2),
        Shard(0),
    )
    x = torch.randn(3, 6)
    out = lin(x).full_tensor()
    out.sum().backward()
    ref = plain(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lin.weight.grad.full_tensor(), plain.weight.grad)
    # a mesh of ours and one of PyTorch's do not mix: the message says which is which
    ours = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    with pytest.raises(ValueError, match=r"not slices of one root mesh: some come from PyTorch"):
        DeviceMesh._concatenate([ours["fsdp"], tp])
    other = nn.Linear(6, 5)
    parallelize_module(other, loading["tp"], ColwiseParallel())
    with pytest.raises(
        ValueError,
        match=r"\(ours: device_mesh\.DeviceMesh\).*\(ours, converted from PyTorch's DeviceMesh",
    ):
        fully_shard(other, mesh=ours["fsdp"])


def test_pytorch_meshes_of_one_root_convert_to_one_root_of_ours():
    run_on_ranks(4, _torch_mesh_family)


# ----------------------------------------------------------------------------- mixed DTensors
def _mixed_dtensors_are_named():
    """PyTorch's DTensor where ours is expected fails naming each library (the two print
    alike): it cannot be converted, its local tensor and layout live in the other library."""
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from dtensor.experimental import local_map

    ws = dist.get_world_size()
    mesh, their_mesh = init_device_mesh("cpu", (ws,)), torch_init("cpu", (ws,))
    ours = distribute_tensor(torch.ones(2 * ws, 3), mesh, [Shard(0)])
    theirs = tdt.distribute_tensor(torch.ones(2 * ws, 3), their_mesh, [tdt.Shard(0)])
    named = r"PyTorch's DTensor \(torch\.distributed\.tensor\.DTensor, shape \({}, 3\), "
    named += r"placements \(Shard\(dim=0\)\)\), but this is ours \(dtensor\.DTensor\)"
    named = named.format(2 * ws)
    with pytest.raises(ValueError, match=r"aten\.add\.Tensor: an input is " + named):
        ours + theirs
    with pytest.raises(TypeError, match=r"DTensor\.from_local: local_tensor is " + named):
        DTensor.from_local(theirs, mesh, [Shard(0)])
    with pytest.raises(TypeError, match=r"distribute_tensor: tensor is " + named):
        distribute_tensor(theirs, mesh, [Shard(0)])
    with pytest.raises(TypeError, match=r"local_map: argument 1 is " + named):
        local_map(torch.add, out_placements=[Shard(0)])(ours, theirs)
    lin = torch_parallelize(nn.Linear(3, 2 * ws), their_mesh, TorchColwise())
    with pytest.raises(TypeError, match=r"fully_shard: parameter 'weight' is PyTorch's DTensor"):
        fully_shard(lin, mesh=mesh)
    assert type(lin.weight).__module__.startswith("torch.")  # nothing happened to it


def test_pytorch_dtensors_mixed_with_ours_fail_naming_each_library():
    run_on_ranks(2, _mixed_dtensors_are_named)


# ----------------------------------------------------------------------------- the recipe
RECIPE = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial


def build_mesh(ws):
    mesh = init_device_mesh(
        "cpu", (2, ws // 2, 1), mesh_dim_names=("dp_replicate", "dp_shard", "cp")
    )
    mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp")
    return mesh


def apply_fsdp(model, mesh):
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"]
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not last)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    for a, b in zip(blocks, blocks[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    assert isinstance(model, FSDPModule)
    return model


def train(model, batches, mesh, loss_fn, rank, per_rank):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    dp_cp = mesh["dp_cp"]
    losses = []
    for x, y in batches:
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        total = 0.0
        for i in range(2):  # two micro-batches, reduced once
            model.set_requires_gradient_sync(i == 1)
            loss = loss_fn(model, x[i : i + 1], y[i : i + 1]) / 2
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        mean = DTensor.from_local(total.reshape(1), dp_cp, [Partial("avg")]).full_tensor()
        losses.append(mean.item())
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}, placements
"""

OURS = {
    "from torch.distributed.device_mesh import": "from device_mesh import",
    "from torch.distributed.fsdp import": "from fsdp2 import",
    "from torch.distributed.tensor import": "from dtensor import",
}


def _ported(text: str) -> str:
    for theirs, ours in OURS.items():
        text = text.replace(theirs, ours)
    changed = [
        (a, b) for a, b in zip(RECIPE.splitlines(), text.splitlines(), strict=True) if a != b
    ]
    assert changed and all(a.startswith("from torch.distributed.") for a, _ in changed), changed
    return text


def _run_recipe(text: str, cfg, batches):
    from examples.gpt import GPT, gpt_loss

    namespace: dict = {}
    exec(compile(text, "<recipe>", "exec"), namespace)
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = namespace["build_mesh"](ws)
    torch.manual_seed(0)
    model = GPT(cfg)
    torch.manual_seed(0)
    model.reset_parameters()
    model = namespace["apply_fsdp"](model, mesh)
    return namespace["train"](model, batches, mesh, gpt_loss, rank, 2)


def _recipe_ports_by_imports():
    cfg = _cfg()
    batches = _batches(dist.get_world_size(), steps=3)
    their_losses, their_params, their_placements = _run_recipe(RECIPE, cfg, batches)
    losses, params, placements = _run_recipe(_ported(RECIPE), cfg, batches)
    # four ranks: the two libraries add gradients in different orders (rank order vs ring)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(their_losses), rtol=1e-5, atol=2e-6
    )
    for name, value in params.items():
        torch.testing.assert_close(value, their_params[name], rtol=1e-5, atol=2e-6, msg=name)
    assert placements == their_placements, (placements, their_placements)
    assert set(placements.values()) == {"(Replicate(), Shard(dim=0))"}


def test_a_torchtitan_style_recipe_ports_by_changing_imports():
    run_on_ranks(4, _recipe_ports_by_imports)
