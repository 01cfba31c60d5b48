"""Pure placement, chunk and planning maths: no process group."""

import itertools

import pytest
import torch

from dtensor._ops.views import reshape_groups, view_placements
from dtensor._redistribute import plan_redistribute
from dtensor.placement import (
    NormPartial,
    Partial,
    Replicate,
    Shard,
    chunk_offsets,
    chunk_sizes,
    local_shape_and_offset,
    normalize_placements,
    padded_chunk_size,
)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 7, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunk_sizes_follow_torch_chunk(size, n):
    pieces = torch.arange(size).chunk(n) if size else ()
    expected = [len(p) for p in pieces] + [0] * (n - len(pieces))
    assert chunk_sizes(size, n) == expected
    starts = chunk_offsets(size, n)
    for p, s in zip(pieces, starts):
        assert int(p[0]) == s
    assert padded_chunk_size(size, n) == max(expected)


def test_nested_local_shape_and_offset():
    # (7, 5) over a (2, 2) mesh, both mesh dims on tensor dim 0: 4 + 3 rows, then 2+2, 2+1
    got = {
        c: local_shape_and_offset((7, 5), (2, 2), c, (Shard(0), Shard(0)))
        for c in itertools.product(range(2), range(2))
    }
    assert got == {
        (0, 0): ((2, 5), (0, 0)),
        (0, 1): ((2, 5), (2, 0)),
        (1, 0): ((2, 5), (4, 0)),
        (1, 1): ((1, 5), (6, 0)),
    }


def test_str_forms_and_equality():
    assert [str(p) for p in (Shard(0), Replicate(), Partial(), Partial("max"))] == [
        "S(0)",
        "R",
        "P(sum)",
        "P(max)",
    ]
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and Partial() != Partial("avg")
    assert str(NormPartial(2)) == "P(norm2)" and NormPartial(2) != Partial()
    assert len({Shard(0), Shard(0), Replicate(), Replicate()}) == 2


def test_placement_errors():
    with pytest.raises(TypeError, match=r"got the class Shard. Write Shard\(\)"):
        normalize_placements([Shard], 1, 2, api="distribute_tensor")
    with pytest.raises(TypeError, match="got the class Replicate"):
        normalize_placements([Replicate], 1, 2, api="distribute_tensor")
    with pytest.raises(
        ValueError, match=r"Shard\(dim=2\) is out of range for a tensor with 2 dims"
    ):
        normalize_placements([Shard(2)], 1, 2, api="distribute_tensor")
    with pytest.raises(ValueError, match=r"one entry per mesh dim \(2\), got 1"):
        normalize_placements([Shard(0)], 2, 2, api="distribute_tensor")
    with pytest.raises(ValueError, match="reduce_op must be one of"):
        Partial("prod")
    assert normalize_placements([Shard(-1)], 1, 3, api="x") == (Shard(2),)


def _kinds(src, dst):
    return [s.kind for s in plan_redistribute(src, dst)]


def test_plans():
    S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()
    assert _kinds((S0,), (R,)) == ["all_gather"]
    assert _kinds((P,), (R,)) == ["all_reduce"]
    assert _kinds((P,), (S0,)) == ["reduce_scatter"]
    assert _kinds((R,), (S0,)) == ["slice"]
    assert _kinds((S0,), (S1,)) == ["all_to_all"]
    assert _kinds((R,), (P,)) == ["to_partial"]
    # swapping which mesh dim shards which tensor dim: each mesh dim is gathered, then each
    # re-sharded by a local slice (tensor dim 0's target shard first)
    steps = plan_redistribute((S0, S1), (S1, S0))
    assert [(s.kind, s.mesh_dim, s.dst) for s in steps] == [
        ("all_gather", 0, R),
        ("all_gather", 1, R),
        ("slice", 1, S0),
        ("slice", 0, S1),
    ]
    # nested shards of one tensor dim are gathered innermost first
    assert [(s.kind, s.mesh_dim) for s in plan_redistribute((S0, S0), (R, R))] == [
        ("all_gather", 1),
        ("all_gather", 0),
    ]
    assert _kinds((S0, P), (S0, R)) == ["all_reduce"]
    assert _kinds((S0, S1), (S0, S1)) == []


def test_reshape_groups_and_view_placements():
    assert reshape_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
    assert reshape_groups((6, 4), (2, 3, 4)) == [([0], [0, 1]), ([1], [2])]
    assert reshape_groups((2, 1, 3), (6,)) == [([0, 1, 2], [0])]
    assert reshape_groups((1, 4), (1, 2, 2)) == [([0], [0]), ([1], [1, 2])]
    # (B, T, C) -> (B*T, C) sharded on B: fine when B divides, gathered when not
    assert view_placements((4, 3, 5), (12, 5), (Shard(0),), (2,)) == ((Shard(0),), (Shard(0),))
    assert view_placements((3, 2, 5), (6, 5), (Shard(0),), (2,)) == ((Replicate(),), (Replicate(),))
    # splitting the last dim into heads keeps a shard on the heads
    assert view_placements((2, 8), (2, 4, 2), (Shard(1),), (2,)) == ((Shard(1),), (Shard(1),))
    assert view_placements((2, 8), (2, 4, 2), (Shard(0),), (2,)) == ((Shard(0),), (Shard(0),))


