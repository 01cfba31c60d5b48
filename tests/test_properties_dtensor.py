"""Property-based tests of DTensor layouts, redistribution, op rules and checkpoints on real
gloo worlds (hypothesis; profiles and strategies in tests/_properties.py).

Every property: a random mesh (1-3 dims, world sizes 1-4, or 1-8 with
``HYPOTHESIS_PROFILE=long``), random tensor shapes (dims of 0, 1, smaller than the mesh),
random placements (Shard of any dim, negative ones and repeated shards of one dim on several
mesh dims, Replicate, Partial of every reduce op). Each case ends in exact equality with a
plain-tensor oracle (integer values, so sums are exact; ``avg`` to a few ulps, because the
division rounds) or in a clear library error that every rank raises alike, before any
collective. A hang, a crash, a wrong shape or ranks that disagree fail the property.

The oracle for a rank's piece (``_properties.oracle_local``) is built from ``torch.chunk``
alone, not from the library's chunk maths.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tests import _properties as P
from tests.harness import run_on_ranks

# A batch that hangs fails in this many seconds (a batch normally takes well under one).
BATCH_TIMEOUT_S = 60.0


def _full_arange(shape) -> torch.Tensor:
    """Distinct values (every element tells where it came from), exact in float32."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape)


def _ints(shape, seed: int, low: int = -9, high: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, tuple(shape), generator=g).to(torch.float32)


