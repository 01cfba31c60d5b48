"""The collectives under DTensor and fsdp2: one layer both build on.

DTensor's redistributions (``dtensor._collectives``, ``dtensor._collectives_traced``) and
fsdp2's grouped collectives (``fsdp2._collectives``) move data with the same few primitives;
this module holds them, under public names:

* ``Pending``: a result that may still be on the wire;
* the padded row collectives ``all_gather_rows`` and ``reduce_rows`` ([Note: row collectives
  on gloo]) and the local reductions behind them (``sum_into``, ``tree_sum_into``,
  ``combine_rows``);
* ``exchange``: one point-to-point message per peer and per item, the transport of the block
  routes on gloo, with its tags from a range its user reserved (``reserve_message_tags``:
  [Note: message tags]);
* ``reduction_of``: how a ``Partial`` placement is reduced (the wire op, the divisor, the
  power of a norm) - the one mapping every reducing collective uses;
* ``backend_is_gloo`` and ``mesh_dim_label`` (what ``dtensor.debug`` records a collective
  under).

Every collective here is reported to ``dtensor.debug``.

[Note: row collectives on gloo] gloo's ring all-gather and its reduce-scatter (an all-reduce
plus copies inside torch) are slower on this project's CPU machines than an all-to-all of
padded rows: an all-gather sends our row to every peer (the row repeated once per rank) and
a reduce-scatter sends each peer its row and sums what comes back, in rank order. The
measurements are in docs/dtensor.md. ``all_gather_rows`` and ``reduce_rows`` are those two
forms (a real all-gather / reduce-scatter on NCCL); fsdp2's grouped collectives use them.
DTensor's own all-gather and sum reduce-scatter on gloo go point to point instead ([Note:
DTensor's collectives on gloo] in ``dtensor/_collectives.py``).

Example::

    >>> rows = torch.arange(4.0).repeat(2, 1)           # gloo, 2 ranks: our row twice
    >>> all_gather_rows(rows, group, 2).wait().shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtensor import debug
from dtensor.placement import NormPartial, Partial

# torch 2.13 prefers the *_single names; older releases only have *_tensor.


def _first_available(*names: str):
    """The first of ``names`` that this torch's ``torch.distributed`` has: collective
    functions were renamed across releases (the GPU machines run 2.11, this one 2.13)."""
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}; this torch is too old.")


_all_gather_flat = _first_available(
    "all_gather_single", "all_gather_into_tensor", "_all_gather_base"
)
_reduce_scatter_flat = _first_available(
    "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"
)


class Pending:
    """A collective result that may not be ready; ``wait()`` returns the finished tensor.

    Example::

        >>> Pending.ready(torch.ones(2)).wait()
        tensor([1., 1.])
    """

    __slots__ = ("_work", "_finish", "_result")

    def __init__(self, work, finish: Callable[[], torch.Tensor]) -> None:
        self._work = work
        self._finish = finish
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            with debug.annotate_failures():
                if self._work is not None:
                    debug.wait_collective(self._work)
                    self._work = None  # it references the buffers; a pool may hand them out
                self._result = self._finish()
            self._finish = None
        return self._result

    @staticmethod
    def ready(t: torch.Tensor) -> Pending:
        return Pending(None, lambda: t)


def backend_is_gloo(group) -> bool:
    """Whether ``group`` runs on gloo (the row collectives then use all-to-alls).

    Example::

        >>> backend_is_gloo(init_device_mesh("cpu", (2,)).get_group())
        True
    """
    return "gloo" in str(dist.get_backend(group)).lower()


def mesh_dim_label(mesh, mesh_dim):
    """What ``dtensor.debug`` records a collective over ``mesh``'s dim ``mesh_dim`` under:
    the dim's name when the mesh names its dims, else the dim's index (also without a mesh).

    Example::

        >>> mesh_dim_label(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), 0)
        'dp'
    """
    names = mesh.mesh_dim_names if mesh is not None else None
    return names[mesh_dim] if names else mesh_dim


# --------------------------------------------------------------------------- reductions
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True)
class Reduction:
    """How partial values are reduced over ``k`` ranks: raise each to ``power`` (a p-norm;
    None: as they are), combine them with ``op`` (``"sum"``, ``"max"`` or ``"min"``), divide
    the sum by ``divide_by``, and take the ``1 / power``-th root.

    Example::

        >>> reduction_of(Partial("avg"), 4)
        Reduction(op='sum', divide_by=4.0, power=None)
    """

    op: str
    divide_by: float = 1.0
    power: float | None = None

    @property
    def reduce_op(self) -> dist.ReduceOp:
        """``op`` as ``torch.distributed``'s ``ReduceOp``."""
        return _REDUCE_OPS[self.op]

    def before(self, x: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """The values as they go on the wire."""
        if self.power is None:
            return x
        return x.pow_(self.power) if inplace else x.pow(self.power)

    def after(self, y: torch.Tensor, *, divide: bool = True) -> torch.Tensor:
        """The reduced values (in place): divided (unless the collective did it), then the
        root of a p-norm."""
        if divide and self.divide_by != 1:
            y = y.div_(self.divide_by)
        return y.pow_(1.0 / self.power) if self.power is not None else y


def reduction_of(partial: Partial, k: int) -> Reduction:
    """The ``Reduction`` of ``partial`` over ``k`` ranks: the one mapping from placements to
    wire ops. gloo has no average, so ``avg`` is a sum divided by ``k`` everywhere; a p-norm
    sums the p-th powers (``inf`` / ``-inf``: max / min; ``0``: a plain sum of counts).

    Example::

        >>> reduction_of(NormPartial(2.0), 4)
        Reduction(op='sum', divide_by=1.0, power=2.0)
    """
    if isinstance(partial, NormPartial):
        p = partial.norm_type
        if p == float("inf"):
            return Reduction("max")
        if p == float("-inf"):
            return Reduction("min")
        if p == 0:
            return Reduction("sum")
        return Reduction("sum", power=p)
    op = partial.reduce_op
    if op == "avg":
        return Reduction("sum", divide_by=float(k))
    return Reduction(op)


# --------------------------------------------------------------------------- row collectives
def reduces_rows_by_all_to_all(group, op: str) -> bool:
    """Whether ``reduce_rows`` with ``op`` runs an all-to-all and reduces locally (gloo, and
    max / min everywhere) instead of a reduce-scatter.

    Example::

        >>> reduces_rows_by_all_to_all(gloo_group, "sum")
        True
    """
    return backend_is_gloo(group) or op != "sum"


def _get(pool, shape, dtype, device) -> torch.Tensor:
    if pool is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return pool.get(shape, dtype, device)


def all_gather_rows(
    rows_in: torch.Tensor, group, group_size: int, *, label=None, mesh=None, pool=None
) -> Pending:
    """All-gather of one row per rank: the result is ``(group_size, N)`` with row ``r`` from
    rank ``r``, and ``rows_in[0]`` (``(group_size, N)``) is this rank's row.

    On gloo ``rows_in`` must hold the same row ``group_size`` times: the gather is an
    all-to-all ([Note: row collectives on gloo]). Elsewhere only ``rows_in[0]`` is read.
    ``pool`` (an object with ``get(shape, dtype, device)`` and ``put(tensor)``) supplies the
    output and takes the input back once the collective has finished; None allocates.

    Example::

        >>> out = all_gather_rows(torch.full((2, 3), float(rank)), group, 2).wait()
        >>> out[:, 0]
        tensor([0., 1.])
    """
    n = rows_in.size(1)
    nbytes = n * rows_in.element_size()
    debug.record("all_gather", mesh_dim_label(mesh, label), group_size, nbytes, group=group)
    out = _get(pool, (group_size, n), rows_in.dtype, rows_in.device)
    if backend_is_gloo(group):
        work = dist.all_to_all_single(out, rows_in, group=group, async_op=True)
    else:
        work = _all_gather_flat(out.view(-1), rows_in[0], group=group, async_op=True)

    def finish():
        if pool is not None:
            pool.put(rows_in)
        return out

    return Pending(work, finish)


def sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """``out`` = the sum of ``parts``, added in the order given.

    Example::

        >>> sum_into(torch.empty(2), [torch.ones(2), torch.ones(2)])
        tensor([2., 2.])
    """
    if len(parts) == 1:
        return out.copy_(parts[0])
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)
    return out


