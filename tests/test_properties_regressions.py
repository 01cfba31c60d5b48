"""Plain regression tests for the bugs the property-based tests (tests/test_properties_*.py)
found; each names the property and the minimal case hypothesis shrank it to."""

from __future__ import annotations

import torch

from tests.harness import run_on_ranks


def _check_squeeze_keeps_uneven_shards():
    from device_mesh import init_device_mesh
    from dtensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (3,))
    for shape in [(7,), (7, 1), (1, 7), (5, 1, 2)]:
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        dim = shape.index(max(shape))
        dt = distribute_tensor(full, mesh, [Shard(dim)])  # 7 rows over 3: 3, 3, 1
        for args in ((), (dim,), (-1,)):
            out, want = dt.squeeze(*args), full.squeeze(*args)
            assert out.shape == want.shape and out.to_local().ndim == want.ndim, (shape, out)
            assert torch.equal(out.full_tensor(), want), shape


def test_squeeze_does_not_squeeze_a_shard_of_local_size_one():
    """Found by test_op_rules_match_the_plain_tensor_op: ``squeeze()`` of a (7,) tensor
    sharded over 3 ranks squeezed the last rank's (1,) shard to a 0-dim tensor (a wrong
    local shape, then an IndexError in full_tensor's all-gather)."""
    run_on_ranks(3, _check_squeeze_keeps_uneven_shards)


def _check_same_placements_of_empty_tensors():
    from device_mesh import init_device_mesh
    from dtensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    for shape, pl in [((0, 3), [Shard(1)]), ((4, 0), [Shard(0)]), ((0, 0), [Shard(1)])]:
        dt = distribute_tensor(torch.zeros(shape, requires_grad=True), mesh, pl)
        same = dt.redistribute(placements=pl)
        assert same.placements == tuple(pl), (shape, same.placements)
        assert same.to_local().shape == dt.to_local().shape
        same.sum().backward()
        assert dt.grad is not None and dt.grad.placements == tuple(pl)
        again = dt.redistribute(placements=[Replicate()]).redistribute(placements=pl)
        assert again.placements == tuple(pl) and again.shape == torch.Size(shape)
        view = dt.view(shape)
        assert view.placements == tuple(pl), (shape, view.placements)


def test_redistribute_to_the_same_placements_keeps_them_for_empty_tensors():
    """Found by test_distribute_redistribute_from_local_round_trips: ``redistribute`` to the
    placements a zero-element tensor already had returned it Replicate (autograd aliased the
    input through ``view``, whose rule gathered every dim of a zero-element shape)."""
    run_on_ranks(2, _check_same_placements_of_empty_tensors)


def test_zero_element_views_pair_equal_dims():
    from dtensor import Shard
    from dtensor._ops.views import reshape_groups, view_placements

    assert reshape_groups((4, 0), (4, 0)) == [([0], [0]), ([1], [1])]
    assert reshape_groups((0, 6), (0, 2, 3)) == [([0], [0]), ([1], [1, 2])]
    assert reshape_groups((3, 0, 2), (0, 2)) == [([0], []), ([1], [0]), ([2], [1])]
    assert view_placements((4, 0), (4, 0), (Shard(0),), (2,)) == ((Shard(0),), (Shard(0),))
