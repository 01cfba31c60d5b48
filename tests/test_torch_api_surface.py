"""The parts of PyTorch's DeviceMesh / DTensor / tensor-parallel API that torchtitan,
accelerate, transformers and PEFT call, each checked against PyTorch's own object doing the
same thing.

* ``DeviceMesh._unflatten`` and ``backend_override``: torchtitan 0.3.0's ``ParallelDims``
  builds every mesh with ``world_mesh._unflatten(...)`` (``"fake"`` for the dims it never
  communicates over). It runs here with our ``init_device_mesh``/``DeviceMesh`` patched in
  at its import sites, and every mesh it keeps must have PyTorch's ranks, names, groups and
  group backends for the same ``ParallelDims``.
* ``DTensor._local_tensor`` / ``DTensor._spec`` (and what the clients read off ``_spec``).
* placements: ``Shard.local_shard_size_and_offset``, ``_StridedShard`` apart from ``Shard``,
  its optional ``split_factor``, ``Partial("product")``.
* ``ParallelStyle._apply(module, device_mesh)`` (torchtitan's ``NoParallel``) and
  ``PrepareModuleInputOutput``, against PyTorch's ``parallelize_module``.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle

import pytest
import torch
import torch.distributed as dist

from tests import _torch_compat as compat
from tests.harness import run_on_ranks


# ------------------------------------------------------------------ 1. _unflatten, backends
def _group_facts(mesh) -> list[tuple]:
    """Per mesh dim: this rank's group's ranks and backend (None off the mesh)."""
    facts = []
    for d in range(mesh.ndim):
        if mesh.get_coordinate() is None:
            facts.append(None)
            continue
        g = mesh.get_group(d)
        facts.append((tuple(dist.get_process_group_ranks(g)), str(dist.get_backend(g))))
    return facts


def _mesh_facts(mesh) -> tuple:
    return (
        mesh.mesh.tolist(),
        mesh.mesh_dim_names,
        mesh.get_coordinate(),
        _group_facts(mesh),
        mesh._get_root_mesh().mesh.tolist(),
    )


def _import_parallel_dims():
    from tests.test_torchtitan_interop import _import_torchtitan  # sets triton kernels aside

    _import_torchtitan()
    return importlib.import_module("torchtitan.distributed.parallel_dims")


@contextlib.contextmanager
def _ours_in(module):
    """torchtitan's ``parallel_dims`` with our init_device_mesh/DeviceMesh, on the CPU."""
    import device_mesh

    saved = {n: getattr(module, n) for n in ("init_device_mesh", "DeviceMesh", "device_type")}
    module.init_device_mesh = device_mesh.init_device_mesh
    module.DeviceMesh = device_mesh.DeviceMesh
    module.device_type = "cpu"
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _build(module, dims: dict, backend: str, *, ours: bool) -> dict:
    ctx = _ours_in(module) if ours else contextlib.nullcontext()
    with ctx:
        if not ours:
            saved, module.device_type = module.device_type, "cpu"
        try:
            pd = module.ParallelDims(**dims, world_size=dist.get_world_size(), spmd_backend=backend)
            world = pd.build_mesh()
        finally:
            if not ours:
                module.device_type = saved
    meshes = {"world": world, **pd._global_meshes, **pd._single_axis_meshes}
    meshes.update({f"spmd{i}": m for i, m in enumerate(pd.spmd_meshes())})
    return meshes


def _check_parallel_dims(dims: dict, backends: tuple[str, ...]) -> None:
    from device_mesh import DeviceMesh
    from device_mesh.groups import ensure_fake_backend

    ensure_fake_backend()  # PyTorch's meshes need it too (torchtitan's "fake" dims)

    module = _import_parallel_dims()
    for backend in backends:
        theirs = _build(module, dims, backend, ours=False)
        ours = _build(module, dims, backend, ours=True)
        assert set(ours) == set(theirs), (backend, set(ours) ^ set(theirs))
        for name, mesh in ours.items():
            assert isinstance(mesh, DeviceMesh), (backend, name, type(mesh))
            assert _mesh_facts(mesh) == _mesh_facts(theirs[name]), (backend, name)
            assert mesh._get_root_mesh() is ours["world"], (backend, name)
    # the meshes torchtitan concatenates for an FSDP x TP parameter
    dense, tp = ours["dense"], ours["tp"]
    shard = "dp_shard" if "dp_shard" in dense.mesh_dim_names else "fsdp"
    both = DeviceMesh._concatenate([dense[shard], tp])
    theirs_both = type(theirs["tp"])._concatenate([theirs["dense"][shard], theirs["tp"]])
    assert _mesh_facts(both) == _mesh_facts(theirs_both)
    assert pickle.loads(pickle.dumps(both)) == both
    assert pickle.loads(pickle.dumps(ours["loss"])) == ours["loss"]


