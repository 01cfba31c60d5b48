"""``parallelize_transformer``: tensor parallelism, activation checkpointing, per-block
compile and FSDP/HSDP applied to a transformer in the order that composes (torchtitan's).

The order matters:

1. tensor parallelism first, so its DTensor parameters exist when FSDP shards them again;
2. activation checkpointing around each block, so a block's recomputation in backward runs
   the block's own call (and FSDP's hooks see it);
3. ``torch.compile`` of each block (when asked), inside FSDP's hooks;
4. ``fully_shard`` on each block, then on the root.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from device_mesh import DeviceMesh, as_device_mesh
from fsdp2.api import MixedPrecisionPolicy
from fsdp2.fully_shard import fully_shard

logger = logging.getLogger(__name__)
_API = "parallelize_transformer"
_DIMS = ("dp_replicate", "dp_shard", "dp", "tp")


def parallelize_transformer(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    tp_plan: dict | None = None,
    blocks=None,
    activation_checkpointing: bool = False,
    compile: bool | str = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """Lay ``model`` out over ``mesh`` by its dim names; returns ``model``.

    Mesh dims (any subset, in this order): ``"dp_replicate"`` and ``"dp_shard"`` (HSDP), or
    ``"dp"`` / ``"dp_shard"`` alone (FSDP), and ``"tp"`` (tensor parallelism with
    ``tp_plan``, a ``parallelize_module`` plan). ``blocks`` are the transformer blocks
    (default: ``model.blocks`` or ``model.layers``); each is checkpointed, compiled and
    sharded on its own. ``compile=True`` compiles each block with ``torch.compile``'s
    default backend; a string names another backend (``"aot_eager"``). With a "tp" dim the
    planned linears run eagerly between the compiled pieces of a block (docs/compile.md).

    Raises:
        ValueError: an unknown dim name, a "tp" dim without a plan, or - when the model's
            config (``model.cfg`` / ``model.config``) names them - heads or width not
            divisible by the tensor-parallel size. Raised before anything changes.

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> parallelize_transformer(model, mesh, tp_plan=tp_plan())
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    """
    mesh = _named_mesh(mesh)
    names = mesh.mesh_dim_names
    blocks = _blocks(model, blocks)
    tp_size = _tp_size(model, mesh, tp_plan)
    # 1. tensor parallelism
    if tp_size > 1:
        from dtensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], tp_plan)
    # 2-3. activation checkpointing and compile, per block
    for block in blocks:
        _wrap_block(block, activation_checkpointing, compile)
    # 4. FSDP / HSDP
    dp = tuple(n for n in names if n != "tp")
    if dp:
        policy = mp_policy or MixedPrecisionPolicy()
        _shard(model, blocks, mesh[dp], policy, reshard_after_forward)
    logger.info(
        "%s: mesh %s, tp=%d, %d blocks", _API, dict(zip(names, mesh.shape)), tp_size, len(blocks)
    )
    return model


def _named_mesh(mesh) -> DeviceMesh:
    """``mesh`` as our DeviceMesh, its dims named from ``_DIMS``."""
    mesh = as_device_mesh(mesh, api=_API)
    names = mesh.mesh_dim_names
    if names is None or any(n not in _DIMS for n in names):
        raise ValueError(
            f"{_API}: mesh dims must be named from {_DIMS}, got {names}. Build it with "
            'init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")).'
        )
    return mesh


def _tp_size(model: nn.Module, mesh: DeviceMesh, tp_plan) -> int:
    """The size of the "tp" dim (1 without one); a larger one needs a plan and a model
    whose config divides by it."""
    names = mesh.mesh_dim_names
    tp_size = mesh.size(names.index("tp")) if "tp" in names else 1
    if tp_size > 1:
        if not tp_plan:
            raise ValueError(f"{_API}: the mesh has a 'tp' dim of size {tp_size} but no tp_plan.")
        _check_divisible(model, tp_size)
    return tp_size


def _wrap_block(block: nn.Module, activation_checkpointing: bool, compile: bool | str) -> None:
    """Checkpoint ``block`` and compile its forward, as asked."""
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        checkpoint(block)
    if compile:  # the forward only: FSDP's and checkpointing's hooks stay eager
        kw = {"backend": compile} if isinstance(compile, str) else {}
        block.forward = torch.compile(block.forward, **kw)


def _shard(model, blocks, dp_mesh: DeviceMesh, mp_policy, reshard_after_forward) -> None:
    """``fully_shard`` on each block, then on the root."""
    for block in blocks:
        fully_shard(
            block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def _blocks(model: nn.Module, blocks) -> list[nn.Module]:
    if blocks is None:
        for attr in ("blocks", "layers"):
            found = getattr(model, attr, None)
            if isinstance(found, (nn.ModuleList, nn.ModuleDict)):
                blocks = found
                break
        else:
            raise ValueError(
                f"{_API}: found no model.blocks or model.layers; pass blocks=[...] (the "
                "transformer blocks)."
            )
    if isinstance(blocks, nn.ModuleDict):
        blocks = blocks.values()
    return list(blocks)


def _check_divisible(model: nn.Module, tp: int) -> None:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    if cfg is None:
        return
    names = ("dim", "hidden_size", "n_heads", "num_heads", "num_attention_heads",
             "num_key_value_heads", "n_kv_heads")  # fmt: skip
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(
                f"{_API}: {name}={value} in the model config is not divisible by the "
                f"tensor-parallel size {tp}; attention and MLP split by whole heads and "
                "columns. Pick a tp size that divides it."
            )
