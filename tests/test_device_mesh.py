"""DeviceMesh against PyTorch's own DeviceMesh (the oracle), on 1-D, 2-D and 3-D meshes."""

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from device_mesh import DeviceMesh, init_device_mesh
from device_mesh import groups as _groups
from tests.harness import run_on_ranks

LAYOUTS = [
    (1, (1,), ("dp",)),
    (2, (2,), ("dp",)),
    (2, (1, 2), ("dp", "tp")),
    (4, (4,), ("dp",)),
    (4, (2, 2), ("dp", "tp")),
    (4, (2, 1, 2), ("dp", "cp", "tp")),
]


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _check_queries_match_torch(shape, names):
    ours = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ref = torch_init_device_mesh("cpu", shape, mesh_dim_names=names)
    assert torch.equal(ours.mesh, ref.mesh)
    assert ours.shape == tuple(ref.shape)
    assert ours.ndim == ref.ndim
    assert ours.mesh_dim_names == ref.mesh_dim_names
    assert ours.device_type == ref.device_type
    assert ours.size() == ref.size()
    assert ours.get_rank() == ref.get_rank()
    assert ours.get_coordinate() == tuple(ref.get_coordinate())
    for d, name in enumerate(names):
        for key in (d, name):
            assert ours.size(key) == ref.size(d)
            assert ours.get_local_rank(key) == ref.get_local_rank(key)
            assert _group_ranks(ours.get_group(key)) == _group_ranks(ref.get_group(key))
    # Every in-order selection of names slices the same sub-mesh as torch.
    for k in range(1, len(names) + 1):
        for chosen in itertools.combinations(names, k):
            sub, ref_sub = ours[chosen], ref[chosen]
            assert torch.equal(sub.mesh, ref_sub.mesh), chosen
            assert sub.mesh_dim_names == ref_sub.mesh_dim_names
            assert sub.get_coordinate() == tuple(ref_sub.get_coordinate())
            for d in range(sub.ndim):
                assert sub.get_local_rank(d) == ref_sub.get_local_rank(d)
                assert _group_ranks(sub.get_group(d)) == _group_ranks(ref_sub.get_group(d))
    if len(names) > 1:
        flat, ref_flat = ours.flatten("flat"), ref._flatten("flat")
        assert torch.equal(flat.mesh, ref_flat.mesh)
        assert flat.get_local_rank() == ref_flat.get_local_rank()
        assert _group_ranks(flat.get_group()) == _group_ranks(ref_flat.get_group())
        assert ours["flat"] is flat


@pytest.mark.parametrize("world,shape,names", LAYOUTS, ids=lambda v: str(v))
def test_queries_match_torch(world, shape, names):
    run_on_ranks(world, _check_queries_match_torch, shape=shape, names=names)


def _check_collective_reaches_submesh(shape, names):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    world = dist.get_world_size()
    for name in names:
        one_hot = torch.zeros(world)
        one_hot[dist.get_rank()] = 1.0
        dist.all_reduce(one_hot, group=mesh[name].get_group())
        expected = torch.zeros(world)
        expected[mesh[name].mesh.reshape(-1)] = 1.0
        assert torch.equal(one_hot, expected), (name, one_hot, expected)
        assert mesh[name].mesh.reshape(-1).tolist() == mesh.ranks_along(name)


@pytest.mark.parametrize("world,shape,names", LAYOUTS[2:], ids=lambda v: str(v))
def test_collective_reaches_exactly_the_submesh(world, shape, names):
    run_on_ranks(world, _check_collective_reaches_submesh, shape=shape, names=names)


def _check_groups_created_once():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    before = dict(_groups._GROUP_CACHE)
    again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sub = mesh["tp"]
    both = mesh["dp", "tp"]
    assert _groups._GROUP_CACHE == before, "building an equal mesh or slicing created groups"
    assert sub.get_group() is mesh.get_group("tp")
    assert again.get_group("dp") is mesh.get_group("dp")
    assert both is mesh
    mesh.flatten("dp_tp")
    after_flatten = len(_groups._GROUP_CACHE)
    assert mesh.flatten("dp_tp") is mesh["dp_tp"]
    assert len(_groups._GROUP_CACHE) == after_flatten


def test_groups_are_created_once_and_cached():
    run_on_ranks(4, _check_groups_created_once)


