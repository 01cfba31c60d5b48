"""Catching an optimizer that holds parameters ``fully_shard`` replaced, or gathered copies.

``fully_shard`` replaces every parameter with a new sharded one ([Note: replaced parameters]
in ``_param.py``). An optimizer built before the call still holds the originals: its
``step()`` would update tensors no module uses any more, and the model would silently not
train. Likewise an optimizer built while modules register their *unsharded* parameters
(after ``unshard()``, after a forward that keeps them, after an exception in backward): its
steps would update gathered copies that the next all-gather overwrites. One optimizer step
pre-hook, installed by the first ``fully_shard`` call, looks for either among an
optimizer's parameters (two attribute reads per parameter) and raises before anything is
updated.
"""

from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp2._param import replaced_by, unsharded_of

_installed = False


def install_optimizer_check() -> None:
    """Register the global optimizer step pre-hook (once per process)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(check_optimizer)
        _installed = True


def check_optimizer(optimizer, args, kwargs) -> None:
    """Raise if ``optimizer`` holds parameters that fully_shard replaced, or unsharded ones."""
    stale, gathered = [], []
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = replaced_by(p)
            if owner is not None:
                stale.append(owner.fqn)
            owner = unsharded_of(p)
            if owner is not None:
                gathered.append(owner.fqn)
    if gathered:
        shown = ", ".join(repr(n) for n in gathered[:5]) + (" ..." if len(gathered) > 5 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step: {len(gathered)} of the optimizer's parameters "
            f"({shown}) are fully_shard's unsharded (gathered) parameters, not the sharded "
            "ones it trains: the optimizer was built while the modules registered their "
            "gathered parameters (after unshard(), after a forward with "
            "reshard_after_forward=False or under no_grad, or after an exception in "
            "backward). Build the optimizer on model.parameters() right after fully_shard, "
            "before any forward (or after reshard() on every FSDPModule: for m in "
            "model.modules(): if isinstance(m, FSDPModule): m.reshard())."
        )
    if stale:
        shown = ", ".join(repr(n) for n in stale[:5]) + (" ..." if len(stale) > 5 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step: {len(stale)} of the optimizer's parameters "
            f"({shown}) were replaced by fully_shard and are no longer used by the model, so "
            "this step would train nothing. Build the optimizer after fully_shard, on "
            "model.parameters(). (If it was built after fully_shard, a module outside every "
            "fully_shard call still registers the replaced parameter, e.g. a tied weight: "
            "call fully_shard on a module that contains both uses. If parameters were "
            "assigned after fully_shard - load_state_dict(sd, assign=True) - build the "
            "optimizer after that load.)"
        )