def _run_batch(fn, mesh_cases, report: str, prop: str) -> list[str]:
    """Run ``fn(mesh_shape, case)`` for every case on every rank of this pool, keep ranks
    in step (a case's property violation is recorded, not raised, so no rank skips the
    collectives of the next case), then check that every rank saw the same outcome."""
    from device_mesh import init_device_mesh

    outcomes = []
    for mesh_shape, case in mesh_cases:
        mesh = init_device_mesh("cpu", tuple(mesh_shape))
        try:
            outcomes.append(fn(mesh, *case))
        except AssertionError as e:
            outcomes.append(f"FAIL {prop} {mesh_shape} {case}: {e}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outcomes)
    failures = [
        f"rank {r}: {o}" for r, outs in enumerate(everyone) for o in outs if o.startswith("FAIL")
    ]
    if failures:
        raise AssertionError("\n".join(failures))
    for r, outs in enumerate(everyone):
        if outs != outcomes:
            diff = [(c, a, b) for c, a, b in zip(mesh_cases, outcomes, outs) if a != b]
            raise AssertionError(f"ranks disagree on the outcome (rank {r} vs me): {diff}")
    if dist.get_rank() == 0:
        with open(report, "w") as f:
            json.dump(outcomes, f)
    return outcomes


def _tally(prop: str, report: str, n_cases: int, world_size: int) -> list[str]:
    with open(report) as f:
        outcomes = json.load(f)
    assert len(outcomes) == n_cases
    P.count(prop, "examples")
    P.count(prop, f"cases at world size {world_size}", n_cases)
    P.count(prop, "cases", n_cases)
    for o in outcomes:
        if o != "ok":
            P.count(prop, o)
    return outcomes


@st.composite
def _batches(draw, ws, case_args):
    """A batch of 1..BATCH cases for world size ``ws``: each a mesh shape drawn for ``ws``
    and the arguments ``case_args(mesh_shape)`` draws for it."""
    cases = []
    for _ in range(draw(st.integers(1, P.BATCH))):
        mesh = draw(st.sampled_from(P.mesh_shapes(ws)))
        cases.append((mesh, draw(case_args(mesh))))
    return cases


def _check_batch(tmp_path_factory, ws: int, batch_fn, cases, prop: str) -> None:
    """Run one batch on ``ws`` ranks of the pool and count its cases under ``prop``."""
    report = str(tmp_path_factory.mktemp(prop.split(":")[0]) / "outcomes.json")
    run_on_ranks(ws, batch_fn, cases=cases, report=report, timeout_s=BATCH_TIMEOUT_S)
    _tally(prop, report, len(cases), ws)


def _expect_error(fn, expected: bool, what: str):
    """Run ``fn``; returns (result, None) or (None, "error: ...") for a clear error, which
    must happen exactly when ``expected`` (``None``: a clear error is allowed, not required;
    every rank must still agree, which ``_run_batch`` checks)."""
    try:
        result = fn()
    except P.CLEAR_ERRORS as e:
        label = P.check_clear(e)
        assert expected is not False, f"{what}: unexpected {label}"
        return None, f"error: {label}"
    assert not expected, f"{what}: expected a clear error, got a result"
    return result, None


# ------------------------------------------------------------------ layouts and round trips
def _layout_case(mesh, shape, src, dst):
    from dtensor import DTensor, distribute_tensor

    ms, coord, ndim = tuple(mesh.shape), mesh.get_coordinate(), len(shape)
    full = _full_arange(shape)
    src_ok = all(P.shard_dim_ok(p, ndim) for p in src)
    dt, err = _expect_error(
        lambda: distribute_tensor(full, mesh, P.to_placements(src)), not src_ok, "distribute"
    )
    if err:
        return err
    srcn = tuple(P.norm_dim(p, ndim) for p in src)
    assert dt.shape == full.shape and dt.placements == P.to_placements(srcn), (dt, srcn)
    want = P.oracle_local(full, ms, coord, srcn)
    if any(p[0] == "P" for p in srcn):
        assert dt.to_local().shape == want.shape, (dt.to_local().shape, want.shape)
    else:
        assert torch.equal(dt.to_local(), want), ("distribute local", dt.to_local(), want)
    assert torch.equal(dt.full_tensor(), full), "distribute -> full_tensor"

    dst_ok = all(P.shard_dim_ok(p, ndim) for p in dst) and not any(
        d[0] == "P" and d != s for s, d in zip(srcn, dst)
    )
    moved, err = _expect_error(
        lambda: dt.redistribute(placements=P.to_placements(dst)), not dst_ok, "redistribute"
    )
    if err:
        return err
    dstn = tuple(P.norm_dim(p, ndim) for p in dst)
    assert moved.shape == full.shape and moved.placements == P.to_placements(dstn)
    want = P.oracle_local(full, ms, coord, dstn)
    if any(p[0] == "P" for p in dstn):
        assert moved.to_local().shape == want.shape, (moved.to_local().shape, want.shape)
    else:
        assert torch.equal(moved.to_local(), want), ("redistribute local", moved.to_local(), want)
    assert torch.equal(moved.full_tensor(), full), "redistribute -> full_tensor"

    back_ok = not any(s[0] == "P" and s != d for s, d in zip(srcn, dstn))
    back, err = _expect_error(
        lambda: moved.redistribute(placements=P.to_placements(srcn)), not back_ok, "back"
    )
    err = err and err.replace("error: ", "error: [back to a Partial] ")
    if back is not None:
        assert torch.equal(back.to_local(), dt.to_local()), "round trip src -> dst -> src"
        assert torch.equal(back.full_tensor(), full), "round trip -> full_tensor"

    if not any(p[0] == "P" for p in dstn):
        local = P.oracle_local(full, ms, coord, dstn)
        fl = DTensor.from_local(
            local, mesh, P.to_placements(dst), shape=full.shape, stride=full.stride(),
            run_check=True,
        )  # fmt: skip
        assert fl.shape == full.shape and torch.equal(fl.to_local(), local), "from_local"
        assert torch.equal(fl.full_tensor(), full), "from_local -> full_tensor"
    return err or "ok"


def _layout_batch(cases, report):
    _run_batch(_layout_case, cases, report, "layout")


@st.composite
def _layout_case_args(draw, mesh):
    shape = draw(P.tensor_shapes())
    src = draw(P.placements(len(mesh), len(shape), out_of_range=True))
    dst = list(draw(P.placements(len(mesh), len(shape), out_of_range=True, partial=False)))
    for m, p in enumerate(src):  # keep a partial (redistribute only ever reduces one)
        if p[0] == "P" and draw(st.booleans()):
            dst[m] = p
    if draw(st.integers(0, 15)) == 5:  # now and then ask for a partial: an error
        dst[draw(st.integers(0, len(mesh) - 1))] = ("P", draw(st.sampled_from(P.REDUCE_OPS)))
    return shape, src, tuple(dst)


@pytest.mark.timeout(P.TIMEOUT_S)
@pytest.mark.parametrize("ws", P.WORLD_SIZES)
@given(data=st.data())
@P.examples(8)
def test_distribute_redistribute_from_local_round_trips(tmp_path_factory, ws, data):
    cases = data.draw(_batches(ws, _layout_case_args))
    prop = "layout: distribute/redistribute/from_local/full_tensor"
    _check_batch(tmp_path_factory, ws, _layout_batch, cases, prop)


# ------------------------------------------------------------------------ partial sources
def _partial_case(mesh, shape, pl, dst, seed):
    """Partial values (per-rank random integers along the partial mesh dims, one reduce op)
    reduce to the reduction of the pieces, through full_tensor and every redistribute."""
    from dtensor import DTensor

    ms, coord = tuple(mesh.shape), mesh.get_coordinate()
    pdims = [m for m, p in enumerate(pl) if p[0] == "P"]
    op = pl[pdims[0]][1]
    # one full-size contribution per cell of the partial mesh dims (same on replicas)
    cells = [()]
    for m in pdims:
        cells = [(*c, i) for c in cells for i in range(ms[m])]
    contrib = {c: _ints(shape, seed * 1000 + n) for n, c in enumerate(cells)}
    expected = P.reduce_stack(torch.stack([contrib[c] for c in cells]), op)
    mine = contrib[tuple(coord[m] for m in pdims)]
    local = P.oracle_local(mine, ms, coord, pl)
    dt = DTensor.from_local(local, mesh, P.to_placements(pl), shape=mine.shape)

    def close(got, want, what):
        assert got.shape == want.shape, (what, got.shape, want.shape)
        if op == "avg":  # one rounding division of an exact integer sum: a few ulps
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=what)
        else:
            assert torch.equal(got, want), (what, got, want)

    close(dt.full_tensor(), expected, "partial -> full_tensor")
    moved = dt.redistribute(placements=P.to_placements(dst))
    dstn = tuple(P.norm_dim(p, len(shape)) for p in dst)
    close(moved.to_local(), P.oracle_local(expected, ms, coord, dstn), "partial -> dst local")
    close(moved.full_tensor(), expected, "partial -> dst -> full_tensor")
    return "ok"