def tree_sum_into(
    out: torch.Tensor, parts: list[torch.Tensor], *, scratch: list[bool] | None = None
) -> torch.Tensor:
    """``out`` = the sum of ``parts`` added pairwise, level by level: neighbours ``(0, 1)``,
    ``(2, 3)``, ... first, then neighbouring pair sums, an odd last one moving up unchanged.

    [Note: one summation tree] The grouping depends only on ``len(parts)``, and it nests:
    summing aligned runs of ``2**j`` parts first and then their sums gives the same tree as
    summing all parts at once. So ``k`` ranks holding ``2**j`` consecutive parts each and a
    rank holding all of them add identical numbers in identical order (addition commutes
    bitwise in IEEE arithmetic, so only the grouping matters). Parts whose ``scratch`` flag
    is set may be overwritten; the others are only read. It does as many additions as a
    sequential sum.

    Example::

        >>> sum_into(torch.empty(1), [torch.tensor([1e8]), torch.tensor([1.0]),
        ...                           torch.tensor([-1e8]), torch.tensor([1.0])])
        tensor([1.])
        >>> tree_sum_into(torch.empty(1), [torch.tensor([1e8]), torch.tensor([1.0]),
        ...                                torch.tensor([-1e8]), torch.tensor([1.0])])
        tensor([0.])
    """
    level = list(parts)
    writable = list(scratch) if scratch is not None else [False] * len(level)
    while len(level) > 1:
        pairs, owned = [], []
        for a, b, a_ok, b_ok in zip(level[::2], level[1::2], writable[::2], writable[1::2]):
            if a_ok:
                pairs.append(a.add_(b))
            elif b_ok:
                pairs.append(torch.add(a, b, out=b))
            else:
                pairs.append(a + b)
            owned.append(True)
        if len(level) % 2:
            pairs.append(level[-1])
            owned.append(writable[-1])
        level, writable = pairs, owned
    return out.copy_(level[0])