# --------------------------------------------------------------------- PyTorch's placements
def test_pytorch_placements_compare_equal_to_ours_in_either_order():
    import torch.distributed.tensor as tdt
    from torch.distributed.tensor.placement_types import _StridedShard as TorchStrided

    from dtensor.placement import _StridedShard

    class SubReplicate(tdt.Replicate):  # a library's own subclass of PyTorch's type
        pass

    pairs = [
        (Replicate(), tdt.Replicate()),
        (Replicate(), SubReplicate()),
        (Shard(1), tdt.Shard(1)),
        (Shard(-1), tdt.Shard(-1)),
        (Partial(), tdt.Partial()),
        (Partial("avg"), tdt.Partial("avg")),
        (_StridedShard(0, 2), TorchStrided(0, split_factor=2)),
    ]
    for ours, theirs in pairs:
        assert ours == theirs and not ours != theirs, (ours, theirs)
        assert hash(ours) == hash(theirs), (ours, theirs)  # equal things hash alike
        if not isinstance(theirs, TorchStrided):  # its own __eq__ answers False, not ours
            assert theirs == ours and not theirs != ours, (theirs, ours)
        assert (ours,) == (theirs,) and (theirs,) in {(ours,)}
    unequal = [
        (Replicate(), tdt.Shard(0)),
        (Shard(0), tdt.Shard(1)),
        (Shard(0), tdt.Replicate()),
        (Shard(0), TorchStrided(0, split_factor=2)),
        (_StridedShard(0, 2), tdt.Shard(0)),
        (Partial("sum"), tdt.Partial("max")),
        (Partial(), tdt.Replicate()),
        (NormPartial(2), tdt.Partial()),
    ]
    for ours, theirs in unequal:
        assert ours != theirs and theirs != ours and not ours == theirs, (ours, theirs)
    # the message torchtitan printed, "(Replicate(),) ... expects (Replicate(),)", came from
    # exactly this comparison
    assert (Replicate(),) == (tdt.Replicate(),)


def test_pytorch_placements_are_instances_of_ours_and_convert():
    import torch.distributed.tensor as tdt
    from torch.distributed.tensor._ops._math_ops import _NormPartial
    from torch.distributed.tensor.placement_types import _MaskPartial
    from torch.distributed.tensor.placement_types import _StridedShard as TorchStrided

    from dtensor.placement import Placement, _StridedShard, from_torch_placement

    # code written for PyTorch's types (torchtitan normalizes Shard dims after an isinstance
    # check) works with ours swapped in for them
    assert isinstance(tdt.Shard(-1), Shard) and isinstance(tdt.Replicate(), Replicate)
    assert isinstance(tdt.Partial("max"), Partial) and isinstance(tdt.Shard(0), Placement)
    assert isinstance(TorchStrided(0, split_factor=2), _StridedShard)
    assert not isinstance(TorchStrided(0, split_factor=2), Shard)  # as in PyTorch
    assert not isinstance(tdt.Shard(0), _StridedShard) and not isinstance(tdt.Shard(0), Replicate)
    assert not isinstance(Replicate(), Shard) and not isinstance(3, Shard)
    got = [
        from_torch_placement(p)
        for p in (
            tdt.Shard(1),
            TorchStrided(1, split_factor=3),
            tdt.Replicate(),
            tdt.Partial("min"),
        )
    ]
    assert [type(p) for p in got] == [Shard, _StridedShard, Replicate, Partial]
    assert got == [Shard(1), _StridedShard(1, 3), Replicate(), Partial("min")]
    assert from_torch_placement(_NormPartial(3)) == NormPartial(3)
    # a masked partial has no equivalent here: not converted, refused by name
    masked = _MaskPartial()
    assert from_torch_placement(masked) is masked and Partial() != masked
    with pytest.raises(TypeError, match=r"placement_types\._MaskPartial"):
        normalize_placements([masked], 1, 2, api="x")


