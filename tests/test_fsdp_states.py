"""fully_shard's two state machines (``fsdp2/_lifecycle.py``): the states a training step
visits, and the error a wrong move raises.

Each ``FSDPState`` moves its ``TrainingState`` and each ``FSDPParamGroup`` its
``ShardedState`` through one method per move that checks where it comes from. A training
step visits IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE for every
module; a wrong move raises ``FSDPStateError`` naming the module and both states - from the
public API when ``module.reshard()`` is called while the module computes.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from examples.gpt import gpt_loss
from fsdp2._lifecycle import FSDPStateError, ShardedState, TrainingState
from fsdp2._param_group import FSDPParamGroup
from fsdp2._state import FSDPState
from tests.harness import run_on_ranks
from tests.test_fsdp_runtime import _batch, _sharded


class _Moves:
    """Records every move of the training and memory states, per module, as ``FROM->TO``."""

    def __init__(self) -> None:
        self.training: dict[str, list[str]] = {}
        self.memory: dict[str, list[str]] = {}
        self._saved = (FSDPState._move, FSDPParamGroup._check)

    def __enter__(self):
        state_move, group_check = self._saved
        moves = self

        def record_training(state, allowed, target):
            before = state.training_state
            state_move(state, allowed, target)
            moves.training.setdefault(state.label, []).append(f"{before.name}->{target.name}")

        def record_memory(group, allowed, target):
            group_check(group, allowed, target)
            moves.memory.setdefault(group.owner.label, []).append(
                f"{group.state.name}->{target.name}"
            )

        FSDPState._move, FSDPParamGroup._check = record_training, record_memory
        return self

    def __exit__(self, *exc) -> None:
        FSDPState._move, FSDPParamGroup._check = self._saved


STEP = ["IDLE->FORWARD", "FORWARD->IDLE", "IDLE->PRE_BACKWARD"]
STEP += ["PRE_BACKWARD->POST_BACKWARD", "POST_BACKWARD->IDLE"]
GATHER = ["SHARDED->UNSHARDING", "UNSHARDING->UNSHARDED"]


def _step_states(reshard_after_forward):
    model = _sharded(reshard_after_forward=reshard_after_forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch()
    for _ in range(2):
        with _Moves() as moves:
            gpt_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        labels = ["'root'", "'blocks.0'", "'blocks.1'"]
        # every module, the root included (its post-backward runs from the final callback,
        # its inputs carrying no gradient), passes through POST_BACKWARD
        assert moves.training == {label: STEP for label in labels}, moves.training
        if reshard_after_forward is None:  # blocks reshard after forward, the root keeps
            block = [*GATHER, "UNSHARDED->SHARDED", *GATHER, "UNSHARDED->SHARDED"]
            expected = {"'root'": [*GATHER, "UNSHARDED->SHARDED"]}
            expected |= {label: block for label in labels[1:]}
        else:  # 2: every group keeps the rows of 2 ranks and re-gathers from them
            kept = ["UNSHARDED->SHARDED_POST_FORWARD", "SHARDED_POST_FORWARD->UNSHARDING"]
            expected = {
                label: [*GATHER, *kept, GATHER[1], "UNSHARDED->SHARDED"] for label in labels
            }
        assert moves.memory == expected, moves.memory
        for m in (model, *model.blocks):
            assert m._fsdp.training_state is TrainingState.IDLE
            assert m._fsdp.group.state is ShardedState.SHARDED


@pytest.mark.parametrize("ranks,reshard_after_forward", [(2, None), (4, 2)], ids=["default", "k=2"])
def test_a_training_step_visits_the_expected_states(ranks, reshard_after_forward):
    run_on_ranks(ranks, _step_states, reshard_after_forward=reshard_after_forward)


def _check_error(err: FSDPStateError, module: str, current, target) -> None:
    assert (err.module, err.current, err.target) == (module, current, target), err
    assert isinstance(err, RuntimeError) and isinstance(err, AssertionError)
    text = str(err)
    assert module in text and str(current) in text and str(target) in text, text


def _reshard_while_computing():
    model = _sharded()
    x, y = _batch()
    block = model.blocks[0]
    # inside the block's forward (a pre-hook registered after fully_shard runs once the
    # block gathered its parameters): reshard() would free what the forward computes with
    handle = block.register_forward_pre_hook(lambda module, args: module.reshard())
    with pytest.raises(FSDPStateError) as info:
        gpt_loss(model, x, y)
    handle.remove()
    _check_error(info.value, "'blocks.0'", ShardedState.UNSHARDED, ShardedState.SHARDED)
    assert "while in TrainingState.FORWARD" in str(info.value), info.value

    # inside the block's backward, before its post-backward (a hook on its output)
    def hook_output(module, args, output):
        output.register_hook(lambda grad: module.reshard())

    handle = block.register_forward_hook(hook_output)
    loss = gpt_loss(model, x, y)  # the root resets the iteration the exception cut short
    with pytest.raises(FSDPStateError) as info:
        loss.backward()
    handle.remove()
    _check_error(info.value, "'blocks.0'", ShardedState.UNSHARDED, ShardedState.SHARDED)
    assert "while in TrainingState.PRE_BACKWARD" in str(info.value), info.value

    # after the forward (a forward hook registered after fully_shard) it is allowed
    handle = model.register_forward_hook(lambda module, args, output: module.reshard())
    gpt_loss(model, x, y).backward()
    handle.remove()
    assert model._fsdp.group.state is ShardedState.SHARDED
    for m in (model, *model.blocks):
        assert m._fsdp.training_state is TrainingState.IDLE
        assert all(p.grad is not None for p in m.parameters())


def test_reshard_while_the_module_computes_raises_naming_both_states():
    run_on_ranks(2, _reshard_while_computing)


def _wrong_moves():
    model = _sharded()
    x, y = _batch()
    gpt_loss(model, x, y).backward()
    state = model.blocks[1]._fsdp
    group = state.group
    with pytest.raises(FSDPStateError) as info:  # waiting for an all-gather never issued
        group._end_gather()
    _check_error(info.value, "'blocks.1'", ShardedState.SHARDED, ShardedState.UNSHARDED)
    with pytest.raises(FSDPStateError) as info:
        group._drop_kept_rows()
    _check_error(info.value, "'blocks.1'", ShardedState.SHARDED, ShardedState.SHARDED)
    with pytest.raises(FSDPStateError) as info:  # a post-backward without a pre-backward
        state._enter_post_backward()
    _check_error(info.value, "'blocks.1'", TrainingState.IDLE, TrainingState.POST_BACKWARD)
    with pytest.raises(FSDPStateError) as info:  # a post-forward outside any forward
        state._leave_forward()
    _check_error(info.value, "'blocks.1'", TrainingState.IDLE, TrainingState.IDLE)
    assert "a bug in fsdp2" in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))  # crosses process boundaries whole
    assert type(again) is FSDPStateError and str(again) == str(info.value)
    # a refused move changes nothing: the next step runs as usual
    gpt_loss(model, x, y).backward()
    assert state.training_state is TrainingState.IDLE and group.state is ShardedState.SHARDED


def test_a_wrong_move_names_the_module_and_both_states():
    run_on_ranks(2, _wrong_moves)


def _dtypes_once():
    calls = []
    saved = FSDPParamGroup._row_layout, FSDPParamGroup._grad_reduce_dtype

    def count(fn):
        def counted(self):
            calls.append(fn.__name__)
            return fn(self)

        return counted

    FSDPParamGroup._row_layout, FSDPParamGroup._grad_reduce_dtype = map(count, saved)
    try:
        model = _sharded()
        x, y = _batch()
        model.set_requires_gradient_sync(False)  # the no-sync loop reads the reduce dtype
        gpt_loss(model, x, y).backward()
        at_init = len(calls)
        assert at_init == 4 * 3, calls  # at lazy init: each group's buffer key, then its own
        model.set_requires_gradient_sync(True)
        gpt_loss(model, x, y).backward()
        assert len(calls) == at_init, calls  # a step computes none of them again
        model.double()  # a conversion computes them again, from the new dtypes
        assert len(calls) > at_init, calls
        assert all(m._fsdp.group.reduce_dtype is torch.float64 for m in (model, *model.blocks))
        gpt_loss(model, x, y).backward()
    finally:
        FSDPParamGroup._row_layout, FSDPParamGroup._grad_reduce_dtype = saved


def test_dtypes_and_layout_are_computed_at_lazy_init_only():
    run_on_ranks(2, _dtypes_once)
