"""Fault injection for tests/test_out_of_step.py: one rank of a small training job (FSDP,
two blocks, gloo) misbehaves once; every rank's process is then expected to end non-zero.

``worker(rank, world, port, fault, outdir, timeout)`` runs in a child process (started by
the test through a forkserver, or with ``python -m tests._faults`` under torchrun). Each rank
logs to ``outdir/rank{r}.log``; the faulty rank writes the wall time of its fault to
``outdir/fault_time`` just before injecting it. Faults (on rank 1 unless said):

* ``skip_all_gather``: skips the all-gather of ``blocks.0`` at step 2 (a local copy stands
  in: gloo pairs the peers' all-gather with its next one, same size, different module);
* ``other_collective``: issues an all-reduce where the others all-gather a DTensor;
* ``sleep``: sleeps three timeouts before its next collective;
* ``exit`` / ``kill``: ``os._exit(3)`` / SIGKILL in the middle of step 2's forward;
* ``raise_forward`` / ``raise_backward``: raises in a forward / backward hook at step 2;
* ``raise_in_collective``: raises inside the wait of an all-gather at step 2;
* ``kill_in_save``: SIGKILL inside the second ``dtensor.checkpoint.save`` to ``outdir/ckpt``,
  after writing its shard (the first, whose values rank 0 wrote to ``expected-1.pt``, must
  stay loadable there);
* ``extra_forward``: runs one more forward (no backward) at step 2;
* ``skip_step``: skips step 2 whole (the loop numbers its steps with ``debug.new_step``);
* ``blocked``: sleeps 30 s at step 2 while rank 0 waits in a (recorded) synchronous
  ``dist.all_reduce`` that Python cannot interrupt; the verdict's grace is 1 s;
* ``none``: no fault (the job must finish, exit 0).

A rank that receives the flight recorder's verdict catches it (``debug.OutOfStepError``), as
a recovery handler would: it writes what the error names to ``outdir/verdict-{r}.json`` and
exits with ``debug.FLIGHT_EXIT_CODE`` (75, restart the job).
Each rank writes the last step it completed to ``outdir/done-{r}``.

``FAULTS_DEVICE=cuda`` in the environment runs the job on NCCL, one GPU per rank (the GPU
check, ``benchmarks/gpu_check.py``); the default is gloo on the CPU.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from datetime import timedelta

FAULTS = (
    "skip_all_gather",
    "other_collective",
    "sleep",
    "exit",
    "kill",
    "raise_forward",
    "raise_backward",
    "raise_in_collective",
    "kill_in_save",
    "extra_forward",
    "skip_step",
    "blocked",
    "none",
)
STEPS = 4
STEPS_FOR = {"skip_step": 6}  # room to show that it is caught at once, not at the end
FAULT_STEP = 2


def _mark_fault(outdir: str) -> None:
    with open(os.path.join(outdir, "fault_time"), "w") as f:
        f.write(repr(time.time()))


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("blocks", nn.Sequential(*[nn.Linear(32, 32) for _ in range(2)]))
    model.add_module("head", nn.Linear(32, 4))
    return model


def _device() -> str:
    return os.environ.get("FAULTS_DEVICE", "cpu")


def worker(rank: int, world: int, port: int, fault: str, outdir: str, timeout: float) -> None:
    os.environ["DTENSOR_COLLECTIVE_TIMEOUT"] = repr(timeout)
    with open(os.path.join(outdir, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    logging.basicConfig(
        filename=os.path.join(outdir, f"rank{rank}.log"),
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        force=True,
    )
    import torch
    import torch.distributed as dist

    from dtensor import debug

    torch.set_num_threads(1)
    backend = "nccl" if _device() == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if port == 0:  # under torchrun: env://
        dist.init_process_group(backend, timeout=timedelta(seconds=60))
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
    # under torchrun (an elastic launcher) the job opts in to the grace policy: a process
    # that received a verdict ends at exit without waiting for the interrupted collective
    debug.set_collective_timeout(timeout, grace=30.0 if port == 0 else None)
    try:
        _train(rank, world, fault, outdir, timeout)
    except debug.OutOfStepError as e:  # what a recovery handler does: record, clean up, end
        logging.getLogger("tests._faults").error("rank %d: caught OutOfStepError: %s", rank, e)
        _write_verdict(e, os.path.join(outdir, f"verdict-{rank}.json"))
        logging.shutdown()
        sys.exit(debug.FLIGHT_EXIT_CODE)
    except BaseException:
        logging.getLogger("tests._faults").exception("rank %d: the step raised", rank)
        raise
    dist.destroy_process_group()


def _write_verdict(e, path: str) -> None:
    import json

    fields = {k: getattr(e, k) for k in ("rank", "group", "collective", "module", "report")}
    with open(path, "w") as f:
        json.dump(fields, f)


def _train(rank: int, world: int, fault: str, outdir: str, timeout: float) -> None:
    import torch

    from device_mesh import init_device_mesh
    from dtensor import debug
    from fsdp2 import fully_shard

    job = _Job(rank, world, fault, outdir, timeout)
    mesh = init_device_mesh(job.device, (world,), mesh_dim_names=("dp",))
    model = _model().to(job.device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)).to(job.device)
    for step in range(1, STEPS_FOR.get(fault, STEPS) + 1):
        if fault == "skip_step":
            if job.skips(step, model):
                continue
            debug.new_step(step)
        job.arm(step, model, x)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with open(os.path.join(outdir, f"done-{rank}"), "w") as f:
            f.write(str(step))
        if step == FAULT_STEP:
            job.collective_outside_fsdp(mesh)
        if step in (1, 3):  # the same checkpoint id: step 3's save replaces step 1's
            job.save(step, model)


class _Job:
    """One rank's fault (or none) and the steps around it."""

    def __init__(self, rank: int, world: int, fault: str, outdir: str, timeout: float) -> None:
        self.rank, self.world, self.fault, self.outdir = rank, world, fault, outdir
        self.timeout = timeout
        self.faulty = rank == 1
        self.device = _device()

    def _slow_blocks(self, model, seconds: float) -> None:
        """Every rank computes a while per block (a real step's pace, slower than the
        watchdog's poll); gloo aborts a rank outright once mismatched sizes meet."""
        for block in model.blocks:
            block.register_forward_pre_hook(lambda m, a: time.sleep(seconds))

    def skips(self, step: int, model) -> bool:
        """``skip_step``: whether this rank skips ``step`` whole."""
        if step != FAULT_STEP:
            return False
        self._slow_blocks(model, self.timeout / 4)
        if self.faulty:
            _mark_fault(self.outdir)
        return self.faulty

    def arm(self, step: int, model, x) -> None:
        """Inject this job's fault before ``step``'s forward, if it is due."""
        import fsdp2._collectives as C

        fault, outdir = self.fault, self.outdir
        if step == FAULT_STEP and fault == "skip_all_gather":
            self._slow_blocks(model, self.timeout / 2)
            if self.faulty:
                _skip_one_all_gather(C, outdir)
        if step == FAULT_STEP and fault == "blocked":
            _block(self.faulty, outdir, self.timeout)
        if not (self.faulty and step == FAULT_STEP):
            return
        if fault in ("exit", "kill", "raise_forward"):
            model.blocks[1].register_forward_pre_hook(lambda m, a: _die(fault, outdir))
        elif fault == "raise_backward":
            model.blocks[0].register_full_backward_pre_hook(lambda m, g: _die(fault, outdir))
        elif fault == "raise_in_collective":
            _raise_in_wait(C, outdir)
        elif fault == "sleep":
            _mark_fault(outdir)
            time.sleep(3 * self.timeout)
        elif fault == "extra_forward":
            _mark_fault(outdir)
            model(x)

    def collective_outside_fsdp(self, mesh) -> None:
        """A DTensor collective; ``other_collective``'s rank issues an all-reduce of the same
        bytes where the others all-gather."""
        import torch

        from dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor

        t = distribute_tensor(torch.arange(8.0 * self.world, device=self.device), mesh, [Shard(0)])
        if self.faulty and self.fault == "other_collective":
            _mark_fault(self.outdir)
            p = DTensor.from_local(t.to_local().clone(), mesh, [Partial()], run_check=False)
            p.redistribute(mesh, [Replicate()]).to_local()
        else:
            t.redistribute(mesh, [Replicate()]).to_local()

    def save(self, step: int, model) -> None:
        """Save to ``outdir/ckpt``; rank 0 writes the full values it expects to load back."""
        import torch

        from dtensor import checkpoint as dcp

        if self.faulty and self.fault == "kill_in_save" and step == 3:
            _kill_inside_save(self.outdir)
        sd = {"model": model.state_dict()}
        dcp.save(sd, checkpoint_id=os.path.join(self.outdir, "ckpt"))
        full = {k: v.full_tensor() for k, v in sd["model"].items()}
        if self.rank == 0:
            torch.save(full, os.path.join(self.outdir, f"expected-{step}.pt"))


