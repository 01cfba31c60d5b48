"""``loss_parallel`` is per thread / context: a thread inside it changes nothing for a thread
outside it, nesting and exceptions restore what was there, and the backward of a loss
computed inside it is right on any thread ([Note: loss_parallel is per context])."""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from device_mesh import init_device_mesh
from dtensor import Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from dtensor.parallel import loss_parallel
from tests.harness import run_on_ranks

N, VOCAB = 6, 11  # 11 classes: uneven shards at 2 and 3 ranks


def _setup():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    full, target = torch.randn(N, VOCAB), torch.randint(0, VOCAB, (N,))
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target)
    ref.backward()

    def logits():
        return distribute_tensor(full.clone(), mesh, [Shard(1)]).requires_grad_()

    return mesh, target, ref, ref_logits.grad, logits


def _loss_parallel_stays_in_its_thread():
    mesh, target, ref, ref_grad, logits = _setup()
    entered, outside_done = threading.Event(), threading.Event()
    seen = {}

    def inside():
        try:
            with loss_parallel():
                entered.set()
                outside_done.wait(timeout=60)  # the main thread's loss runs while we are in
                x = logits()
                seen["logp"] = F.log_softmax(x, 1).placements
                with CommDebugMode() as comm:
                    loss = F.cross_entropy(x, target)
                    loss.backward()
                seen["inside"] = (loss.full_tensor(), x.grad.full_tensor(), x.grad.placements)
                seen["inside_comm"] = set(comm.get_comm_counts())
        except BaseException as e:  # reported by the main thread
            seen["error"] = e

    thread = threading.Thread(target=inside)
    thread.start()
    try:
        assert entered.wait(timeout=60)
        # Outside loss_parallel (this thread) while another thread is inside it: the
        # ordinary rules, i.e. the class dim gathered for the log-softmax.
        x = logits()
        assert F.log_softmax(x, 1).placements == (Replicate(),)
        with CommDebugMode() as comm:
            loss = F.cross_entropy(x, distribute_tensor(target, mesh, [Replicate()]))
            loss.backward()
        assert "all_gather" in comm.get_comm_counts(), comm.get_comm_counts()
        torch.testing.assert_close(loss.full_tensor(), ref)
        torch.testing.assert_close(x.grad.full_tensor(), ref_grad)
    finally:
        outside_done.set()
        thread.join(timeout=60)
    if "error" in seen:
        raise seen["error"]
    assert seen["logp"] == (Shard(1),)
    loss, grad, placements = seen["inside"]
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    assert placements == (Shard(1),)
    assert seen["inside_comm"] == {"all_reduce"}, seen["inside_comm"]


def _loss_parallel_nests_and_restores():
    mesh, target, ref, ref_grad, logits = _setup()
    x = logits()
    with loss_parallel():
        with loss_parallel():
            assert F.log_softmax(x, 1).placements == (Shard(1),)
        assert F.log_softmax(x, 1).placements == (Shard(1),)  # the outer block is still on
    assert F.log_softmax(x, 1).placements == (Replicate(),)
    with pytest.raises(RuntimeError, match="inside"), loss_parallel():
        raise RuntimeError("inside")
    assert F.log_softmax(x, 1).placements == (Replicate(),)
    # A loss computed inside, its backward run on another thread (as CUDA's autograd device
    # threads do) after the block ended: still the class-sharded backward.
    with loss_parallel():
        loss = F.cross_entropy(x, target)
    errors = []

    def backward():
        try:
            with CommDebugMode() as comm:
                loss.backward()
            assert set(comm.get_comm_counts()) == {"all_reduce"}, comm.get_comm_counts()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join(timeout=60)
    if errors:
        raise errors[0]
    assert x.grad.placements == (Shard(1),)
    torch.testing.assert_close(x.grad.full_tensor(), ref_grad)


def test_loss_parallel_stays_in_its_thread():
    run_on_ranks(2, _loss_parallel_stays_in_its_thread)


def test_loss_parallel_nests_restores_and_backward_runs_on_any_thread():
    run_on_ranks(2, _loss_parallel_nests_and_restores)