def _check_eq_hash_repr():
    a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    b = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    c = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    d = init_device_mesh("cpu", (4,))
    assert a == b and hash(a) == hash(b)
    assert a != c and a != d
    assert len({a, b, c, d}) == 3
    assert repr(a) == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"
    assert repr(d) == "DeviceMesh('cpu', [0, 1, 2, 3])"
    # A transposed mesh is legal: rows ascend along both dims.
    t = DeviceMesh("cpu", torch.arange(4).view(2, 2).T, mesh_dim_names=("a", "b"))
    assert t.get_coordinate() == (dist.get_rank() % 2, dist.get_rank() // 2)
    assert _group_ranks(t.get_group("b")) == t["b"].mesh.tolist()


def test_eq_hash_repr():
    run_on_ranks(4, _check_eq_hash_repr)


def _check_errors():
    world = dist.get_world_size()
    with pytest.raises(
        ValueError,
        match=r"init_device_mesh: mesh_shape \(3,\) holds 3 ranks but the world size is 2",
    ):
        init_device_mesh("cpu", (3,))
    with pytest.raises(ValueError, match="world size is 2"):
        DeviceMesh("cpu", [0, 1, 2])
    with pytest.raises(ValueError, match=r"duplicate rank\(s\) \[1\]"):
        DeviceMesh("cpu", [1, 1])
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\)"):
        DeviceMesh("cpu", [0, 5])
    with pytest.raises(NotImplementedError, match="must increase"):
        DeviceMesh("cpu", [1, 0])
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    with pytest.raises(
        ValueError, match=r"unknown mesh dim name\(s\) \['pp'\]. Valid names: \['dp', 'tp'\]"
    ):
        mesh["pp"]
    with pytest.raises(ValueError, match=r"repeated"):
        mesh["dp", "dp"]
    with pytest.raises(ValueError, match=r"mesh order \('dp', 'tp'\).*mesh\[\('dp', 'tp'\)\]"):
        mesh["tp", "dp"]
    with pytest.raises(
        ValueError, match="DeviceMesh.get_group: mesh_dim is required on a 2-D mesh"
    ):
        mesh.get_group()
    with pytest.raises(ValueError, match="DeviceMesh.get_local_rank: mesh_dim is required"):
        mesh.get_local_rank()
    with pytest.raises(ValueError, match=r"mesh_dim must be in \[-2, 2\), got 2"):
        mesh.get_group(2)
    with pytest.raises(ValueError, match="mesh_dim_names must be unique"):
        init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "a"))
    with pytest.raises(ValueError, match="one name per mesh dim"):
        init_device_mesh("cpu", (1, world), mesh_dim_names=("a",))
    with pytest.raises(ValueError, match="positive ints"):
        init_device_mesh("cpu", (0, world))
    with pytest.raises(ValueError, match="device_type must be one of .* got 'tpu'"):
        init_device_mesh("tpu", (world,))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device_type 'cuda' has no usable backend"):
            init_device_mesh("cuda", (world,))
    with pytest.raises(RuntimeError, match="no mesh_dim_names"):
        init_device_mesh("cpu", (world,))["dp"]


def test_bad_input_gives_clear_errors():
    run_on_ranks(2, _check_errors)