def _block(faulty: bool, outdir: str, timeout: float) -> None:
    """Rank 1 sleeps; the others wait for it where no verdict can reach them."""
    import torch
    import torch.distributed as dist

    from dtensor import debug

    debug.set_collective_timeout(timeout, grace=1.0)
    if faulty:
        _mark_fault(outdir)
        time.sleep(30.0)
        return
    t = torch.ones(4, device=_device())
    debug.note_collective("all_reduce", None, t.numel() * t.element_size())
    dist.all_reduce(t)  # synchronous: the wait is inside the backend


def _die(fault: str, outdir: str):
    _mark_fault(outdir)
    if fault == "exit":
        os._exit(3)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault: {fault}")


def _skip_one_all_gather(C, outdir: str) -> None:
    """The next staged all-gather of ``blocks.0`` is not issued: this rank's row stands in
    for every rank's (the peers' all-gather of blocks.0 pairs with this rank's of blocks.1)."""
    from dtensor import _flight

    real = C.all_gather_rows

    def skipped(rows_in, group, group_size, **kwargs):
        if _flight.current_scope() != "fsdp blocks.0":
            return real(rows_in, group, group_size, **kwargs)
        C.all_gather_rows = real
        _mark_fault(outdir)
        from dtensor.comm import Pending

        return Pending.ready(rows_in[:1].expand(group_size, -1).clone())

    C.all_gather_rows = skipped


def _raise_in_wait(C, outdir: str) -> None:
    """The next staged all-gather is issued, then its wait raises."""
    real = C.all_gather_rows

    def failing(rows_in, group, group_size, **kwargs):
        C.all_gather_rows = real
        pending = real(rows_in, group, group_size, **kwargs)

        class Broken:
            def wait(self):
                _mark_fault(outdir)
                raise RuntimeError("injected fault: inside a collective")

        del pending
        return Broken()

    C.all_gather_rows = failing


def _kill_inside_save(outdir: str) -> None:
    """SIGKILL this rank inside the next save, once its shard file is written."""
    from dtensor.checkpoint import api

    real = api._write_my_file

    def killed(*args, **kwargs):
        out = real(*args, **kwargs)
        _mark_fault(outdir)
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    api._write_my_file = killed


if __name__ == "__main__":  # under torchrun: python -m tests._faults FAULT OUTDIR TIMEOUT
    fault, outdir, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, fault, outdir, timeout)
    if fault != "none" and int(os.environ["RANK"]) == 1:
        sys.exit(0)