def _partial_batch(cases, report):
    _run_batch(_partial_case, cases, report, "partial")


@st.composite
def _partial_case_args(draw, mesh):
    shape = draw(P.tensor_shapes())
    op = draw(st.sampled_from(P.REDUCE_OPS))
    pl = list(draw(P.placements(len(mesh), len(shape), partial=False)))
    for m in draw(st.sets(st.integers(0, len(mesh) - 1), min_size=1)):
        pl[m] = ("P", op)
    dst = draw(P.placements(len(mesh), len(shape), partial=False))
    return shape, tuple(pl), dst, draw(st.integers(0, 10**6))


@pytest.mark.timeout(P.TIMEOUT_S)
@pytest.mark.parametrize("ws", P.WORLD_SIZES)
@given(data=st.data())
@P.examples(15)
def test_partial_of_every_reduce_op_reduces_exactly(tmp_path_factory, ws, data):
    cases = data.draw(_batches(ws, _partial_case_args))
    prop = "partial: Partial(sum/avg/max/min) -> full_tensor/redistribute"
    _check_batch(tmp_path_factory, ws, _partial_batch, cases, prop)


def test_partial_without_a_reduce_op_is_a_clear_error():
    """A reduction this library's collectives do not implement (bitwise ones, misspellings)
    is a ValueError naming the valid ones, when the Partial is built. ``"product"`` is one:
    PyTorch's ``Partial("product")`` reduces with c10d's PRODUCT, and so does ours
    (tests/test_torch_api_surface.py checks it against PyTorch's)."""
    from dtensor import Partial

    assert Partial("product").reduce_op == "product"
    for op in ("prod", "band", "SUM"):
        with pytest.raises(ValueError, match=r"Partial: reduce_op must be one of"):
            Partial(op)


# --------------------------------------------------------------------------- op rules
def _op_case(mesh, family, name, shapes, pls, seed, arg):
    """An op on DTensors equals the op on the full tensors, and the output's local piece is
    the oracle's piece of the full result under the output placements."""
    from dtensor import distribute_tensor

    ms, coord = tuple(mesh.shape), mesh.get_coordinate()
    fulls = [_ints(s, seed + i, -4, 5) for i, s in enumerate(shapes)]
    dts = [distribute_tensor(f, mesh, P.to_placements(pl)) for f, pl in zip(fulls, pls)]
    fn = _OPS[family][name]
    want = fn(*fulls, arg)
    out, err = _expect_error(lambda: fn(*dts, arg), None, f"{family}.{name}")
    if err:
        return err
    assert tuple(out.shape) == tuple(want.shape), ("shape", out.shape, want.shape)
    got = out.full_tensor()
    if name == "mean":  # an exact integer sum divided once (nan: the mean of nothing)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
    else:
        assert torch.equal(got, want), ("full_tensor", got, want)
    opl = tuple(
        ("S", p.dim) if p.is_shard() else ("P", p.reduce_op) if p.is_partial() else ("R",)
        for p in out.placements
    )
    piece = P.oracle_local(want, ms, coord, opl)
    if any(p[0] == "P" for p in opl):
        assert out.to_local().shape == piece.shape, ("local shape", out.to_local().shape)
    elif name == "mean":
        torch.testing.assert_close(out.to_local(), piece, rtol=1e-6, atol=1e-6, equal_nan=True)
    else:
        assert torch.equal(out.to_local(), piece), ("local", out.placements, out.to_local())
    return err or "ok"