def _parallel_dims_4() -> None:
    dims = dict(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1)
    _check_parallel_dims(dims, ("spmd_types",))


def _parallel_dims_2() -> None:
    dims = dict(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1)
    _check_parallel_dims(dims, ("partial_dtensor",))


@pytest.mark.skipif(not compat.TORCHTITAN_RUNS, reason=compat.TORCHTITAN_SKIP)
def test_torchtitan_parallel_dims_4_ranks():
    run_on_ranks(4, _parallel_dims_4)


@pytest.mark.skipif(not compat.TORCHTITAN_RUNS, reason=compat.TORCHTITAN_SKIP)
def test_torchtitan_parallel_dims_2_ranks():
    run_on_ranks(2, _parallel_dims_2)


# ------------------------------------------------------------------ 2. _local_tensor, _spec
def _pairs():
    """(ours, PyTorch's) DTensors of one 7 x 5 tensor on a 1-D and a 2-D mesh."""
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import dtensor
    from device_mesh import init_device_mesh

    full = torch.arange(35.0).view(7, 5)
    n = dist.get_world_size()
    shape = (n,) if n == 2 else (2, n // 2)
    ours_mesh, theirs_mesh = init_device_mesh("cpu", shape), torch_mesh("cpu", shape)
    layouts = [("Shard", 0), ("Shard", 1), ("Replicate",)]
    for layout in layouts:
        for second in layouts if len(shape) == 2 else [None]:
            chosen = [layout] if second is None else [layout, second]
            ours_p = [getattr(dtensor, c[0])(*c[1:]) for c in chosen]
            theirs_p = [getattr(tdt, c[0])(*c[1:]) for c in chosen]
            yield (
                dtensor.distribute_tensor(full, ours_mesh, ours_p),
                tdt.distribute_tensor(full, theirs_mesh, theirs_p),
            )


def _spec_aliases(full_spec: bool) -> None:
    for ours, theirs in _pairs():
        assert torch.equal(ours._local_tensor, theirs._local_tensor)
        assert ours._local_tensor is ours.to_local() or torch.equal(
            ours._local_tensor, ours.to_local()
        )
        so, st = ours._spec, theirs._spec
        assert tuple(so.placements) == tuple(st.placements)
        assert so.mesh.mesh.tolist() == st.mesh.mesh.tolist()
        assert so.mesh.mesh_dim_names == st.mesh.mesh_dim_names
        assert so.is_replicated() == st.is_replicated()
        if not full_spec:
            continue
        meta_o, meta_t = so.tensor_meta, st.tensor_meta
        assert (meta_o.shape, tuple(meta_o.stride), meta_o.dtype) == (
            meta_t.shape,
            tuple(meta_t.stride),
            meta_t.dtype,
        )
        for name in ("shape", "stride", "ndim", "num_shards", "num_shards_map", "sums"):
            assert getattr(so, name) == getattr(st, name), name
        assert so.device_mesh is so.mesh and so.is_sharded() == st.is_sharded()
        assert _dim_map(so) == _dim_map(st)  # both raise for (Shard(0), Shard(0))


def _dim_map(spec):
    try:
        return spec.dim_map
    except ValueError:
        return "raises"


@pytest.mark.parametrize("world", [2, 4])
def test_local_tensor_and_spec_like_pytorch(world):
    run_on_ranks(world, _spec_aliases, full_spec=False)


def test_spec_fields_clients_read():
    run_on_ranks(4, _spec_aliases, full_spec=True)


def _local_tensor_after_async_redistribute() -> None:
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import dtensor
    from device_mesh import init_device_mesh

    full = torch.arange(35.0).view(7, 5)
    ours = dtensor.distribute_tensor(full, init_device_mesh("cpu", (2,)), [dtensor.Shard(0)])
    theirs = tdt.distribute_tensor(full, torch_mesh("cpu", (2,)), [tdt.Shard(0)])
    ours = ours.redistribute(placements=[dtensor.Replicate()], async_op=True)
    theirs = theirs.redistribute(placements=[tdt.Replicate()], async_op=True)
    # read straight off the attribute, as frameworks do: never the block from before
    assert torch.equal(ours._local_tensor, full)
    assert torch.equal(ours._local_tensor, theirs._local_tensor.wait())


def test_local_tensor_waits_for_an_async_redistribute():
    run_on_ranks(2, _local_tensor_after_async_redistribute)


# ------------------------------------------------------------------ 3. placements
def test_shard_local_shard_size_and_offset_like_pytorch():
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard as TStrided

    from dtensor import Shard
    from dtensor.placement import _StridedShard

    for size in range(10):
        for k in range(1, 5):
            for r in range(k):
                want = TShard.local_shard_size_and_offset(size, k, r)
                assert Shard.local_shard_size_and_offset(size, k, r) == tuple(want)
                assert Shard(0).local_shard_size_and_offset(size, k, r) == tuple(want)
                for sf in (1, 2, 3):
                    want = TStrided(0, split_factor=sf).local_shard_size_and_offset(size, k, r)
                    got = _StridedShard(0, split_factor=sf).local_shard_size_and_offset(size, k, r)
                    assert got == tuple(want), (size, k, r, sf)


def test_strided_shard_is_not_a_shard():
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard as TStrided

    from dtensor import Partial, Shard
    from dtensor.placement import _StridedShard, is_shard_like

    for ours, theirs in ((_StridedShard(0, split_factor=2), TStrided(0, split_factor=2)),):
        assert isinstance(ours, Shard) == isinstance(theirs, TShard) is False
        assert ours.is_shard() == theirs.is_shard() is False
        assert not isinstance(theirs, Shard) and is_shard_like(ours) and is_shard_like(theirs)
        assert ours == theirs and hash(ours) == hash(theirs)
    assert _StridedShard(1) == TStrided(1) and _StridedShard(1).split_factor == 1
    assert _StridedShard(0, sf=3) == TStrided(0, sf=3)
    with pytest.raises(TypeError, match="split_factor or sf"):
        _StridedShard(0, 2, sf=3)
    from torch.distributed.tensor import Partial as TPartial

    assert Partial.ALL_REDUCE_OPS == TPartial.ALL_REDUCE_OPS
    assert Partial.LINEAR_REDUCE_OPS == TPartial.LINEAR_REDUCE_OPS
    assert Partial("product") == TPartial("product") and not Partial("product").is_linear


def _product_partial() -> None:
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import dtensor
    from device_mesh import init_device_mesh

    n = dist.get_world_size()
    local = torch.arange(1.0, 8.0).view(7, 1) + dist.get_rank()
    ours = dtensor.DTensor.from_local(
        local, init_device_mesh("cpu", (n,)), [dtensor.Partial("product")]
    )
    theirs = tdt.DTensor.from_local(local, torch_mesh("cpu", (n,)), [tdt.Partial("product")])
    want = theirs.redistribute(placements=[tdt.Replicate()]).to_local()
    assert torch.equal(ours.redistribute(placements=[dtensor.Replicate()]).to_local(), want)
    assert torch.equal(ours.full_tensor(), theirs.full_tensor())
    shard = ours.redistribute(placements=[dtensor.Shard(0)]).to_local()
    assert torch.equal(shard, torch.chunk(want, n)[dist.get_rank()])


@pytest.mark.parametrize("world", [2, 4])
def test_partial_product_multiplies(world):
    run_on_ranks(world, _product_partial)


# ------------------------------------------------------------------ 4. ParallelStyle._apply
class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 8)
        self.gate = torch.nn.Linear(8, 8)
        self.down = torch.nn.Linear(8, 6)

    def forward(self, x):
        return self.down(torch.relu(self.gate(self.up(x))))