def test_validation_needs_no_process_group():
    from device_mesh.mesh import _as_mesh_tensor, _check_dim_names

    assert _as_mesh_tensor([[0, 1], [2, 3]]).dtype == torch.int64
    with pytest.raises(TypeError, match="integer ranks"):
        _as_mesh_tensor([0.0, 1.0])
    with pytest.raises(TypeError, match="tuple of str"):
        _check_dim_names("dp", 1, api="x")


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import gc, weakref
    import pytest, torch, torch.distributed as dist
    from device_mesh import init_device_mesh
    assert not dist.is_initialized()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, group=mesh.get_group("dp"))
    assert t.item() == 3.0, t
    grid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    groups = [weakref.ref(g) for g in (*grid.get_all_groups(), grid["a", "b"].flatten().get_group())]
    print(f"rank {mesh.get_rank()} ok", flush=True)
    dist.barrier()  # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()
    # [Note: weak group references]: nothing of ours keeps a group alive past this point,
    # so gloo joined its threads now, not during interpreter shutdown (SIGABRT at exit)
    gc.collect()
    assert all(g() is None for g in groups), [g() for g in groups]
    with pytest.raises(RuntimeError, match="was destroyed"):
        mesh.get_group("dp")
    print(f"rank {dist.get_rank() if dist.is_initialized() else mesh.get_rank()} clean", flush=True)
    """
)


@pytest.mark.slow
def test_works_under_torchrun(tmp_path):
    script = tmp_path / "mesh_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 ok" in out.stdout and "rank 1 ok" in out.stdout
    assert "rank 0 clean" in out.stdout and "rank 1 clean" in out.stdout, out.stderr


# ----------------------------------------------------------------------------- recipe features
def _check_flatten_slices_and_from_group():
    import pickle

    names = ("dp_replicate", "dp_shard", "cp")
    ours = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=names)
    ref = torch_init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=names)
    ours["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
    ref["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
    for chosen in [("dp_shard_cp",), ("dp_replicate", "dp_shard_cp")]:
        sub, ref_sub = ours[chosen], ref[chosen]
        assert torch.equal(sub.mesh, ref_sub.mesh), chosen
        assert sub.mesh_dim_names == ref_sub.mesh_dim_names
        assert sub.get_coordinate() == tuple(ref_sub.get_coordinate())
        for d in range(sub.ndim):
            assert _group_ranks(sub.get_group(d)) == _group_ranks(ref_sub.get_group(d))
        back = pickle.loads(pickle.dumps(sub))
        assert back == sub and [back.get_group(d) for d in range(back.ndim)] == [
            sub.get_group(d) for d in range(sub.ndim)
        ]
    with pytest.raises(ValueError, match="mesh order"):
        ours["dp_shard_cp", "dp_replicate"]
    with pytest.raises(ValueError, match="cover each dim once"):
        ours["dp_shard", "dp_shard_cp"]
    # from_group: one group gives a 1-D mesh over its ranks; a list needs the global ranks
    pg = ours.get_group("dp_shard")
    one = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("s",))
    assert one.mesh.tolist() == _group_ranks(pg) and one.get_group() is pg
    two = DeviceMesh.from_group(
        [ours.get_group(0), ours.get_group(1)],
        "cpu",
        torch.arange(4).view(2, 2),
        mesh_dim_names=("r", "s"),
    )
    assert two.get_coordinate() == ours.get_coordinate()[:2]
    assert two.get_all_groups() == [ours.get_group(0), ours.get_group(1)]
    with pytest.raises(ValueError, match="mesh is required with 2 groups"):
        DeviceMesh.from_group([pg, pg], "cpu")
    with pytest.raises(ValueError, match="Pass the groups in mesh-dim order"):
        DeviceMesh.from_group(
            [ours.get_group(1), ours.get_group(0)], "cpu", torch.arange(4).view(2, 2)
        )


def test_flatten_mixed_slices_and_from_group_match_torch():
    run_on_ranks(4, _check_flatten_slices_and_from_group)


def _check_meshes_over_part_of_the_world():
    from torch import nn

    from fsdp2 import fully_shard

    rank = dist.get_rank()
    # every rank builds both stages' meshes (group creation is collective over the world)
    stages = [DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",)), DeviceMesh("cpu", [2, 3])]
    mine, other = stages[rank // 2], stages[1 - rank // 2]
    assert other.get_coordinate() is None and mine.get_local_rank() == rank % 2
    with pytest.raises(RuntimeError, match="not in"):
        other.get_group()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine.get_group())
    assert t.item() == {0: 1.0, 1: 5.0}[rank // 2]  # summed within the stage only
    # each stage trains its own model with fully_shard over its own ranks
    torch.manual_seed(rank // 2)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model.load_state_dict(ref.state_dict())
    fully_shard(model, mesh=mine)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 + rank // 2))
    for _ in range(2):
        ref(x).square().mean().backward()
        model(x[2 * (rank % 2) : 2 * (rank % 2) + 2]).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)


def test_meshes_over_part_of_the_world():
    run_on_ranks(4, _check_meshes_over_part_of_the_world)


def test_env_switches_read_every_spelling_and_refuse_a_typo(monkeypatch):
    """One reading for every on/off variable of the library (FSDP2_CHECK_FREED read
    "false" as on before)."""
    from device_mesh.switches import env_switch

    name = "DEVICE_MESH_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert env_switch(name) is False and env_switch(name, default=None) is None
    for value, expected in (("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                            ("0", False), ("False", False), ("no", False), ("OFF", False),
                            ("", True)):  # fmt: skip
        monkeypatch.setenv(name, value)
        assert env_switch(name, default=True) is expected, value
    monkeypatch.setenv(name, "flase")
    with pytest.raises(ValueError, match=r"DEVICE_MESH_TEST_SWITCH='flase': expected on \(1,"):
        env_switch(name)


def _check_resources_live_with_the_root():
    import copy
    import pickle

    from device_mesh import MeshResources

    class Counts:  # a class of "the layer above"
        def __init__(self) -> None:
            self.n = 0

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert isinstance(mesh.resources, MeshResources)
    assert mesh.resources.peek(Counts) is None  # peek makes nothing
    mesh.resources.get(Counts).n += 1
    flat = mesh.flatten("dp_tp")
    for other in (mesh["tp"], mesh["dp"], mesh["dp", "tp"], flat, copy.deepcopy(mesh["tp"])):
        assert other.resources is mesh.resources
        assert other.resources.get(Counts).n == 1
    assert "Counts" in repr(mesh.resources)
    # a rebuilt mesh (unpickled) and a second root start empty
    back = pickle.loads(pickle.dumps(mesh["tp"]))
    assert back == mesh["tp"] and back.resources.peek(Counts) is None
    second = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert second.resources is not mesh.resources
    assert second.resources.get(Counts).n == 0


def test_resources_live_with_the_root_mesh():
    run_on_ranks(4, _check_resources_live_with_the_root)