def combine_rows(
    recv: torch.Tensor, divide_by: float = 1.0, op: str = "sum", *, tree: bool = False
) -> torch.Tensor:
    """Reduce the rows of ``recv`` (``(k, N)``) in rank order: a sum divided by
    ``divide_by`` (one pass when that is ``k``: ``mean``), or the elementwise max / min.
    With ``tree`` the sum adds the rows pairwise (``tree_sum_into``; it overwrites
    ``recv``) and then divides.

    Example::

        >>> combine_rows(torch.tensor([[1.0, 4.0], [3.0, 2.0]]), op="max")
        tensor([3., 4.])
    """
    if op == "max":
        return recv.amax(0)
    if op == "min":
        return recv.amin(0)
    if tree:
        total = tree_sum_into(torch.empty_like(recv[0]), list(recv), scratch=[True] * len(recv))
    elif divide_by == recv.size(0) and recv.size(0) > 1:
        return recv.mean(0)
    else:
        total = sum_into(torch.empty_like(recv[0]), list(recv))
    if divide_by != 1:
        total.div_(divide_by)
    return total


def reduce_rows(
    rows: torch.Tensor,
    rank: int,
    group,
    *,
    divide_by: float = 1.0,
    op: str = "sum",
    label=None,
    mesh=None,
    pool=None,
    tree: bool = False,
) -> Pending:
    """Reduce ``rows`` (``(group_size, N)``, row ``r`` destined for rank ``r``) over the
    group: this rank gets its row summed (``op="sum"``, then divided by ``divide_by``) or
    its elementwise ``"max"`` / ``"min"``.

    With ``tree`` the sum is ``tree_sum_into``'s pairwise tree in rank order on every
    backend (an all-to-all and a local sum, also where a reduce-scatter would otherwise
    run: its order is the backend's), so the result does not depend on how the backend
    sums. The receive buffer is then as large as ``rows``.

    The result is a fresh ``(N,)`` tensor that owns its memory. On gloo this is an
    all-to-all followed by a local reduction in rank order ([Note: row collectives on
    gloo]); it moves (k-1)/k of the buffer per rank instead of twice that.

    Example::

        >>> reduce_rows(torch.ones(2, 3), rank, group, divide_by=2.0).wait()
        tensor([1., 1., 1.])
    """
    k = rows.size(0)
    nbytes = rows.numel() * rows.element_size()
    debug.record("reduce_scatter", mesh_dim_label(mesh, label), k, nbytes, group=group)
    if k == 1:
        return Pending(None, lambda: combine_rows(rows, divide_by, op))
    if tree or reduces_rows_by_all_to_all(group, op):
        recv = _get(pool, tuple(rows.shape), rows.dtype, rows.device)
        work = dist.all_to_all_single(recv, rows, group=group, async_op=True)

        def finish():
            total = combine_rows(recv, divide_by, op, tree=tree)
            if pool is not None:
                pool.put(rows)
                pool.put(recv)
            return total

        return Pending(work, finish)
    out = torch.empty(rows.size(1), dtype=rows.dtype, device=rows.device)
    work = _reduce_scatter_flat(
        out, rows.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True
    )

    def finish_rs():
        if pool is not None:
            pool.put(rows)
        return out.div_(divide_by) if divide_by != 1 else out

    return Pending(work, finish_rs)