def _no_parallel_class(ours: bool):
    """torchtitan's ``NoParallel``, its methods unchanged, as a ParallelStyle of ours (the
    names its module took from PyTorch's DTensor rebound to ours), or as it ships."""
    tp = importlib.import_module("torchtitan.distributed.tensor_parallel")
    if not ours:
        return tp.NoParallel, contextlib.nullcontext()
    import dtensor
    from dtensor.parallel import ParallelStyle

    @contextlib.contextmanager
    def ported():
        saved = {n: getattr(tp, n) for n in ("DTensor", "distribute_module", "Replicate")}
        for name in saved:
            setattr(tp, name, getattr(dtensor, name))
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(tp, name, value)

    # torchtitan's class first (its __init__ calls super() with no arguments, so it must
    # stay in the MRO), then ours: the methods it defines are the only ones that run
    return type("NoParallel", (tp.NoParallel, ParallelStyle), {}), ported()


def _run_plan(ours: bool, x: torch.Tensor):
    if ours:
        from device_mesh import init_device_mesh
        from dtensor import Replicate, Shard
        from dtensor.parallel import (
            ColwiseParallel,
            PrepareModuleInputOutput,
            RowwiseParallel,
            parallelize_module,
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInputOutput,
            RowwiseParallel,
            parallelize_module,
        )
    no_parallel, ctx = _no_parallel_class(ours)
    torch.manual_seed(0)
    model = _MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {
        "up": PrepareModuleInputOutput(
            input_layouts=(Shard(0),),
            desired_input_layouts=(Replicate(),),
            output_layouts=Replicate(),
            desired_output_layouts=Shard(0),
            use_local_input=True,
            use_local_output=True,
        ),
        "gate": no_parallel(use_local_output=True),
        "down": RowwiseParallel(input_layouts=Shard(0), output_layouts=Replicate()),
    }
    del ColwiseParallel
    with ctx:
        parallelize_module(model, mesh, plan)
        out = model(x)
        out.pow(2).sum().backward()
    # "up" keeps plain parameters (PrepareModuleInputOutput only moves activations)
    grads = {
        n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in model.named_parameters()
    }
    return out, grads