def _reshape_target(shape, k):
    """A shape of the same numel: flattened, or the first dim split, or dims merged."""
    n = 1
    for s in shape:
        n *= s
    options = [(n,), (-1,)]
    if len(shape) >= 2:
        options.append((shape[0] * shape[1], *shape[2:]))
    if shape and shape[0] % 2 == 0 and shape[0]:
        options.append((2, shape[0] // 2, *shape[1:]))
    return options[k % len(options)]


_OPS = {
    "pointwise": {
        "add": lambda a, b, _: a + b,
        "sub": lambda a, b, _: a - b,
        "mul": lambda a, b, _: a * b,
        "scale": lambda a, _: a * 3 - a / 2,
        "neg_relu": lambda a, _: torch.relu(-a),
        "maximum": lambda a, b, _: torch.maximum(a, b),
    },
    "reduction": {
        "sum_all": lambda a, _: a.sum(),
        "sum": lambda a, d: a.sum(dim=d[0] % max(a.ndim, 1), keepdim=d[1]),
        "mean": lambda a, d: a.mean(dim=d[0] % max(a.ndim, 1), keepdim=d[1]),
        "amax": lambda a, d: a.amax(dim=d[0] % max(a.ndim, 1), keepdim=d[1]),
        "amin": lambda a, d: a.amin(dim=d[0] % max(a.ndim, 1), keepdim=d[1]),
    },
    "matmul": {
        "mm": lambda a, b, _: a @ b,
        "addmm": lambda c, a, b, _: torch.addmm(c, a, b),
        "bmm": lambda a, b, _: torch.bmm(a, b),
    },
    "views": {
        "transpose": lambda a, _: a.transpose(0, -1),
        "permute": lambda a, _: a.permute(*reversed(range(a.ndim))),
        "unsqueeze": lambda a, d: a.unsqueeze(d % (a.ndim + 1)),
        "reshape": lambda a, k: a.reshape(_reshape_target(tuple(a.shape), k)),
        "flatten_view": lambda a, _: a.contiguous().view(-1),
        "squeeze": lambda a, _: a.squeeze(),
    },
}


@st.composite
def _op_case_args(draw, mesh):
    family = draw(st.sampled_from(sorted(_OPS)))
    name = draw(st.sampled_from(sorted(_OPS[family])))
    dim = st.integers(1, 6)
    arg = None
    if family == "pointwise":
        shape = draw(P.tensor_shapes(min_ndim=1))
        n_in = 1 if name in ("scale", "neg_relu") else 2
        shapes = [shape] * n_in
        if n_in == 2 and draw(st.booleans()):  # broadcast the second operand
            shapes[1] = shape[draw(st.integers(0, len(shape))) :]
    elif family == "reduction":
        shapes = [draw(P.tensor_shapes(min_ndim=1))]
        arg = (draw(st.integers(-3, 2)), draw(st.booleans()))
        if name in ("amax", "amin"):  # a max over nothing has no value, in torch too
            shapes = [tuple(max(s, 1) for s in shapes[0])]
    elif family == "matmul":
        m, k, n = draw(dim), draw(dim), draw(dim)
        if name == "bmm":
            b = draw(dim)
            shapes = [(b, m, k), (b, k, n)]
        elif name == "addmm":
            shapes = [(m, n), (m, k), (k, n)]
        else:
            shapes = [(m, k), (k, n)]
    else:
        shapes = [draw(P.tensor_shapes(min_ndim=1))]
        arg = draw(st.integers(0, 5))
    pls = [draw(P.placements(len(mesh), len(s), partial=family != "views")) for s in shapes]
    # one reduce op per tensor (which op a mixed list means is a convention, not a property)
    pls = [_one_op(pl) for pl in pls]
    return (family, name, shapes, pls, draw(st.integers(0, 10**6)), arg)


def _one_op(pl):
    ops = [p[1] for p in pl if p[0] == "P"]
    return tuple(("P", ops[0]) if p[0] == "P" else p for p in pl)


def _op_batch(cases, report):
    _run_batch(_op_case, cases, report, "ops")


@pytest.mark.timeout(P.TIMEOUT_S)
@pytest.mark.parametrize("ws", P.WORLD_SIZES)
@given(data=st.data())
@P.examples(20)
def test_op_rules_match_the_plain_tensor_op(tmp_path_factory, ws, data):
    cases = data.draw(_batches(ws, _op_case_args))
    _check_batch(tmp_path_factory, ws, _op_batch, cases, "ops: pointwise/reduction/matmul/views")


# ------------------------------------------------------------------------- checkpoints
def _ckpt_save(entries, path, report):
    """Save one checkpoint of DTensors, each on its own mesh and placements (layout A)."""
    from device_mesh import init_device_mesh
    from dtensor import checkpoint as dcp
    from dtensor import distribute_tensor

    state = {}
    for i, (mesh_shape, shape, pl) in enumerate(entries):
        mesh = init_device_mesh("cpu", tuple(mesh_shape))
        state[f"t{i}"] = distribute_tensor(_ints(shape, 7 + i), mesh, P.to_placements(pl))
    try:
        dcp.save(state, checkpoint_id=path)
        outcome = "ok"
    except P.CLEAR_ERRORS as e:
        outcome = "error: " + P.check_clear(e)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, outcome)
    assert len(set(everyone)) == 1, f"ranks disagree on save: {everyone}"
    if dist.get_rank() == 0:
        with open(report, "w") as f:
            json.dump([outcome], f)


def _ckpt_load(entries, path, report):
    """Load it into other DTensors (layout B, maybe another world size): equal values."""
    from device_mesh import init_device_mesh
    from dtensor import checkpoint as dcp
    from dtensor import distribute_tensor

    state, meshes = {}, []
    for i, (mesh_shape, shape, pl) in enumerate(entries):
        mesh = init_device_mesh("cpu", tuple(mesh_shape))
        meshes.append(mesh)
        state[f"t{i}"] = distribute_tensor(torch.zeros(shape), mesh, P.to_placements(pl))
    dcp.load(state, checkpoint_id=path)
    for i, (mesh_shape, shape, pl) in enumerate(entries):
        full = _ints(shape, 7 + i)
        dt = state[f"t{i}"]
        pln = tuple(P.norm_dim(p, len(shape)) for p in pl)
        want = P.oracle_local(full, tuple(mesh_shape), meshes[i].get_coordinate(), pln)
        assert torch.equal(dt.to_local(), want), (f"t{i} local after load", dt.to_local(), want)
        assert torch.equal(dt.full_tensor(), full), f"t{i} full after load"
    if dist.get_rank() == 0:
        with open(report, "w") as f:
            json.dump(["ok"], f)


@st.composite
def _ckpt_example(draw, ws_a):
    ws_b = draw(st.sampled_from(P.WORLD_SIZES))
    a, b = [], []
    for _ in range(draw(st.integers(1, 4))):
        shape = draw(P.tensor_shapes())
        for ws, out, partial in ((ws_a, a, True), (ws_b, b, False)):
            mesh = draw(st.sampled_from(P.mesh_shapes(ws)))
            pl = draw(P.placements(len(mesh), len(shape), partial=partial))
            out.append((mesh, shape, _one_op(pl)))
    return ws_a, a, ws_b, b


@pytest.mark.timeout(P.TIMEOUT_S)
@pytest.mark.parametrize("ws_a", P.WORLD_SIZES)
@given(data=st.data())
@P.examples(10)
def test_checkpoint_save_under_one_layout_loads_under_another(tmp_path_factory, ws_a, data):
    _, a, ws_b, b = data.draw(_ckpt_example(ws_a))
    root = tmp_path_factory.mktemp("ckpt")
    path, report = str(root / "ckpt"), str(root / "outcomes.json")
    prop = "checkpoint: save layout A -> load layout B"
    run_on_ranks(ws_a, _ckpt_save, entries=a, path=path, report=report, timeout_s=BATCH_TIMEOUT_S)
    (outcome,) = _tally(prop, report, 1, ws_a)
    P.count(prop, f"loaded at ws {ws_b}")
    P.count(prop, f"tensors {len(a)}")
    if outcome != "ok":
        return
    os.remove(report)
    run_on_ranks(ws_b, _ckpt_load, entries=b, path=path, report=report, timeout_s=BATCH_TIMEOUT_S)
    with open(report) as f:
        assert json.load(f) == ["ok"]
