"""Multi-rank test harness: a persistent pool of spawned gloo workers per world size.

A test calls ``run_on_ranks(world_size, fn, **kwargs)``; ``fn`` (a module-level function)
runs on every rank of a pool whose default process group is already initialized. Pools are
started once per world size per pytest session and reused, so the 3-4 s a spawned
interpreter needs to import torch is paid once, not per test.

Failures carry every rank's traceback. A rank that does not answer within the deadline (a
hung collective) or dies fails the test; the pool is then torn down (only the processes it
started are ended, by their Process handle) and the next test builds a fresh one.
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

DEFAULT_TIMEOUT_S = 120.0
# After the first rank fails, how long the others get to report before the pool is
# considered wedged (a rank blocked in a collective its failed peer never joined).
FAILURE_GRACE_S = 5.0
PG_TIMEOUT_S = 60.0


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds every rank's traceback."""


class PoolBroken(RuntimeError):
    """A rank hung or died; the pool was torn down."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_worker_state(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _worker_main(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    results.put(("ready", rank, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, module_name, fn_name, kwargs = task
        try:
            _reset_worker_state(seed=1234)
            fn = getattr(importlib.import_module(module_name), fn_name)
            fn(**kwargs)
            results.put((task_id, rank, None))
        except BaseException:  # every failure goes back to the parent, never kills the loop
            results.put((task_id, rank, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` spawned processes sharing one gloo default group."""

    def __init__(self, world_size: int, start_timeout_s: float = 120.0) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, world_size, port, self._tasks[r], self._results),
                daemon=True,
                name=f"test-worker-{world_size}-{r}",
            )
            for r in range(world_size)
        ]
        self._ids = itertools.count()
        t0 = time.perf_counter()
        for p in self._procs:
            p.start()
        try:
            self._collect("ready", start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.start_seconds = time.perf_counter() - t0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(self, module: str, fn: str, kwargs: dict, timeout_s: float) -> None:
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, module, fn, kwargs))
        errors = self._collect(task_id, timeout_s)
        if errors:
            body = "\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(errors.items()))
            raise RankFailure(
                f"{fn} failed on rank(s) {sorted(errors)} of {self.world_size}:\n{body}"
            )

    def _collect(self, task_id, timeout_s: float) -> dict[int, str]:
        """Wait for every rank's answer to ``task_id``; return {rank: traceback} of failures."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        while pending:
            now = time.monotonic()
            if now > deadline:
                self.shutdown(polite=False)  # a rank that hangs will not answer a request
                detail = "".join(f"\n----- rank {r} -----\n{tb}" for r, tb in errors.items())
                raise PoolBroken(
                    f"rank(s) {sorted(pending)} of {self.world_size} did not finish task "
                    f"{task_id!r} within {timeout_s:.0f}s (hung collective?); pool torn "
                    f"down.{detail}"
                )
            try:
                got_id, rank, tb = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.shutdown()
                    raise PoolBroken(
                        f"rank(s) {dead} died (exit codes {codes}) during task {task_id!r}; "
                        "pool torn down."
                    ) from None
                continue
            if got_id != task_id:  # a stale answer from a task that already failed
                continue
            pending.discard(rank)
            if tb is not None:
                errors[rank] = tb
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return errors

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def shutdown(self, polite: bool = True) -> None:
        """Stop the workers this pool started: ask politely (unless told the workers hang),
        then terminate, then kill."""
        for q, p in zip(self._tasks, self._procs):
            if polite and p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (5.0 if polite else 0.0)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()
            q.close()


_POOLS: dict[int, WorkerPool] = {}
STATS = {"pool_starts": 0, "pool_start_seconds": 0.0}


def get_pool(world_size: int) -> WorkerPool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.shutdown()
        pool = WorkerPool(world_size)
        STATS["pool_starts"] += 1
        STATS["pool_start_seconds"] += pool.start_seconds
        _POOLS[world_size] = pool
    return pool


def run_on_ranks(world_size: int, fn, *, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> None:
    """Run module-level ``fn(**kwargs)`` on every rank of a ``world_size`` gloo world.

    Example:
        >>> def _check(n):
        ...     assert dist.get_world_size() == n
        >>> run_on_ranks(2, _check, n=2)
    """
    if fn.__qualname__ != fn.__name__:
        raise TypeError(f"run_on_ranks: fn must be a module-level function, got {fn!r}.")
    pool = get_pool(world_size)
    try:
        pool.run(fn.__module__, fn.__name__, kwargs, timeout_s)
    except PoolBroken:
        _POOLS.pop(world_size, None)
        raise
    except RankFailure:
        # Ranks that failed may have left collectives unmatched; a fresh pool is safest only
        # when some rank is still stuck, which _collect already handled. Keep the pool.
        raise


def fresh_pool(world_size: int) -> None:
    """End the ``world_size`` pool, if any, so the next ``run_on_ranks`` starts new workers
    (for a measurement of what one program holds, which earlier tests' leftovers would blur).

    Example:
        >>> fresh_pool(4)
        >>> run_on_ranks(4, _check, n=4)   # on workers that ran nothing before
    """
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.shutdown()


def shutdown_all() -> None:
    for ws in list(_POOLS):
        _POOLS.pop(ws).shutdown()