def _styles_like_pytorch() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 6)  # this rank's rows of the batch
    ours_out, ours_grads = _run_plan(True, x)
    theirs_out, theirs_grads = _run_plan(False, x)
    torch.testing.assert_close(ours_out, theirs_out)
    assert ours_grads.keys() == theirs_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], msg=name)


@pytest.mark.skipif(not compat.TORCHTITAN_RUNS, reason=compat.TORCHTITAN_SKIP)
def test_pytorch_style_apply_and_prepare_module_input_output():
    run_on_ranks(2, _styles_like_pytorch)


def _strided_shard_in_ops() -> None:
    import torch.nn.functional as F

    import dtensor
    from device_mesh import init_device_mesh
    from dtensor.placement import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2))  # FSDP over TP's order: a strided outer dim
    weight = torch.arange(8.0 * 6).view(8, 6)
    idx = torch.tensor([[0, 3, 7], [5, 1, 2]])
    ids = dtensor.distribute_tensor(idx, mesh, [dtensor.Replicate()] * 2)
    for dim in (0, 1):  # rows (the vocabulary) or columns split in a strided order
        placements = [_StridedShard(dim, split_factor=2), dtensor.Shard(dim)]
        w = dtensor.distribute_tensor(weight, mesh, placements)
        assert torch.equal(F.embedding(ids, w).full_tensor(), F.embedding(idx, weight))
        stacked = torch.stack([w, w * 2])
        assert torch.equal(stacked.full_tensor(), torch.stack([weight, weight * 2]))


def test_strided_shards_keep_their_order_through_embedding_and_stack():
    run_on_ranks(4, _strided_shard_in_ops)


def _with_pytorch_names_rebound_to_ours() -> None:
    import torch.distributed.device_mesh as tdm
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.placement_types as pt

    import device_mesh
    import dtensor

    saved = (pt.Placement, tdt.DTensor, tdm.DeviceMesh)
    # the crudest port: PyTorch's module attributes rebound to ours for a whole run
    pt.Placement, tdt.DTensor, tdm.DeviceMesh = (
        dtensor.Placement,
        dtensor.DTensor,
        device_mesh.DeviceMesh,
    )
    try:
        mesh = device_mesh.init_device_mesh("cpu", (2,))
        full = torch.arange(21.0).view(7, 3)
        dt = dtensor.distribute_tensor(full, mesh, [dtensor.Shard(0)])
        assert isinstance(dtensor.Shard(0), dtensor.Placement)
        assert torch.equal(
            dt.full_tensor(), full
        )  # recursed without end when ours was taken for PyTorch's
    finally:
        pt.Placement, tdt.DTensor, tdm.DeviceMesh = saved


def test_ours_is_never_taken_for_pytorchs_when_its_names_are_rebound():
    run_on_ranks(2, _with_pytorch_names_rebound_to_ours)
