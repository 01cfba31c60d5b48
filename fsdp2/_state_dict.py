"""State-dict hooks: ``state_dict()`` and ``load_state_dict()`` see the sharded DTensors.

Modules register their unsharded parameters whenever these are gathered (after
``unshard()``, between forward and backward with ``reshard_after_forward=False``, during
backward), as in PyTorch's FSDP2. So, on every module that registers a managed parameter:

* saving swaps the sharded parameters in for the save and back after it: the state dict
  holds the shards in their original dtype, and nothing else changes - no memory is freed
  and no later all-gather is added. PyTorch's pre-hook reshards instead, which makes the
  next forward or backward gather again; a ``state_dict()`` called on some ranks only
  (rank 0 saving a checkpoint) would then put the ranks' collectives out of step. Here it
  cannot (a deliberate difference, docs/fsdp2.md);
* loading reshards first (the rows ``reshard_after_forward=int`` kept included), so the
  next forward gathers the loaded values; a load from inside a forward or backward is an
  error, since autograd has already saved the old values. After the load, parameters that
  ``load_state_dict(sd, assign=True)`` replaced are adopted as the new shards ([Note:
  assigned parameters] in ``_param.py``), as PyTorch's FSDP2 does in its load post-hook.
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
        module.register_load_state_dict_post_hook(_adopt_after_load)
    locations[attr] = fsdp_param


def _computing(group) -> bool:
    """Whether the group's modules are inside a forward or a running backward right now."""
    return group.owner.in_compute()


def _groups_of(module: nn.Module) -> list:
    groups = []
    for fp in module.__dict__["_fsdp_locations"].values():
        if fp.group is not None and all(fp.group is not g for g in groups):
            groups.append(fp.group)
    return groups


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
    for attr, fp in module.__dict__["_fsdp_locations"].items():
        first_module, first_attr = fp.locations[0]
        if first_module is module and first_attr == attr and fp.group is not None:
            if not fp.group.initialized:  # lazy init names it from the root
                fp.fqn = prefix + attr  # the key it loads from, for messages
    for group in _groups_of(module):
        if _computing(group):
            fp = next(p for p in group.params if p.locations)
            raise RuntimeError(
                f"load_state_dict: {type(module).__name__} is inside its forward or backward "
                f"(parameter {fp.fqn!r} is unsharded for compute). Load weights between "
                "steps, after backward and the optimizer step."
            )
        group.discard_unsharded()


def _adopt_after_load(module, incompatible_keys) -> None:
    """``load_state_dict(..., assign=True)`` registered new sharded parameters on ``module``:
    adopt them (only this module's: the modules after it in the load are not loaded yet)."""
    for attr, fp in module.__dict__["_fsdp_locations"].items():
        if fp.group is not None:
            fp.group.adopt_assigned(fp, (module, attr))