# --------------------------------------------------------------------------- point to point
# [Note: message tags] gloo matches a point-to-point message by its peer and its tag, in the
# order the messages were posted. Two exchanges that may be in flight at once (an fsdp2
# all-gather prefetched during a reduction, a DTensor redistribution inside a module fsdp2
# is gathering) must therefore never share a tag. So every user of ``exchange`` reserves a
# range of its own, under a name of its own, when its module is imported
# (``reserve_message_tags("fsdp2.all_gather", 1 << 24)``), and takes its tags from it: this
# layer knows none of its users. Every rank must agree on every range, while ranks need not
# import modules in the same order, nor the same modules (a tool imported on one rank only),
# so a range is placed by its name and size alone, never by the order of reservations: its
# ``count`` tags start an aligned block of the next power of two, the block picked by a
# stable hash of the name (blake2b: ``hash()`` is salted per process) among the blocks of
# that size in the tag space ``[0, TAG_SPACE)``. Reserving a range that overlaps another
# name's raises on every rank that reserves both (rename one; the odds are the range's share
# of the space, 1 in 128 against each 2**24-tag range); the same name and count reserved
# again (a module reloaded) is the same range.
TAG_SPACE = 1 << 31  # gloo takes a tag as a C int
_RESERVED: dict[str, MessageTags] = {}  # name -> its range
_RESERVING = threading.Lock()


@dataclass(frozen=True)
class MessageTags:
    """A named range of point-to-point message tags: ``tags[i]`` is the ``i``-th.

    Example::

        >>> tags = reserve_message_tags("mylib.halo", 4)
        >>> tags[3] - tags[0], len(tags)
        (3, 4)
    """

    name: str
    first: int
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise IndexError(
                f"message tag {i} is outside {self.name!r}'s range of {self.count} tags."
            )
        return self.first + i


