"""fsdp2's point-to-point collectives on gloo, against dense references.

Shapes are awkward on purpose: at 3 ranks a 4-row parameter splits 2/2/0 (the last rank
holds nothing) and a 7-row one 3/3/1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from device_mesh import init_device_mesh
from dtensor.placement import chunk_sizes, padded_chunk_size
from fsdp2 import _collectives as C
from tests.harness import run_on_ranks

ROWS, WIDTH = (4, 7, 1), 5


def _full(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


def _geometry(rows: int, k: int):
    pad = padded_chunk_size(rows, k)
    return pad * WIDTH, [n * WIDTH for n in chunk_sizes(rows, k)]


def _gather():
    group, me, k = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    pieces, fulls = [], []
    for i, rows in enumerate(ROWS):
        full = _full(i, rows)
        padded, counts = _geometry(rows, k)
        send = full.view(-1)[me * padded : me * padded + counts[me]].clone()
        blocks = torch.full((k, padded), float("nan"))
        blocks[me, : counts[me]] = send
        pieces.append((send, blocks, counts))
        fulls.append(full)
    mesh = init_device_mesh("cpu", (k,))
    C.gather_blocks(pieces, group, me, row_bytes=0, label=0, mesh=mesh).wait()
    for full, (_, blocks, _) in zip(fulls, pieces, strict=True):
        torch.testing.assert_close(blocks.view(-1)[: full.numel()], full.view(-1), rtol=0, atol=0)


def test_gather_blocks_uneven_and_empty_shards():
    run_on_ranks(3, _gather)


def _reduce():
    group, me, k = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    pieces, slot, expected, present = [], 0, [], []
    for i, rows in enumerate(ROWS):
        padded, counts = _geometry(rows, k)
        # rank 1 has no gradient for the second parameter: it sends zeros and a 0 flag
        has = not (i == 1 and me == 1)
        grad = _full(100 * i + me, rows).view(-1) if has else torch.zeros(rows * WIDTH)
        pieces.append((grad, padded, counts, slot))
        total = sum(_full(100 * i + r, rows).view(-1) for r in range(k) if not (i == 1 and r == 1))
        expected.append((slot, padded, (total / k)[me * padded : me * padded + counts[me]]))
        present.append(float(has))
        slot += padded
    flags = torch.tensor(present)
    row = C.reduce_blocks(
        pieces,
        flags,
        group,
        me,
        width=slot + len(ROWS),
        divide_by=float(k),
        label=0,
        mesh=init_device_mesh("cpu", (k,)),
    ).wait()
    n_values = slot
    for start, padded, want in expected:
        n = want.numel()
        torch.testing.assert_close(row[start : start + n], want)
        assert torch.all(row[start + n : start + padded] == 0)  # padding is zero
    # the flags: how many ranks had a gradient, divided like the values
    torch.testing.assert_close(row[n_values:], torch.tensor([k, k - 1, k]) / k)


def test_reduce_blocks_sums_in_rank_order_with_missing_gradients():
    run_on_ranks(3, _reduce)
