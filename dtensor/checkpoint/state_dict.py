"""State-dict helpers: model and optimizer state keyed by parameter path, sharded or full.

``torch.optim`` keys its state by integer position, which changes when the model is wrapped
differently; checkpoints key it by the parameter's path (``"blocks.0.attn.q.weight"``) so a
state saved under one layout loads under another. ``StateDictOptions`` asks for full tensors
(gathered, on rank 0 only with ``cpu_offload``) or, when setting, for a full state dict held
by rank 0 alone to be broadcast into the sharded model.

Nothing here imports ``fsdp2``: the helpers work on any module whose parameters are
DTensors or plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dtensor import debug
from dtensor.checkpoint._comm import Group
from dtensor.checkpoint._flatten import decode_value, encode_value
from dtensor.checkpoint._reshard import relative_slices
from dtensor.checkpoint.errors import CheckpointError
from dtensor.tensor import DTensor


@dataclass(frozen=True)
class StateDictOptions:
    """How the state-dict helpers shape what they return or accept.

    - ``full_state_dict``: full tensors instead of this rank's shards.
    - ``cpu_offload``: move tensors to CPU; with ``full_state_dict``, only rank 0 keeps them
      (other ranks get an empty dict), as PyTorch does.
    - ``broadcast_from_rank0``: when setting, rank 0 alone holds a full state dict (the others
      may pass ``{}``); each tensor is broadcast and every rank keeps its own block.
    - ``strict``: missing or unexpected keys are an error.

    Example::

        >>> opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        >>> full = get_model_state_dict(model, options=opts)   # {} on ranks other than 0
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    broadcast_from_rank0: bool = False
    strict: bool = True


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict:
    """The model's state dict: DTensor shards by default, full tensors when asked.

    Example::

        >>> sd = get_model_state_dict(model)          # {"blocks.0.attn.q.weight": DTensor, ...}
    """
    options = options or StateDictOptions()
    sd = _converted(dict(model.state_dict()), options)  # every rank joins the gathers
    return {} if _kept_by_rank0_only(options) else sd


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                             options: StateDictOptions | None = None) -> dict:  # fmt: skip
    """``{"state": {param_path: {...}}, "param_groups": [{..., "params": [param_path, ...]}]}``.

    An optimizer that has not stepped gets its state created first (zeros, step 0), so the
    result has the structure a checkpoint load needs. Example::

        >>> osd = get_optimizer_state_dict(model, opt)
        >>> sorted(osd["state"]["blocks.0.attn.q.weight"])
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    options = options or StateDictOptions()
    _ensure_state(optimizer)
    paths = _param_paths(model, optimizer)
    native = optimizer.state_dict()
    state = {paths[i]: _converted(s, options) for i, s in native["state"].items()}
    groups = [dict(g, params=[paths[i] for i in g["params"]]) for g in native["param_groups"]]
    if _kept_by_rank0_only(options):
        return {}
    return {"state": state, "param_groups": groups}


def set_model_state_dict(model: nn.Module, model_state_dict: dict, *,
                         options: StateDictOptions | None = None):  # fmt: skip
    """Load ``model_state_dict`` (shards, full tensors, or rank 0's full tensors to broadcast).

    Returns ``(missing_keys, unexpected_keys)`` like ``load_state_dict``. Example::

        >>> set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    """
    options = options or StateDictOptions()
    current = model.state_dict()
    if options.broadcast_from_rank0:
        model_state_dict = _broadcast_full(current, model_state_dict, options.strict)
    if options.full_state_dict or options.broadcast_from_rank0:
        model_state_dict = {k: _shard_like(v, current[k]) if k in current else v
                            for k, v in model_state_dict.items()}  # fmt: skip
    return model.load_state_dict(model_state_dict, strict=options.strict)


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, optim_state_dict: dict,
                             *, options: StateDictOptions | None = None) -> None:  # fmt: skip
    """Load a path-keyed optimizer state dict (as :func:`get_optimizer_state_dict` returns).

    Full tensors (``full_state_dict``) are cut to each parameter's shard. Example::

        >>> set_optimizer_state_dict(model, opt, osd)
    """
    options = options or StateDictOptions()
    _ensure_state(optimizer)
    paths = _param_paths(model, optimizer)
    index = {p: i for i, p in paths.items()}
    params = _parameters_at_rest(model)
    if options.broadcast_from_rank0:
        current = get_optimizer_state_dict(model, optimizer)
        optim_state_dict = _broadcast_optim(current, optim_state_dict)
    unknown = [p for p in optim_state_dict.get("state", {}) if p not in index]
    if unknown and options.strict:
        raise CheckpointError(f"optimizer state for parameters the model does not have: {unknown}")
    state = {}
    for path, entry in optim_state_dict.get("state", {}).items():
        if path not in index:
            continue
        like = params[path]
        state[index[path]] = {
            k: _shard_like(v, like) if _is_param_shaped(v, like) else v for k, v in entry.items()
        }
    groups = [
        dict(g, params=[index[p] for p in g["params"]]) for g in optim_state_dict["param_groups"]
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _parameters_at_rest(model: nn.Module) -> dict[str, nn.Parameter]:
    """Path -> parameter, as the optimizer holds them. A sharded module may register
    gathered copies for a while (after ``unshard()``, or a forward that keeps them), and
    ``named_parameters()`` then lists those; ``state_dict(keep_vars=True)`` gives the
    parameters at rest (fully_shard's state-dict hooks swap the shards in), so its
    parameters win. No tensor is copied."""
    params = dict(model.named_parameters())
    seen = {id(p) for p in params.values()}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, nn.Parameter) and (name in params or id(t) not in seen):
            params[name] = t
            seen.add(id(t))
    return params


def _param_paths(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Optimizer position -> parameter path, in ``optimizer.state_dict()``'s numbering."""
    path_of: dict[int, str] = {}
    for name, p in _parameters_at_rest(model).items():
        path_of.setdefault(id(p), name)
    paths, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in path_of:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that the model does "
                    "not have; build the optimizer on model.parameters() after sharding"
                )
            paths[i] = path_of[id(p)]
            i += 1
    return paths


def _ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has never stepped: zeros, and step counters at 0."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    saved_lr = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lr, strict=True):
            if lr is not None:
                g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    for s in optimizer.state.values():
        if "step" in s:
            s["step"] = torch.zeros_like(s["step"]) if isinstance(s["step"], torch.Tensor) else 0


def _converted(sd: dict, options: StateDictOptions) -> dict:
    """``sd`` with DTensors gathered (``full_state_dict``) and tensors on CPU (``cpu_offload``).

    Every rank runs the gathers, including ranks that will then return nothing.
    """
    out = {}
    for k, v in sd.items():
        if isinstance(v, DTensor) and options.full_state_dict:
            v = v.full_tensor()
        if isinstance(v, torch.Tensor) and options.cpu_offload:
            v = v.detach().cpu()
        out[k] = v
    return out


def _kept_by_rank0_only(options: StateDictOptions) -> bool:
    """Whether this rank returns an empty dict: full + cpu_offload keeps tensors on rank 0."""
    return options.full_state_dict and options.cpu_offload and Group.of().rank != 0


def _is_param_shaped(value, like) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and tuple(value.shape) == tuple(like.shape)
        and value.ndim > 0
    )