def reserve_message_tags(name: str, count: int) -> MessageTags:
    """Reserve ``count`` point-to-point message tags under ``name`` (one name per user of
    ``exchange``; call it when the user's module is imported). The range depends on the name
    and count alone, so every rank gets the same one whatever it imported before ([Note:
    message tags] in ``dtensor/comm.py``); asked again with the same count, it is the same.

    Raises:
        ValueError: ``count`` is not an int from 1 to ``TAG_SPACE // 2``; ``name`` is
            reserved with another count; or the range overlaps another name's.

    Example::

        >>> tags = reserve_message_tags("mylib.halo", 4)    # at import time of mylib
        >>> reserve_message_tags("mylib.halo", 4) == tags   # a reload: the same range
        True
    """
    if type(count) is not int or not 1 <= count <= TAG_SPACE // 2:
        raise ValueError(
            f"reserve_message_tags({name!r}, {count!r}): count must be an int from 1 to "
            f"{TAG_SPACE // 2}."
        )
    tags = _placed(name, count)
    with _RESERVING:
        found = _RESERVED.get(name)
        if found is not None and found.count != count:
            raise ValueError(
                f"reserve_message_tags({name!r}, {count}): {name!r} is already reserved with "
                f"{found.count} tags. One name is one range: reserve it with one count, or "
                "use another name."
            )
        clash = [t for t in _RESERVED.values() if t.name != name and _overlap(t, tags)]
        if clash:
            raise ValueError(
                f"reserve_message_tags({name!r}, {count}): its tags "
                f"[{tags.first}, {tags.first + count}) overlap {clash[0].name!r}'s "
                f"[{clash[0].first}, {clash[0].first + clash[0].count}). A range is placed "
                "by its name (the same on every rank); rename one of the two."
            )
        _RESERVED[name] = tags
    return tags


def _placed(name: str, count: int) -> MessageTags:
    """Where ``name``'s ``count`` tags sit: see [Note: message tags]."""
    block = 1 << (count - 1).bit_length()
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return MessageTags(name, int.from_bytes(digest, "big") % (TAG_SPACE // block) * block, count)


def _overlap(a: MessageTags, b: MessageTags) -> bool:
    return a.first < b.first + b.count and b.first < a.first + a.count


def message_tags(name: str) -> MessageTags:
    """The tag range reserved under ``name`` ([Note: message tags] in ``dtensor/comm.py``).

    Raises:
        KeyError: nothing is reserved under ``name``.

    Example::

        >>> message_tags("dtensor.redistribute") == reserve_message_tags("dtensor.redistribute", 1)
        True
    """
    try:
        return _RESERVED[name]
    except KeyError:
        raise KeyError(
            f"no message tags are reserved for {name!r}; reserved: {sorted(_RESERVED)}. "
            "Reserve them with dtensor.comm.reserve_message_tags(name, count) when the "
            "module that sends the messages is imported."
        ) from None


Blocks = Callable[[int], torch.Tensor]


def exchange(group, rank: int, messages: Sequence[tuple[Blocks, Blocks]], tags: MessageTags):
    """Post point-to-point messages between this rank (``rank`` of ``group``) and each peer.

    ``messages[i]`` is a pair ``(send_to, recv_into)``: ``send_to(j)`` is the tensor this
    rank sends peer ``j`` and ``recv_into(j)`` the tensor peer ``j``'s message lands in,
    both with tag ``tags[i]``. A tensor with no elements is not sent (nor awaited): both
    sides know every block's size. Receives are posted before sends, peers in ring order.
    Returns the posted works; every rank must post the same messages in the same order.

    Example::

        >>> blocks = [torch.empty(3) for _ in range(k)]
        >>> works = exchange(group, rank, [(lambda j: mine, lambda j: blocks[j])], tags)
        >>> for w in works:
        ...     w.wait()
    """
    size = group.size()
    works = []
    for i, (_, recv_into) in enumerate(messages):
        for step in range(1, size):
            src = (rank - step) % size
            into = recv_into(src)
            if into.numel():
                works.append(group.recv([into], src, tags[i]))
    for i, (send_to, _) in enumerate(messages):
        for step in range(1, size):
            dst = (rank + step) % size
            block = send_to(dst)
            if block.numel():
                works.append(group.send([block], dst, tags[i]))
    return works
