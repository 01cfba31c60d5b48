"""Catching an optimizer that holds parameters ``fully_shard`` replaced.

``fully_shard`` replaces every parameter with a new sharded one ([Note: replaced parameters]
in ``_param.py``). An optimizer built before the call still holds the originals: its
``step()`` would update tensors no module uses any more, and the model would silently not
train. One optimizer step pre-hook, installed by the first ``fully_shard`` call, looks for
replaced originals among an optimizer's parameters (an attribute read per parameter) and
raises before anything is updated.
"""

from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp2._param import replaced_by

_installed = False


def install_optimizer_check() -> None:
    """Register the global optimizer step pre-hook (once per process)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(check_optimizer)
        _installed = True


def check_optimizer(optimizer, args, kwargs) -> None:
    """Raise if ``optimizer`` holds parameters that fully_shard replaced."""
    stale = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = replaced_by(p)
            if owner is not None:
                stale.append(owner.fqn)
    if stale:
        shown = ", ".join(repr(n) for n in stale[:5]) + (" ..." if len(stale) > 5 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step: {len(stale)} of the optimizer's parameters "
            f"({shown}) were replaced by fully_shard and are no longer used by the model, so "
            "this step would train nothing. Build the optimizer after fully_shard, on "
            "model.parameters(). (If it was built after fully_shard, a module outside every "
            "fully_shard call still registers the replaced parameter, e.g. a tied weight: "
            "call fully_shard on a module that contains both uses.)"
        )
