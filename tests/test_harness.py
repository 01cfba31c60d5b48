"""The harness itself: errors carry every rank's traceback, hangs are bounded, pools persist."""

import os

import pytest
import torch.distributed as dist

from tests import harness
from tests.harness import PoolBroken, RankFailure, run_on_ranks


def _fail_on_odd_ranks():
    if dist.get_rank() % 2:
        raise ValueError(f"boom from {dist.get_rank()}")


def test_failures_carry_every_rank_traceback():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(4, _fail_on_odd_ranks)
    msg = str(info.value)
    assert "rank(s) [1, 3]" in msg and "boom from 1" in msg and "boom from 3" in msg


def _hang_on_rank_0():
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 leaves; rank 1 waits in a barrier it never joins")
    dist.barrier()


def test_hung_collective_fails_within_bounded_time_and_pool_is_rebuilt():
    pool = harness.get_pool(2)
    pids = pool.pids
    with pytest.raises(PoolBroken, match="did not finish"):
        run_on_ranks(2, _hang_on_rank_0, timeout_s=2.0)  # bounded by the task's timeout
    for pid in pids:  # the old workers are gone: reaped, not left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    run_on_ranks(2, _record_pid)  # a fresh pool answers
    assert harness.get_pool(2).pids != pids


def _noop():
    pass


def _record_pid():
    assert dist.get_world_size() == 2


def test_pool_is_reused_across_tests():
    pool = harness.get_pool(2)
    run_on_ranks(2, _record_pid)
    run_on_ranks(2, _record_pid)
    assert harness.get_pool(2) is pool
