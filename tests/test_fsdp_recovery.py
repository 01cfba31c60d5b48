"""After an exception inside forward or backward, training goes on as if it never happened.

A block raises in its forward, or a gradient hook raises in the middle of backward; the
user catches it and zeroes the gradients (the failed iteration's are discarded). The next
root forward must start from a clean state by itself - or after an explicit
``reset_iter_state()`` - and three more steps must equal the single-process reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gpt import gpt_loss
from fsdp2 import fully_shard
from fsdp2._lifecycle import ShardedState, TrainingState
from tests.harness import run_on_ranks
from tests.test_fsdp_parity import (
    PER_RANK,
    ROUTES,
    _batches,
    _build,
    _cfg,
    _compare,
    _on_route,
    _optimizer,
    _train,
)


class Boom(RuntimeError):
    pass


def _raise_in_forward(model):
    def hook(module, inputs, output):
        raise Boom("boom in forward")

    return model.blocks[1].register_forward_hook(hook)


def _raise_in_backward(model):
    def hook(module, inputs, output):
        def fail(grad):
            raise Boom("boom in backward")

        output.register_hook(fail)

    return model.blocks[0].register_forward_hook(hook)


def _recover(where: str, explicit: bool):
    cfg = _cfg()
    ws, rank = dist.get_world_size(), dist.get_rank()
    batches = _batches(ws, steps=3)
    ref = _build(cfg)
    ref_losses = _train(ref, batches, local=False)
    model = _build(cfg, fully_shard)
    opt = _optimizer(model)  # built before the failure, as a training loop does
    x, y = batches[0]
    x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
    handle = (_raise_in_forward if where == "forward" else _raise_in_backward)(model)
    with pytest.raises(Boom):
        gpt_loss(model, x, y).backward()
    handle.remove()
    if explicit:
        with pytest.raises(RuntimeError, match="call it on the root"):
            model.blocks[0].reset_iter_state()
        model.reset_iter_state()
    opt.zero_grad(set_to_none=True)  # the failed iteration's gradients are discarded
    losses = _train(model, batches, local=True, opt=opt)
    _compare(model, ref, losses, ref_losses)


@pytest.mark.parametrize("explicit", [False, True], ids=["automatic", "reset_iter_state"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("route", ROUTES)
def test_training_recovers_after_an_exception(where, explicit, route):
    run_on_ranks(2, _on_route, route=route, target=_recover, where=where, explicit=explicit)


def _no_grad_forwards_after_an_exception():
    model = _build(_cfg(), fully_shard)
    x = torch.randint(0, 67, (2, 3))
    handle = _raise_in_forward(model)
    with torch.no_grad(), pytest.raises(Boom):
        model(x)
    handle.remove()
    ctx = model._fsdp.ctx
    groups = len(ctx.states)
    for _ in range(3):
        with torch.no_grad():
            model(x)
        # one entry per fully_shard module per forward, not growing from one to the next
        assert len(ctx.pre_forward_order) == groups, ctx.pre_forward_order
    assert all(s.training_state is TrainingState.IDLE for s in ctx.states)
    # the blocks resharded after each forward; the root keeps its gathered parameters
    # (reshard_after_forward=False), as after any forward
    unsharded = [s.group.state is ShardedState.UNSHARDED for s in ctx.states]
    assert unsharded == [True] + [False] * (groups - 1)


def test_no_grad_forwards_start_clean_after_an_exception():
    run_on_ranks(2, _no_grad_forwards_after_an_exception)
