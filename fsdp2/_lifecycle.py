"""The two state machines of the ``fully_shard`` runtime, and the error a wrong move raises.

``TrainingState`` is where one ``fully_shard`` call's modules are in a training step; its
``FSDPState`` (``_state.py``) moves it from its hooks. ``ShardedState`` is what memory one
call's parameters hold; its ``FSDPParamGroup`` (``_param_group.py``) moves it. Each move is
one method of its owner that first checks where it comes from (``check_move``), so a move
from anywhere else raises ``FSDPStateError`` naming the module and both states. The moves
(docs/fsdp2.md, "States"):

``TrainingState``, moved by ``FSDPState``:

    _enter_forward (pre-forward)          IDLE | POST_BACKWARD [1] | PRE_BACKWARD [2] -> FORWARD
    _leave_forward (post-forward, raised) FORWARD -> IDLE
    _enter_pre_backward (pre-backward)    IDLE | FORWARD [3] | POST_BACKWARD [4] -> PRE_BACKWARD
    _enter_post_backward (post-backward)  PRE_BACKWARD -> POST_BACKWARD
    _end_backward (end of backward)       POST_BACKWARD | IDLE | FORWARD [5] -> IDLE

[1] a forward run inside backward after the module's post-backward (reentrant activation
checkpointing); [2] left by a backward that raised (a recomputation inside a running backward
is no move: the state stays PRE_BACKWARD); [3] a backward run inside the module's forward
(``torch.autograd.grad`` there); [4] a module used twice whose first use's post-backward
already ran; [5] a list call ``fully_shard([a, b])`` whose forward ran only some modules. A
nested forward of a module already in FORWARD, and a second pre-backward, are no moves;
``reset_iter_state`` returns every state to IDLE from anywhere.

``ShardedState``, moved by ``FSDPParamGroup``:

    _begin_gather (issue the all-gather)  SHARDED | SHARDED_POST_FORWARD -> UNSHARDING
    _end_gather (wait for it)             UNSHARDING -> UNSHARDED
    _alias (nothing to gather)            SHARDED -> UNSHARDED
    _free (reshard)                       UNSHARDED -> SHARDED
    _free (reshard after forward, k)      UNSHARDED -> SHARDED_POST_FORWARD
    _drop_kept_rows                       SHARDED_POST_FORWARD -> SHARDED

One move is the user's to ask for and may be refused: ``module.reshard()`` while the module
computes (inside its forward, or inside its backward before its post-backward) would free
parameters autograd is reading, so it raises ``FSDPStateError`` (UNSHARDED to SHARDED,
naming the training state). Any other refusal is a bug in the runtime.
"""

from __future__ import annotations

import enum

import torch.distributed as dist


class TrainingState(enum.Enum):
    """Where a ``fully_shard`` call's modules are in a training step.

    Example:
        >>> model._fsdp.training_state        # between steps
        <TrainingState.IDLE: 'idle'>
    """

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class ShardedState(enum.Enum):
    """What memory a ``fully_shard`` group's parameters hold.

    ``SHARDED``: the shards only; ``UNSHARDING``: an all-gather in flight; ``UNSHARDED``: the
    gathered parameters, registered on the modules; ``SHARDED_POST_FORWARD``
    (``reshard_after_forward=k``): the shards plus the rows of ``k`` ranks kept for backward.

    Example:
        >>> model.blocks[0]._fsdp.group.state  # after a forward that resharded it
        <ShardedState.SHARDED: 'sharded'>
    """

    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"
    UNSHARDING = "unsharding"
    UNSHARDED = "unsharded"


class FSDPStateError(RuntimeError, AssertionError):
    """A ``fully_shard`` module was asked to move between states it cannot move between.

    The message names the module, the state it is in and the state it was asked to go to
    (also ``module``, ``current`` and ``target``). Raised for a call at the wrong time -
    ``module.reshard()`` inside that module's own forward or backward - and otherwise for a
    bug in the runtime (report it with the message). It is a ``RuntimeError`` and, as
    PyTorch's FSDP2 raises for its state checks, an ``AssertionError``.

    Example:
        >>> def reshard_too_early(module, args):
        ...     module.reshard()                   # inside the module's forward
        >>> block.register_forward_pre_hook(reshard_too_early)
        >>> model(x)
        FSDPStateError: [rank 0] fully_shard module 'blocks.0': cannot go from
        ShardedState.UNSHARDED to ShardedState.SHARDED while in TrainingState.FORWARD ...
    """

    def __init__(self, module: str, current: enum.Enum, target: enum.Enum, why: str = "") -> None:
        self.module, self.current, self.target, self.why = module, current, target, why
        rank = dist.get_rank() if dist.is_initialized() else 0
        super().__init__(
            f"[rank {rank}] fully_shard module {module}: cannot go from {current} to {target}"
            + (f" {why}" if why else "")
        )

    def __reduce__(self):  # picklable, so it crosses process boundaries whole
        return type(self), (self.module, self.current, self.target, self.why)


def check_move(module: str, current: enum.Enum, allowed: tuple, target: enum.Enum, why=""):
    """Raise ``FSDPStateError`` unless ``current`` is one of the states ``allowed`` to move
    to ``target``.

    Example:
        >>> check_move("'blocks.0'", ShardedState.SHARDED, (ShardedState.UNSHARDING,),
        ...            ShardedState.UNSHARDED)
        FSDPStateError: [rank 0] fully_shard module 'blocks.0': cannot go from
        ShardedState.SHARDED to ShardedState.UNSHARDED
    """
    if current not in allowed:
        raise FSDPStateError(module, current, target, why)