# --------------------------------------------------------------------------- dtensor.comm
def test_reduction_of_every_partial():
    from dtensor.comm import Reduction, reduction_of

    inf = float("inf")
    assert reduction_of(Partial("sum"), 4) == Reduction("sum")
    assert reduction_of(Partial("avg"), 4) == Reduction("sum", divide_by=4.0)
    assert reduction_of(Partial("max"), 4) == Reduction("max")
    assert reduction_of(Partial("min"), 4) == Reduction("min")
    assert reduction_of(NormPartial(inf), 4) == Reduction("max")
    assert reduction_of(NormPartial(-inf), 4) == Reduction("min")
    assert reduction_of(NormPartial(0), 4) == Reduction("sum")
    r = reduction_of(NormPartial(3.0), 4)
    assert r == Reduction("sum", power=3.0)
    # what two ranks' partial 3-norms reduce to: (a^3 + b^3)^(1/3)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 0.5])
    got = r.after(r.before(a) + r.before(b))
    torch.testing.assert_close(got, torch.stack([a, b]).norm(p=3, dim=0))
    avg = reduction_of(Partial("avg"), 2)
    torch.testing.assert_close(avg.after(torch.tensor([4.0])), torch.tensor([2.0]))
    torch.testing.assert_close(avg.after(torch.tensor([4.0]), divide=False), torch.tensor([4.0]))


def test_message_tag_ranges_are_disjoint_and_bounded():
    import fsdp2  # noqa: F401  (reserves its ranges)
    from dtensor import comm

    names = ["dtensor.redistribute", "fsdp2.all_gather", "fsdp2.reduce_scatter"]
    ranges = [comm.message_tags(name) for name in names]
    spans = sorted((t.first, t.first + len(t)) for t in ranges)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert 0 <= spans[0][0] and spans[-1][1] <= comm.TAG_SPACE
    assert [len(t) for t in ranges] == [1, 1 << 24, 1 << 24]
    tags = comm.message_tags("dtensor.redistribute")
    assert tags[0] == tags.first
    with pytest.raises(IndexError, match="outside 'dtensor.redistribute'"):
        tags[1]
    with pytest.raises(KeyError, match="no message tags are reserved for 'mine'.*reserve_message"):
        comm.message_tags("mine")


def test_message_tags_are_handed_out_by_name_not_by_order(monkeypatch):
    """A range depends on its name and count alone ([Note: message tags]): reserved in any
    order, or with other names reserved or not, every rank gets the same ranges; the same
    name and count again is the same range, another count or an overlap is refused."""
    from dtensor import comm

    wanted = [("test.a", 3), ("test.b", 1 << 20), ("test.c", 1), ("test.d", 1000)]
    results = []
    for order in (wanted, wanted[::-1], wanted[1::2]):
        monkeypatch.setattr(comm, "_RESERVED", {})  # a fresh process
        results.append({n: comm.reserve_message_tags(n, k) for n, k in order})
    assert all(results[0][n] == got for r in results[1:] for n, got in r.items())
    for tags in results[0].values():
        block = 1 << (len(tags) - 1).bit_length()
        assert tags.first % block == 0 and tags.first + len(tags) <= comm.TAG_SPACE
    # idempotent (a module reloaded), on the reservations of this process
    monkeypatch.setattr(comm, "_RESERVED", dict(comm._RESERVED))
    again = comm.reserve_message_tags("test.a", 3)
    assert again == results[0]["test.a"] and comm.message_tags("test.a") == again
    with pytest.raises(ValueError, match="'test.a' is already reserved with 3 tags"):
        comm.reserve_message_tags("test.a", 4)
    for bad in (0, -1, 1.5, True, comm.TAG_SPACE):
        with pytest.raises(ValueError, match="count must be an int from 1"):
            comm.reserve_message_tags("test.bad", bad)
    # two names whose ranges meet: the second is refused, naming the first
    monkeypatch.setattr(comm, "_RESERVED", {})
    half = comm.TAG_SPACE // 2  # two blocks of this size: some name lands on test.big's
    big = comm.reserve_message_tags("test.big", half)
    other = next(f"t.{i}" for i in range(64) if comm._placed(f"t.{i}", half).first == big.first)
    with pytest.raises(ValueError, match="overlap 'test.big'.*rename one"):
        comm.reserve_message_tags(other, half)
    assert other not in comm._RESERVED


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize(
    "shape,a,b", [((7, 5), 0, 1), ((5, 7), 1, 0), ((2, 5, 3), 0, 2), ((7, 3, 2), 2, 1)]
)
def test_padded_all_to_all_pack_and_unpack_move_the_shards(k, shape, a, b):
    """The padded all-to-all (NCCL's wire form, no longer used on gloo): k ranks' send
    buffers, exchanged by hand, unpack to each rank's Shard(b) piece."""
    from dtensor._collectives import _all_to_all_send, _all_to_all_unpack

    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))

    def piece(dim, r):
        return full.narrow(dim, chunk_offsets(shape[dim], k)[r], chunk_sizes(shape[dim], k)[r])

    sends = [_all_to_all_send(piece(a, r), k, a, b, shape[a], shape[b]) for r in range(k)]
    for r in range(k):
        recv = torch.cat([s.chunk(k)[r] for s in sends])  # rank i's block r, in rank order
        got = _all_to_all_unpack(recv, k, r, a, b, shape[a], shape[b])
        assert torch.equal(got, piece(b, r)), (r, got.shape)
