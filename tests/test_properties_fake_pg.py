"""Property-based tests of local shapes at world sizes this machine cannot spawn, in one
process, with PyTorch's fake process group (collectives return at once and move no data).

For a random mesh of world size up to 16 (64 with ``HYPOTHESIS_PROFILE=long``) and a few
of its ranks, picked at random, the pytest process becomes that rank of a fake world and
checks that ``distribute_tensor``, ``redistribute`` (every pair of placements), ``from_local``
and the registered ops give every rank a local tensor of exactly the shape of its
``torch.chunk`` piece (``_properties.oracle_local``) - no data is compared, only layouts -
or a clear error. The default process group is destroyed again after each example.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests import _properties as P
from tests.test_properties_dtensor import _OPS, _expect_error, _op_case_args

MAX_WORLD = 64 if P.LONG else 16
PROP = f"fake process group: local shapes at world sizes 1-{MAX_WORLD}"


@contextlib.contextmanager
def _fake_rank(rank: int, world_size: int):
    """This process as ``rank`` of a fake world; meshes build their groups on it."""
    import device_mesh.groups as groups
    from dtensor._dispatch import clear_cache

    if dist.is_initialized():
        pytest.fail("a default process group already exists in the pytest process")
    saved = dict(groups._BACKENDS)
    groups._BACKENDS["cpu"] = "fake"  # the mesh's per-dim groups: fake ones too
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # The dispatch cache is keyed by mesh equality, and this process plays several ranks of
    # equal meshes: a rule's local function computed for one rank must not serve the next.
    clear_cache()
    try:
        yield
    finally:
        dist.destroy_process_group()
        groups._BACKENDS.clear()
        groups._BACKENDS.update(saved)


def _shape_of(full_shape, mesh_shape, coord, pl) -> tuple:
    return tuple(P.oracle_local(torch.empty(full_shape), mesh_shape, coord, pl).shape)


def _as_tuple(p):
    return ("S", p.dim) if p.is_shard() else ("P", p.reduce_op) if p.is_partial() else ("R",)


def _check_rank(mesh_shape, shape, src, dst, op_case) -> list[str]:
    from device_mesh import init_device_mesh
    from dtensor import DTensor, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    coord, ndim = mesh.get_coordinate(), len(shape)
    outcomes = []
    src_ok = all(P.shard_dim_ok(p, ndim) for p in src)
    dt, err = _expect_error(
        lambda: distribute_tensor(torch.zeros(shape), mesh, P.to_placements(src)),
        not src_ok,
        "distribute",
    )
    if err:
        outcomes.append(err)
    else:
        srcn = tuple(P.norm_dim(p, ndim) for p in src)
        want = _shape_of(shape, mesh_shape, coord, srcn)
        assert tuple(dt.to_local().shape) == want, ("distribute", dt.to_local().shape, want)
        dst_ok = all(P.shard_dim_ok(p, ndim) for p in dst) and not any(
            d[0] == "P" and d != s for s, d in zip(srcn, dst)
        )
        moved, err = _expect_error(
            lambda: dt.redistribute(placements=P.to_placements(dst)), not dst_ok, "redistribute"
        )
        if err:
            outcomes.append(err)
        else:
            dstn = tuple(P.norm_dim(p, ndim) for p in dst)
            want = _shape_of(shape, mesh_shape, coord, dstn)
            got = tuple(moved.to_local().shape)
            assert got == want, ("redistribute", srcn, dstn, got, want)
            fl = DTensor.from_local(torch.zeros(want), mesh, P.to_placements(dstn), shape=shape)
            assert tuple(fl.to_local().shape) == want and tuple(fl.shape) == tuple(shape)
    family, name, shapes, pls, _seed, arg = op_case
    fn = _OPS[family][name]
    want_full = fn(*[torch.zeros(s) for s in shapes], arg)
    dts = [distribute_tensor(torch.zeros(s), mesh, P.to_placements(p)) for s, p in zip(shapes, pls)]
    out, err = _expect_error(lambda: fn(*dts, arg), None, f"{family}.{name}")
    if err:
        outcomes.append(err)
    else:
        assert tuple(out.shape) == tuple(want_full.shape), (name, out.shape, want_full.shape)
        opl = tuple(_as_tuple(p) for p in out.placements)
        want = _shape_of(tuple(want_full.shape), mesh_shape, coord, opl)
        got = tuple(out.to_local().shape)
        assert got == want, (f"{family}.{name}", shapes, pls, out.placements, got, want)
    return outcomes or ["ok"]


@st.composite
def _fake_examples(draw):
    ws = draw(st.integers(1, MAX_WORLD))
    mesh = draw(st.sampled_from(P.mesh_shapes(ws)))
    shape = draw(P.tensor_shapes(max_size=2 * max(mesh) + 1))
    src = draw(P.placements(len(mesh), len(shape), out_of_range=True))
    dst = list(draw(P.placements(len(mesh), len(shape), partial=False)))
    for m, p in enumerate(src):
        if p[0] == "P" and draw(st.booleans()):
            dst[m] = p
    ranks = draw(st.lists(st.integers(0, ws - 1), min_size=1, max_size=3, unique=True))
    return ws, mesh, shape, src, tuple(dst), draw(_op_case_args(mesh)), sorted({*ranks, ws - 1})


@pytest.mark.timeout(P.TIMEOUT_S)
@given(_fake_examples())
@P.examples(100, long=400)
def test_local_shapes_at_any_world_size(example):
    ws, mesh, shape, src, dst, op_case, ranks = example
    P.count(PROP, "examples")
    for rank in ranks:
        with _fake_rank(rank, ws):
            outcomes = _check_rank(mesh, shape, src, dst, op_case)
        P.count(PROP, "cases")
        for o in outcomes:
            if o != "ok":
                P.count(PROP, o)
