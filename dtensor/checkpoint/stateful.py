"""The ``Stateful`` protocol: objects that checkpoint through ``state_dict()`` /
``load_state_dict()`` (PyTorch's ``torch.distributed.checkpoint.stateful.Stateful``).

A top-level value of the state dict given to :func:`dtensor.checkpoint.save` or
:func:`~dtensor.checkpoint.load` that has both methods (an ``nn.Module``, an optimizer,
torchtitan's ``ModelWrapper`` / ``OptimizersContainer``, a data loader) is checkpointed
through them: save stores ``obj.state_dict()``; load fills a fresh ``obj.state_dict()`` in
place and then calls ``obj.load_state_dict(filled)``.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Stateful", "StatefulT"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state_dict)``.

    ``isinstance(obj, Stateful)`` checks only that both methods exist (a runtime-checkable
    ``Protocol``), as PyTorch's does; PyTorch's ``Stateful`` and this one accept the same
    objects.

    Example::

        >>> from dtensor.checkpoint.stateful import Stateful
        >>> class Counter:
        ...     def __init__(self): self.n = 0
        ...     def state_dict(self): return {"n": self.n}
        ...     def load_state_dict(self, sd): self.n = sd["n"]
        >>> isinstance(Counter(), Stateful)
        True
        >>> dcp.save({"counter": Counter(), "model": model}, checkpoint_id="ckpt/1")
    """

    def state_dict(self) -> dict[str, Any]:
        """The state to checkpoint; also called by ``load`` to get the containers to fill."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict`` (called by ``load`` with the filled state dict)."""
        ...


StatefulT = TypeVar("StatefulT", bound=Stateful)
