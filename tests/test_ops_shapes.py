"""Shape ops on DTensors (dtensor/_ops/shape_ops.py, views.py): the parts of their rules the
OpInfo coverage run does not reach - tril/triu's per-block diagonal at every offset over
uneven and empty blocks, rot90 moving a shard to the other dim, partial inputs."""

import torch
import torch.nn.functional as F

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks

aten = torch.ops.aten


def _close(dt, ref):
    torch.testing.assert_close(dt.full_tensor(), ref, rtol=1e-5, atol=1e-5)


def _check_shape_ops():
    torch.manual_seed(0)
    mesh2 = init_device_mesh("cpu", (2, 2))
    # tril/triu keep every shard: each block is cut along the diagonal shifted by its offsets
    # (5 rows and 7 columns split unevenly; 3 rows over 4 ranks leave an empty block)
    x = torch.randn(2, 5, 7)
    for pl in (
        (Shard(1), Shard(2)),
        (Shard(2), Shard(1)),
        (Shard(1), Shard(1)),
        (Replicate(), Shard(2)),
    ):
        dx = distribute_tensor(x, mesh2, pl)
        for k in (-5, -1, 0, 2, 6):
            with CommDebugMode() as comm:
                lo, up = torch.tril(dx, k), torch.triu(dx, diagonal=k)
            assert comm.get_total_counts() == 0 and lo.placements == pl, (pl, k)
            _close(lo, torch.tril(x, k))
            _close(up, torch.triu(x, k))
    mesh1 = init_device_mesh("cpu", (4,))
    y = torch.randn(3, 6)
    for pl in ((Shard(0),), (Shard(1),)):
        _close(torch.tril(distribute_tensor(y, mesh1, pl), 1), torch.tril(y, 1))

    # rot90 by 1 (3) turns a shard of the first (second) rotated dim into one of the other
    # without communication; a flipped dim is gathered
    z = torch.randn(3, 5, 4)
    for k in range(-1, 5):
        for d in range(3):
            dz = distribute_tensor(z, mesh1, [Shard(d)])
            with CommDebugMode() as comm:
                r = torch.rot90(dz, k, (0, 1))
            _close(r, torch.rot90(z, k, (0, 1)))
            moved = {0: {0: 0, 1: 1, 2: 2}, 1: {0: 1, 2: 2}, 2: {2: 2}, 3: {1: 0, 2: 2}}[k % 4]
            if d in moved:
                assert comm.get_total_counts() == 0 and r.placements == (Shard(moved[d]),)

    # partials: moving elements and filling zeros commute with the reduction; padding with
    # another value does not, so that partial is reduced first
    local = torch.arange(12.0).reshape(3, 4) * (mesh1.get_local_rank() + 1)
    p = DTensor.from_local(local, mesh1, [Partial()])
    full = torch.arange(12.0).reshape(3, 4) * 10
    with CommDebugMode() as comm:
        kept = [
            (torch.flip(p, (0,)), torch.flip(full, (0,))),
            (torch.roll(p, 1, 1), torch.roll(full, 1, 1)),
            (torch.triu(p, 1), torch.triu(full, 1)),
            (torch.diag_embed(p), torch.diag_embed(full)),
            (F.pad(p, (1, 2)), F.pad(full, (1, 2))),
            (p.repeat(2, 1, 1), full.repeat(2, 1, 1)),
            (
                aten.slice_backward(p, [3, 9], 1, 2, 6, 1),
                aten.slice_backward(full, [3, 9], 1, 2, 6, 1),
            ),
            (aten.select_backward(p, [3, 2, 4], 1, 1), aten.select_backward(full, [3, 2, 4], 1, 1)),
        ]
    assert comm.get_total_counts() == 0
    for got, want in kept:
        assert got.placements == (Partial(),)
        _close(got, want)
    padded = F.pad(p, (1, 0), value=1.0)
    assert not any(isinstance(q, Partial) for q in padded.placements)
    _close(padded, F.pad(full, (1, 0), value=1.0))


def test_shape_ops_shards_and_partials():
    run_on_ranks(4, _check_shape_ops)
