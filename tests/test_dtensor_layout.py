"""Layouts and redistribution against torch.distributed.tensor (the oracle)."""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks

SHAPES = [(7, 5), (3, 4), (1,), (5, 3, 2)]
MESHES = [(2, (2,)), (3, (3,)), (4, (4,)), (4, (2, 2))]


def _to_torch(p):
    if isinstance(p, Shard):
        return tdt.Shard(p.dim)
    if isinstance(p, Partial):
        return tdt.Partial(p.reduce_op)
    return tdt.Replicate()


def _all_placements(ndim, mesh_ndim, partial=False):
    options = [Replicate()] + [Shard(d) for d in range(ndim)]
    if partial:
        options.append(Partial())
    return list(itertools.product(options, repeat=mesh_ndim))


def _check_layouts(mesh_shape, shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    tmesh = torch_init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    full = torch.randn(shape)
    layouts = _all_placements(len(shape), len(mesh_shape))
    oracle = {}
    for pl in layouts:
        dt = distribute_tensor(full, mesh, pl)
        ref = tdt.distribute_tensor(full, tmesh, [_to_torch(p) for p in pl])
        oracle[pl] = ref.to_local()
        assert torch.equal(dt.to_local(), ref.to_local()), (pl, dt.to_local(), ref.to_local())
        assert dt.shape == full.shape and dt.placements == pl
        assert torch.equal(dt.full_tensor(), full), pl
    for src, dst in itertools.product(layouts, layouts):
        dt = distribute_tensor(full, mesh, src)
        moved = dt.redistribute(placements=dst)
        assert torch.equal(moved.to_local(), oracle[dst]), (src, dst)
        back = moved.redistribute(placements=src)
        assert torch.equal(back.to_local(), oracle[src]), (src, dst, "round trip")


@pytest.mark.parametrize("world,mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_layout_and_transition_matches_torch(world, mesh_shape, shape):
    run_on_ranks(world, _check_layouts, mesh_shape=mesh_shape, shape=shape)


def _check_partial_sources(mesh_shape, shape, op):
    mesh = init_device_mesh("cpu", mesh_shape)
    tmesh = torch_init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(dist.get_rank())
    local = torch.randn(shape)
    for pl in _all_placements(len(shape), len(mesh_shape), partial=True):
        if not any(isinstance(p, Partial) for p in pl):
            continue
        pl = tuple(Partial(op) if isinstance(p, Partial) else p for p in pl)
        # build the same partial tensor in both libraries from each rank's full-size piece
        tpl = [_to_torch(p) for p in pl]
        rep = [Replicate() if isinstance(p, Partial) else p for p in pl]
        tref = tdt.DTensor.from_local(
            local,
            tmesh,
            [tdt.Partial(op) if isinstance(p, Partial) else tdt.Replicate() for p in pl],
            run_check=False,
        )
        tref = tref.redistribute(tmesh, tpl)
        ours = DTensor.from_local(tref.to_local(), mesh, pl, shape=shape)
        want = tref.redistribute(tmesh, [_to_torch(p) for p in rep]).to_local()
        got = ours.redistribute(placements=rep).to_local()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.allclose(ours.full_tensor(), tref.full_tensor(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize(
    "world,mesh_shape,shape",
    [(3, (3,), (7, 5)), (4, (4,), (3, 4)), (4, (2, 2), (5, 3, 2))],
    ids=str,
)
def test_partial_reductions_match_torch(world, mesh_shape, shape, op):
    run_on_ranks(world, _check_partial_sources, mesh_shape=mesh_shape, shape=shape, op=op)


@pytest.mark.parametrize("world,mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_partial_sources_on_every_mesh_and_shape(world, mesh_shape, shape):
    run_on_ranks(world, _check_partial_sources, mesh_shape=mesh_shape, shape=shape, op="sum")


def _check_uneven_from_local_and_async():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(21.0).view(7, 3)
    local = full.chunk(dist.get_world_size())[dist.get_rank()] if dist.get_rank() < 4 else None
    dt = DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 3), run_check=True)
    assert torch.equal(dt.full_tensor(), full)
    with pytest.raises(
        ValueError,
        match=r"local shapes do not fit shape=\(8, 3\).*rank 2: local \(1, 3\), expected \(2, 3\)",
    ):
        DTensor.from_local(local, mesh, [Shard(0)], shape=(8, 3), run_check=True)
    # async redistribute returns a result whose data arrives on first use
    with CommDebugMode() as comm:
        fut = dt.redistribute(placements=[Replicate()], async_op=True)
        assert fut._pending is not None
    assert comm.get_comm_counts() == {"all_gather": 1}
    assert torch.equal(fut.to_local(), full)
    assert fut._pending is None
    # replicas are made equal by run_check: rank 0's data wins
    mine = torch.full((2,), float(dist.get_rank()))
    rep = DTensor.from_local(mine, mesh, [Replicate()], run_check=True)
    assert torch.equal(rep.to_local(), torch.zeros(2))


def test_uneven_from_local_run_check_and_async():
    run_on_ranks(3, _check_uneven_from_local_and_async)


def _check_run_check_on_part_of_the_world():
    """``from_local(run_check=True)`` checks over the mesh's own groups: on a mesh of ranks 0
    and 1 it returns while ranks 2 and 3 do something else (it all-gathered pickled shapes
    over the whole world, and hung); on a 2-D mesh every rank names the one that is off."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    rank = dist.get_rank()
    if rank < 2:  # mesh["b"] of ranks 0 and 1; ranks 2 and 3 take no part
        sub = mesh["b"]
        dt = DTensor.from_local(torch.full((2, 3), float(rank)), sub, [Shard(0)], run_check=True)
        assert dt.shape == (4, 3) and torch.equal(dt.to_local(), torch.full((2, 3), float(rank)))
    dist.barrier()
    local = torch.zeros(2, 4 if rank == 3 else 3)  # rank 3's piece is off
    with pytest.raises(ValueError, match=r"rank 3: local \(2, 4\), expected \(2, 3\)"):
        DTensor.from_local(local, mesh, [Shard(0), Shard(1)], shape=(4, 6), run_check=True)
    mine = torch.zeros(12) if rank == 1 else torch.zeros(2, 6)  # rank 1's has one dim
    with pytest.raises(ValueError, match=r"rank 1: local of 1 dims, expected \(2, 6\)"):
        DTensor.from_local(mine, mesh, [Shard(0), Replicate()], shape=(4, 6), run_check=True)


def test_from_local_run_check_stays_on_its_mesh():
    run_on_ranks(4, _check_run_check_on_part_of_the_world)


def _check_src_data_rank():
    mesh = init_device_mesh("cpu", (2, 2))
    mine = torch.full((5, 3), float(dist.get_rank()))
    for pl in [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(0))]:
        dt = distribute_tensor(mine, mesh, pl, src_data_rank=0)
        assert torch.equal(dt.full_tensor(), torch.zeros(5, 3)), pl
        dt1 = distribute_tensor(mine, mesh, pl, src_data_rank=1)
        assert torch.equal(dt1.full_tensor(), torch.full((5, 3), 3.0)), pl
    local_only = distribute_tensor(mine, mesh, [Shard(0), Replicate()], src_data_rank=None)
    expected = mine.chunk(2)[mesh.get_local_rank(0)]
    assert torch.equal(local_only.to_local(), expected)


def test_distribute_tensor_src_data_rank():
    run_on_ranks(4, _check_src_data_rank)


def _check_redistribute_errors():
    mesh = init_device_mesh("cpu", (2,))
    dt = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"cannot redistribute mesh dim 0 from S\(0\) to P\(sum\)"):
        dt.redistribute(placements=[Partial()])
    with pytest.raises(TypeError, match="got the class Shard"):
        dt.redistribute(placements=[Shard])
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        distribute_tensor(torch.randn(4), mesh, [Shard(0), Shard(0)])
    with pytest.raises(ValueError, match=r"Shard\(dim=3\) is out of range"):
        distribute_tensor(torch.randn(4), mesh, [Shard(3)])
    with pytest.raises(ValueError, match="device_mesh is required"):
        distribute_tensor(torch.randn(4), None, [Shard(0)])


def test_redistribute_errors():
    run_on_ranks(2, _check_redistribute_errors)


# ------------------------------------------------------------- all-to-all on gloo: the bytes
# (global shape, from dim, to dim): uneven dims; (2, 5) and (5, 2) leave a rank without
# rows (3 ranks), (5, 3, 2) moves to and from an inner dim (received into buffers, then cat)
_A2A_CASES = [((7, 5), 0, 1), ((7, 5), 1, 0), ((2, 5), 0, 1), ((5, 2), 0, 1), ((5, 3, 2), 2, 0)]


def _check_all_to_all_sends_each_element_once():
    from dtensor import _collectives as E
    from dtensor.placement import chunk_offsets, chunk_sizes

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    k, r = mesh.size(), mesh.get_local_rank()
    sent: list[tuple[int, int]] = []  # (peer, bytes) of each message this rank posts
    real = E._exchange

    def spy(group, idx, n, send_to, recv_from):
        for step in range(1, n):
            block = send_to((idx + step) % n)
            if block.numel():
                assert block.is_contiguous()
                sent.append(((idx + step) % n, block.numel() * block.element_size()))
        return real(group, idx, n, send_to, recv_from)

    E._exchange = spy  # the worker processes are reused: put it back below
    try:
        for shape, a, b in _A2A_CASES:
            torch.manual_seed(1)
            full = torch.randn(shape)
            dt = distribute_tensor(full, mesh, [Shard(a)])
            want = full.narrow(b, chunk_offsets(shape[b], k)[r], chunk_sizes(shape[b], k)[r])
            sent.clear()
            for async_op in (False, True):
                with CommDebugMode() as comm:
                    moved = dt.redistribute(placements=[Shard(b)], async_op=async_op)
                assert comm.get_comm_counts() == {"all_to_all": 1}
                assert torch.equal(moved.to_local(), want), (shape, a, b, async_op)
            # each peer j gets block (r, j) once per call, unpadded; empty blocks are not sent
            rest = full.numel() // (shape[a] * shape[b])
            rows, cols = chunk_sizes(shape[a], k), chunk_sizes(shape[b], k)
            ideal = [(j, rows[r] * cols[j] * rest * 4) for j in range(k) if j != r]
            ideal = [(j, n) for j, n in ideal if n]
            assert sorted(sent) == sorted(ideal * 2), (shape, a, b, sent, ideal)
    finally:
        E._exchange = real


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_sends_each_element_once(world):
    """Shard(a) -> Shard(b) on gloo: one message per peer with a non-empty block, carrying
    exactly that block (no padding), for uneven shapes and empty shards."""
    run_on_ranks(world, _check_all_to_all_sends_each_element_once)


# ------------------------------------------------ large all-reduce on gloo: blocks, same bits
def _check_block_all_reduce():
    from dtensor import _collectives as E

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    k, r = mesh.size(), mesh.get_local_rank()
    shape = (1025, 1024)  # 4.0 MiB + 4 KiB of fp32: uneven over 3 ranks
    assert 1025 * 1024 * 4 >= E.ALL_REDUCE_BLOCKS_MIN_BYTES > 1025 * 1024 * 4 // 2
    locals_ = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(k)]
    in_order = locals_[0].clone()
    for t in locals_[1:]:
        in_order += t  # every element summed in rank order, as the blocks are
    for op, want in (("sum", in_order), ("avg", in_order / k)):
        for async_op in (False, True):
            dt = DTensor.from_local(locals_[r], mesh, [Partial(op)])
            with CommDebugMode() as comm:
                got = dt.redistribute(placements=[Replicate()], async_op=async_op).to_local()
            assert comm.get_comm_counts() == {"all_reduce": 1}
            assert torch.equal(got, want), (op, async_op)  # the same bits on every rank
    # half the size (and booleans, max): gloo's all-reduce, still right
    half = DTensor.from_local(locals_[r][:512], mesh, [Partial()])
    torch.testing.assert_close(
        half.redistribute(placements=[Replicate()]).to_local(), in_order[:512]
    )
    big = DTensor.from_local(locals_[r], mesh, [Partial("max")])
    want_max = torch.stack(locals_).amax(0)
    assert torch.equal(big.redistribute(placements=[Replicate()]).to_local(), want_max)


@pytest.mark.parametrize("world", [3, 4])
def test_large_sum_all_reduce_by_blocks_gives_every_rank_the_same_bits(world):
    """At 3 and 4 ranks a 4 MiB sum / average all-reduce goes by blocks: every element summed
    in rank order (gloo's ring adds in another order, so other bits)."""
    run_on_ranks(world, _check_block_all_reduce)
