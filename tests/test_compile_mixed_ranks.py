"""A redistribution that one rank runs eagerly and another inside a compiled graph.

Ranks can leave step: one falls back to eager after a graph break or dynamo's recompile
limit while its peers run the compiled graph. Both forms of every redistribution must then
put the same messages on the wire, or the ranks wait on each other until the process
group's timeout. Each test compiles the case on every rank first (``aot_eager``,
``fullgraph=True``, so the redistribution is inside the graph), then runs it once with some
ranks compiled and the others eager, under a 10 s process-group timeout, and checks the
result against plain tensor ops, the placements, and that the eager ranks issued the
collective (``CommDebugMode``) while the compiled ranks ran it inside the graph (not counted).

Shapes are uneven: (7, 2, 3) splits dim 0 as 4/3 over 2 ranks and 3/3/1 over 3, and dim 1
as 1/1/0 over 3 (an empty shard).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from device_mesh import DeviceMesh, init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks

SHAPE = (7, 2, 3)
MIXED_TIMEOUT = timedelta(seconds=10)


def _full(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _partial_value(reduce_op: str, world: int) -> torch.Tensor:
    """The value of a Partial(reduce_op) whose rank-r local tensor is ``_full(100 + r)``."""
    locals_ = torch.stack([_full(100 + r) for r in range(world)])
    if reduce_op == "sum":
        return locals_.sum(0)
    if reduce_op == "avg":
        return locals_.mean(0)
    return locals_.amax(0) if reduce_op == "max" else locals_.amin(0)


def _inputs(codes: str, mesh, world: int) -> tuple[list, list[torch.Tensor]]:
    """DTensors (and their full values) for placement codes: S0, S1, R, P:<op>."""
    dts, fulls = [], []
    for n, code in enumerate(codes.split()):
        if code.startswith("P:"):
            op = code[2:]
            local = _full(100 + dist.get_rank())
            dts.append(DTensor.from_local(local, mesh, [Partial(op)], shape=SHAPE))
            fulls.append(_partial_value(op, world))
        else:
            full = _full(n)
            placement = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}[code]
            dts.append(distribute_tensor(full, mesh, [placement]))
            fulls.append(full)
    return dts, fulls


# functions of DTensors whose only communication is one redistribution
def _gather(x):
    return x.full_tensor() * 2


def _gather_unused(x):
    x.full_tensor()  # the result is dropped: the compiled graph must still gather
    return x * 2


def _add(a, b):
    return a + b


# case: (inputs, function, reference on full tensors, output placement, eager collectives)
CASES = {
    "S0->R": ("S0", _gather, lambda x: x * 2, None, {"all_gather": 1}),
    "S1->R": ("S1", _gather, lambda x: x * 2, None, {"all_gather": 1}),
    "S0->R unused": ("S0", _gather_unused, lambda x: x * 2, Shard(0), {"all_gather": 1}),
    "P(sum)->R": ("P:sum", _gather, lambda x: x * 2, None, {"all_reduce": 1}),
    "P(avg)->R": ("P:avg", _gather, lambda x: x * 2, None, {"all_reduce": 1}),
    "P(max)->R": ("P:max", _gather, lambda x: x * 2, None, {"all_reduce": 1}),
    "P(sum)->S0": ("P:sum S0", _add, torch.add, Shard(0), {"reduce_scatter": 1}),
    "P(avg)->S1": ("P:avg S1", _add, torch.add, Shard(1), {"reduce_scatter": 1}),
    "P(max)->S0": ("P:max S0", _add, torch.add, Shard(0), {"reduce_scatter": 1}),
    "P(min)->S1": ("P:min S1", _add, torch.add, Shard(1), {"reduce_scatter": 1}),
    "R->S0": ("R S0", _add, torch.add, Shard(0), {}),
    "S1->S0": ("S0 S1", _add, torch.add, Shard(0), {"all_to_all": 1}),
    "S0->S1": ("S1 S0", _add, torch.add, Shard(1), {"all_to_all": 1}),
}


def _mixed_modes(case: str, compiled_ranks: list[int], all_reduce_blocks: bool = False) -> None:
    from dtensor import _collectives

    codes, fn, reference, placement, eager_counts = CASES[case]
    threshold = _collectives.ALL_REDUCE_BLOCKS_MIN_BYTES
    if all_reduce_blocks:  # the block all-reduce of large tensors, on this small one
        _collectives.ALL_REDUCE_BLOCKS_MIN_BYTES = 0
    rank, world = dist.get_rank(), dist.get_world_size()
    init_device_mesh("cpu", (world,))  # the world's group is cached before ours exists
    group = dist.new_group(list(range(world)))  # its own group: the short timeout stays here
    torch._dynamo.reset()
    try:
        mesh = DeviceMesh.from_group(group, "cpu")
        dts, fulls = _inputs(codes, mesh, world)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        compiled(*dts)  # compiles on every rank; every rank runs the same graph
        dist.barrier()
        _set_pg_timeout(MIXED_TIMEOUT, group)  # from here a mismatch fails in 10 s
        with CommDebugMode() as comm:
            out = (compiled if rank in compiled_ranks else fn)(*dts)
        want = reference(*fulls)
        if placement is None:  # a full tensor
            torch.testing.assert_close(out, want)
        else:
            assert out.placements == (placement,), (case, out.placements)
            torch.testing.assert_close(out.full_tensor(), want)
        expected = {} if rank in compiled_ranks else eager_counts
        assert comm.get_comm_counts() == expected, (case, rank, comm.get_comm_counts())
    finally:
        _collectives.ALL_REDUCE_BLOCKS_MIN_BYTES = threshold  # the workers are reused
        torch._dynamo.reset()
        dist.destroy_process_group(group)


@pytest.mark.parametrize("case", list(CASES))
def test_eager_and_compiled_ranks_agree_world_2(case):
    """Rank 0 compiled, rank 1 eager (rank 1 compiled and rank 0 eager for every other
    case), for every redistribution kind."""
    compiled = [0] if list(CASES).index(case) % 2 == 0 else [1]
    run_on_ranks(2, _mixed_modes, timeout_s=120, case=case, compiled_ranks=compiled)


@pytest.mark.parametrize("case", list(CASES))
def test_eager_and_compiled_ranks_agree_world_3(case):
    """Three ranks, one or two of them compiled, with an empty shard on dim 1."""
    compiled = [0, 2] if list(CASES).index(case) % 2 == 0 else [1]
    run_on_ranks(3, _mixed_modes, timeout_s=120, case=case, compiled_ranks=compiled)


@pytest.mark.parametrize("case", ["P(sum)->R", "P(avg)->R"])
@pytest.mark.parametrize("world", [3])  # two ranks keep gloo's all-reduce
def test_eager_and_compiled_ranks_agree_on_the_block_all_reduce(world, case):
    """The sum / average all-reduce of large tensors on gloo (a point-to-point reduce-scatter
    plus all-gather, [Note: all-reduce on gloo]; here with the size threshold at 0, so the
    (7, 2, 3) tensor takes it), compiled on one rank and eager on the others."""
    run_on_ranks(
        world, _mixed_modes, timeout_s=120, case=case, compiled_ranks=[1], all_reduce_blocks=True
    )