def _shard_like(value, like):
    """``value`` (a full tensor) cut to ``like``'s block, as a DTensor laid out like ``like``."""
    if (
        not isinstance(like, DTensor)
        or isinstance(value, DTensor)
        or not isinstance(value, torch.Tensor)
    ):
        return value
    if tuple(value.shape) != tuple(like.shape):
        raise CheckpointError(
            f"a full tensor of shape {tuple(value.shape)} for a parameter of shape {tuple(like.shape)}"
        )
    sizes, offsets = like._spec.local_shape_and_offset()
    block = value[relative_slices((tuple(offsets), tuple(sizes)), (0,) * value.ndim)]
    local = block.to(dtype=like.dtype, device=like.to_local().device).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def _broadcast_full(current: dict, given: dict, strict: bool) -> dict:
    """Rank 0's full tensors, broadcast to every rank, for the keys of ``current`` it has."""
    group = Group.of()
    problems, present = [], None
    if group.rank == 0:
        missing = sorted(set(current) - set(given))
        if missing and strict:
            problems.append(f"rank 0's state dict lacks {missing}")
        present = [k for k in current if k in given]
    present = group.agree(problems, present)[0]
    return {k: _broadcast_tensor(given.get(k), current[k], group) for k in present
            if isinstance(current[k], torch.Tensor)}  # fmt: skip


def _broadcast_tensor(value, like, group: Group) -> torch.Tensor:
    full = torch.empty(
        tuple(like.shape),
        dtype=like.dtype,
        device=like.to_local().device if isinstance(like, DTensor) else like.device,
    )
    if group.rank == 0:
        full.copy_(value)
    if group.pg is not None:
        nbytes = full.numel() * full.element_size()
        debug.note_collective("broadcast", group.pg, nbytes, mesh_dim="checkpoint")
        with debug.annotate_failures():
            dist.broadcast(full, src=dist.get_global_rank(group.pg, 0), group=group.pg)
    return full


def _broadcast_optim(current: dict, given: dict) -> dict:
    """Rank 0's full optimizer state dict, with each rank keeping the same structure as ``current``.

    Tensors are broadcast one by one; everything else (param_groups and non-tensor state)
    travels in one JSON exchange.
    """
    group = Group.of()
    plain = None
    if group.rank == 0:
        state = given.get("state", {})
        plain = {
            "param_groups": given.get("param_groups"),
            "state": {
                path: {
                    k: state.get(path, {}).get(k)
                    for k, v in entry.items()
                    if not isinstance(v, torch.Tensor)
                }  # fmt: skip
                for path, entry in current["state"].items()
            },
        }
    plain = decode_value(group.all_gather_json(encode_value("optimizer state", plain))[0])
    out = {}
    for path, entry in current["state"].items():
        src = given.get("state", {}).get(path, {}) if group.rank == 0 else {}
        out[path] = {
            k: _broadcast_tensor(src.get(k), like, group)
            if isinstance(like, torch.Tensor)
            else plain["state"][path][k]
            for k, like in entry.items()
        }
    return {"state": out, "param_groups": plain["param_groups"]}
