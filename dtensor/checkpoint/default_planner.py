"""``DefaultSavePlanner`` / ``DefaultLoadPlanner``: PyTorch's default planners, by name and
options, for this library's save and load.

Code written for ``torch.distributed.checkpoint`` passes ``planner=DefaultSavePlanner()``
(accelerate does). The options are honoured where they mean something here, and a value
that cannot be is a ``ValueError`` naming it:

=========================  =========================================================
``flatten_state_dict``     True only: nested dicts are always flattened to dotted keys
``flatten_sharded_tensors``  accepted either way: this library has no ``ShardedTensor``
``dedup_replicated_tensors``  deprecated in PyTorch with no effect; same here (logged)
``dedup_save_to_lowest_rank``  honoured: a replicated block is written by its lowest rank
``enable_plan_caching``    accepted: planning here is box maths each time (no cache)
``allow_partial_load``     honoured: state-dict keys the checkpoint lacks are left alone
=========================  =========================================================

PyTorch's own ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` (exactly those classes) are
read the same way, so ``from torch.distributed.checkpoint.default_planner import ...``
keeps working. A planner that overrides a planning step is refused: this library never
calls those steps, and ignoring an override would save or load something else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dtensor.checkpoint.planner import LoadPlanner, SavePlanner

logger = logging.getLogger(__name__)

_SAVE_STEPS = ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan",
               "resolve_data", "lookup_object", "transform_object")  # fmt: skip
_LOAD_STEPS = ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan",
               "load_bytes", "resolve_bytes", "resolve_tensor", "commit_tensor",
               "lookup_tensor", "transform_tensor")  # fmt: skip


def _not_driven(self, *args, **kwargs):
    raise NotImplementedError(
        f"{type(self).__name__}: dtensor.checkpoint's save and load plan by themselves and "
        "never call the planner's steps; pass the planner to dcp.save / dcp.load"
    )


class DefaultSavePlanner(SavePlanner):
    """The default save planner, with PyTorch's constructor (see the module's table).

    Example::

        >>> from dtensor import checkpoint as dcp
        >>> dcp.save({"model": model.state_dict()},
        ...          storage_writer=dcp.FileSystemWriter("ckpt/1"),
        ...          planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
    ) -> None:
        if flatten_state_dict is not True:
            raise ValueError(
                f"DefaultSavePlanner(flatten_state_dict={flatten_state_dict!r}): this library "
                "always flattens nested dicts to dotted keys (its format stores tensors only "
                "as flat safetensors entries); drop the argument"
            )
        if dedup_replicated_tensors is not None:
            logger.warning("DefaultSavePlanner: dedup_replicated_tensors has no effect "
                           "(replicated blocks are always written once); drop the argument")  # fmt: skip
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.dedup_save_to_lowest_rank = bool(dedup_save_to_lowest_rank)
        self.enable_plan_caching = bool(enable_plan_caching)

    set_up_planner = create_local_plan = create_global_plan = _not_driven
    finish_plan = resolve_data = _not_driven


class DefaultLoadPlanner(LoadPlanner):
    """The default load planner, with PyTorch's constructor (see the module's table).

    ``allow_partial_load=True`` leaves state-dict keys the checkpoint lacks as they are
    (PyTorch's meaning), and, as PyTorch always does, ignores checkpoint keys the state
    dict lacks: it is ``load(..., strict=False)``. With the default (False) a key the
    checkpoint lacks is an error, as in PyTorch, and so is (unlike PyTorch) a checkpoint
    key under one of the state dict's top-level names that the state dict lacks.

    Example::

        >>> sd = {"model": model.state_dict()}   # may hold keys the checkpoint does not
        >>> dcp.load(sd, storage_reader=dcp.FileSystemReader("ckpt/1"),
        ...          planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
    ) -> None:
        if flatten_state_dict is not True:
            raise ValueError(
                f"DefaultLoadPlanner(flatten_state_dict={flatten_state_dict!r}): this library "
                "always matches flattened dotted keys; drop the argument"
            )
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.allow_partial_load = bool(allow_partial_load)

    set_up_planner = create_local_plan = create_global_plan = finish_plan = _not_driven
    load_bytes = resolve_tensor = commit_tensor = _not_driven


@dataclass(frozen=True)
class SaveOptions:
    """What a save planner asks of this library's save."""

    lowest_rank: bool = False


def save_options(planner) -> SaveOptions:
    """Check ``planner`` (given to ``save``) and return what it asks for; refuse the rest.

    Example::

        >>> save_options(DefaultSavePlanner(dedup_save_to_lowest_rank=True)).lowest_rank
        True
    """
    if planner is None:
        return SaveOptions()
    _check_planner(planner, DefaultSavePlanner, "DefaultSavePlanner", _SAVE_STEPS, "save")
    if getattr(planner, "flatten_state_dict", True) is not True:
        raise ValueError(
            "planner: flatten_state_dict=False is not supported (this library always flattens "
            "nested dicts); use DefaultSavePlanner() with the default"
        )
    return SaveOptions(lowest_rank=bool(getattr(planner, "dedup_save_to_lowest_rank", False)))


def load_allows_partial(planner) -> bool:
    """Check ``planner`` (given to ``load``); whether it asks for ``allow_partial_load``.

    Example::

        >>> load_allows_partial(DefaultLoadPlanner(allow_partial_load=True))
        True
    """
    if planner is None:
        return False
    _check_planner(planner, DefaultLoadPlanner, "DefaultLoadPlanner", _LOAD_STEPS, "load")
    if getattr(planner, "flatten_state_dict", True) is not True:
        raise ValueError(
            "planner: flatten_state_dict=False is not supported (this library always matches "
            "flattened keys); use DefaultLoadPlanner() with the default"
        )
    return bool(getattr(planner, "allow_partial_load", False))


def _check_planner(planner, ours: type, name: str, steps: tuple, verb: str) -> None:
    theirs = _torch_class(name)
    if type(planner) is theirs:
        return  # PyTorch's default planner, not a subclass: its options are read
    if not isinstance(planner, ours):
        raise TypeError(
            f"planner={planner!r} ({type(planner).__module__}.{type(planner).__qualname__}) "
            f"cannot be used by dtensor.checkpoint.{verb}: it plans by itself and runs no "
            f"custom planner; pass planner=dtensor.checkpoint.{name}(...) or no planner"
        )
    overridden = [s for s in steps if getattr(type(planner), s, None) is not getattr(ours, s, None)]
    if overridden:
        raise TypeError(
            f"planner={type(planner).__qualname__} overrides {', '.join(overridden)}, which "
            f"dtensor.checkpoint.{verb} never calls (it plans by itself), so the override would "
            f"be ignored; transform the state dict before calling {verb} instead, or use "
            f"{name}(...) itself"
        )


def _torch_class(name: str):
    try:
        from torch.distributed.checkpoint import default_planner
    except ImportError:  # a torch built without distributed
        return None
    return getattr(default_planner, name, None)
