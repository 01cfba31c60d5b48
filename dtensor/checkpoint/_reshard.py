"""Box maths for resharding: which saved chunks overlap the block a rank wants to fill.

Pure functions on integer tuples, no tensors and no process groups. A *box* is a pair
``(offsets, sizes)`` giving a rectangular block of a tensor's global index space: dim ``d``
covers ``offsets[d] .. offsets[d] + sizes[d] - 1``. Every chunk in a checkpoint is a box, and
so is every rank's local shard of a ``DTensor`` (``DTensorSpec.local_shape_and_offset``),
whatever its placements. Loading is then: for each box a rank holds, intersect it with every
saved chunk and copy the overlaps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]

# A tensor split into more pieces than this is refused when a checkpoint is read: checking
# that chunks do not overlap compares every pair, and a hostile file could otherwise ask for
# billions of comparisons.
MAX_CHUNKS_PER_TENSOR = 8192


def volume(sizes: Sequence[int]) -> int:
    """Number of elements in a box of these sizes.

    Example::

        >>> volume((3, 4))
        12
    """
    n = 1
    for s in sizes:
        n *= s
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The box shared by ``a`` and ``b``, or None when they share no element.

    Example::

        >>> intersect(((0, 0), (4, 6)), ((2, 3), (4, 6)))
        ((2, 3), (2, 3))
        >>> intersect(((0,), (2,)), ((2,), (2,))) is None
        True
    """
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def relative_slices(inner: Box, outer_offsets: Sequence[int]) -> tuple[slice, ...]:
    """Slices that pick ``inner`` out of a tensor whose corner sits at ``outer_offsets``.

    Example::

        >>> relative_slices(((2, 3), (2, 3)), (2, 0))
        (slice(0, 2, None), slice(3, 6, None))
    """
    return tuple(
        slice(o - base, o - base + s)
        for o, s, base in zip(inner[0], inner[1], outer_offsets, strict=True)
    )


def overlaps(target: Box, chunks: Sequence[Box]) -> list[tuple[int, Box]]:
    """Every chunk that shares elements with ``target``, with the shared box.

    Example::

        >>> overlaps(((1,), (2,)), [((0,), (2,)), ((2,), (2,)), ((4,), (1,))])
        [(0, ((1,), (1,))), (1, ((2,), (1,)))]
    """
    found = []
    for i, chunk in enumerate(chunks):
        shared = intersect(target, chunk)
        if shared is not None:
            found.append((i, shared))
    return found


def coverage_problem(shape: Sequence[int], chunks: Sequence[Box]) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``shape`` exactly once, or None if they do.

    Checks that every chunk has the tensor's rank, non-negative offsets and sizes, lies inside
    the tensor, that no two chunks overlap, and that together they hold every element.

    Example::

        >>> coverage_problem((4,), [((0,), (2,)), ((2,), (2,))]) is None
        True
        >>> coverage_problem((4,), [((0,), (3,)), ((2,), (2,))])
        'chunks 0 and 1 overlap'
        >>> coverage_problem((4,), [((0,), (2,))])
        'chunks hold 2 of 4 elements; the rest is missing'
    """
    ndim = len(shape)
    if len(chunks) > MAX_CHUNKS_PER_TENSOR:
        return f"{len(chunks)} chunks (at most {MAX_CHUNKS_PER_TENSOR} are accepted)"
    for i, (offs, sizes) in enumerate(chunks):
        if len(offs) != ndim or len(sizes) != ndim:
            return f"chunk {i} has {len(offs)}-d offsets and {len(sizes)}-d sizes for a {ndim}-d tensor"
        for d in range(ndim):
            if offs[d] < 0 or sizes[d] < 0 or offs[d] + sizes[d] > shape[d]:
                return (
                    f"chunk {i} spans {offs[d]}..{offs[d] + sizes[d]} on dim {d}, "
                    f"outside 0..{shape[d]}"
                )
    nonempty = [i for i, (_, sizes) in enumerate(chunks) if volume(sizes) > 0]
    pair = _first_overlapping_pair(ndim, [chunks[i] for i in nonempty])
    if pair is not None:
        return f"chunks {nonempty[pair[0]]} and {nonempty[pair[1]]} overlap"
    held, total = sum(volume(chunks[i][1]) for i in nonempty), volume(shape)
    if held != total:
        return f"chunks hold {held} of {total} elements; the rest is missing"
    return None


def _first_overlapping_pair(ndim: int, chunks: Sequence[Box]) -> tuple[int, int] | None:
    """Indices ``(i, j)``, ``i < j``, of the first two non-empty chunks that overlap."""
    n = len(chunks)
    if n < 2:
        return None
    if ndim == 0:
        return (0, 1)
    lo = np.array([c[0] for c in chunks], dtype=np.int64)
    hi = lo + np.array([c[1] for c in chunks], dtype=np.int64)
    # Two boxes overlap when, on every dim, each starts before the other ends.
    share = np.ones((n, n), dtype=bool)
    for d in range(ndim):
        share &= (lo[:, None, d] < hi[None, :, d]) & (lo[None, :, d] < hi[:, None, d])
    share[np.tril_indices(n)] = False
    hits = np.argwhere(share)
    return None if len(hits) == 0 else (int(hits[0][0]), int(hits[0][1]))
