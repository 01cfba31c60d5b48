"""State-dict hooks: ``state_dict()`` and ``load_state_dict()`` see the sharded DTensors.

Outside forward and backward every module already registers its sharded parameters
(``_param_group.py``). These hooks cover the rest, on every module that registers a managed
parameter:

* saving while a module's unsharded parameters are registered (from inside forward, say):
  the sharded parameters are swapped in for the save and swapped back after it;
* loading: unsharded copies kept from before (``reshard_after_forward=False``, ``unshard()``)
  would go stale, so the group is resharded first; a load from inside forward or backward is
  an error, since autograd has already saved the old values.
"""

from __future__ import annotations

from torch import nn


def add_location(module: nn.Module, attr: str, fsdp_param) -> None:
    """Record that ``module.attr`` is managed by ``fsdp_param`` and hook the module once."""
    locations = module.__dict__.setdefault("_fsdp_locations", {})
    if not locations:
        module.register_state_dict_pre_hook(_swap_in_sharded)
        module.register_state_dict_post_hook(_swap_back)
        module.register_load_state_dict_pre_hook(_reshard_before_load)
    locations[attr] = fsdp_param


def _swap_in_sharded(module, prefix, keep_vars) -> None:
    swapped = []
    for attr, fp in module.__dict__["_fsdp_locations"].items():
        current = module._parameters.get(attr)
        if current is not None and current is not fp.sharded_param:
            module._parameters[attr] = fp.sharded_param
            swapped.append((attr, current))
    module.__dict__["_fsdp_swapped"] = swapped


def _swap_back(module, state_dict, prefix, local_metadata) -> None:
    for attr, current in module.__dict__.pop("_fsdp_swapped", []):
        module._parameters[attr] = current


def _reshard_before_load(module, state_dict, prefix, *args) -> None:
    for fp in module.__dict__["_fsdp_locations"].values():
        group = fp.group
        if group is None:
            continue
        if group.registered_unsharded:
            raise RuntimeError(
                f"load_state_dict: {type(module).__name__} is inside its forward or backward "
                f"(parameter {fp.fqn!r} is unsharded for compute). Load weights between "
                "steps, after backward and the optimizer step."
            )
        group.discard_unsharded()
