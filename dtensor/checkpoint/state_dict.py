"""State-dict helpers with the API of ``torch.distributed.checkpoint.state_dict``.

``torch.optim`` keys its state by integer position, which changes when the model is wrapped
differently; checkpoints key it by the parameter's path (``"blocks.0.attn.q.weight"``) so a
state saved under one layout loads under another. ``StateDictOptions`` asks for full tensors
(gathered, on rank 0 only with ``cpu_offload``), leaves frozen parameters out, flattens the
optimizer state dict to one level, or, when setting, has rank 0's full state dict broadcast
into the sharded model.

Code written for PyTorch ports by changing the import::

    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # before
    from dtensor.checkpoint.state_dict import get_model_state_dict            # after

Keys are canonical paths, as PyTorch's: the ``_orig_mod.`` of ``torch.compile``, the
``module.`` of DDP and the ``_checkpoint_wrapped_module.`` of activation checkpointing are left
out, and added back when setting. Nothing here imports ``fsdp2``: the helpers work on any
module whose parameters are DTensors or plain tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from dtensor import debug
from dtensor.checkpoint._comm import Group
from dtensor.checkpoint._flatten import decode_value, encode_value
from dtensor.checkpoint._reshard import relative_slices
from dtensor.checkpoint.errors import CheckpointError
from dtensor.tensor import DTensor

logger = logging.getLogger(__name__)

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"
_WRAPPED = "_checkpoint_wrapped_module"

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


@dataclass
class StateDictOptions:
    """How the state-dict helpers shape what they return or accept (PyTorch's fields, in order).

    - ``full_state_dict``: full tensors instead of this rank's shards (every rank gathers).
    - ``cpu_offload``: tensors on CPU; with ``full_state_dict``, only rank 0 keeps them (the
      other ranks get ``{}``).
    - ``ignore_frozen_params``: leave parameters with ``requires_grad=False`` out of the model
      state dict (every name of a tied one).
    - ``keep_submodule_prefixes``: with ``submodules=``, keep each key's full path (True) or
      strip the submodule's own path from it (False).
    - ``strict``: when setting, missing or unexpected keys are an error; with ``False`` the
      model's values stay for missing keys and ``set_model_state_dict`` returns them.
    - ``broadcast_from_rank0``: when setting, rank 0 alone holds a full state dict (the others
      may pass ``{}``); each tensor is broadcast and every rank keeps its own block. Needs
      ``full_state_dict=True``.
    - ``flatten_optimizer_state_dict``: one-level optimizer state dicts,
      ``{"state.<path>.exp_avg": ..., "param_groups.<path>.lr": ...}``; set takes them too.
    - ``dsd_fqn_modifiers``: the name of the method a module may define to say which child
      its state-dict hooks leave out of the keys (``{key_part: child_name}``).

    Example::

        >>> opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        >>> full = get_model_state_dict(model, options=opts)   # {} on ranks other than 0
        >>> adapters = dataclasses.replace(opts, ignore_frozen_params=True)
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


# ---------------------------------------------------------------------------- public API


def get_model_state_dict(model: nn.Module, *, submodules: Iterable[nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict:  # fmt: skip
    """The model's state dict by canonical path: DTensor shards by default, full when asked.

    ``submodules`` keeps only the keys under those modules (``keep_submodule_prefixes``
    says whether their paths stay in the keys). Every rank must call it.

    Example::

        >>> sd = get_model_state_dict(model)          # {"blocks.0.attn.q.weight": DTensor, ...}
        >>> full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    """
    options = _checked_options(options)
    _check_model(model)
    view = _View(model, options)
    prefixes = _submodule_prefixes(view, submodules)
    sd = _model_state(view, options, prefixes)
    _check_not_empty_model(sd, options, prefixes, "get_model_state_dict")
    return _finished(sd, options)


def get_optimizer_state_dict(model: nn.Module, optimizers, *,
                             submodules: Iterable[nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> dict:  # fmt: skip
    """``{"state": {path: {...}}, "param_groups": [{..., "params": [path, ...]}]}``.

    ``optimizers`` is one optimizer or an iterable of them (their states and groups are
    merged). An optimizer that has not stepped gets its state created first (zeros, step 0).
    With ``flatten_optimizer_state_dict`` the result is one level deep. ``submodules`` is
    accepted and, as in PyTorch, does not filter the optimizer state. Example::

        >>> osd = get_optimizer_state_dict(model, opt)
        >>> sorted(osd["state"]["blocks.0.attn.q.weight"])
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    options = _checked_options(options)
    _check_model(model)
    optims = _checked_optimizers(optimizers)
    view = _View(model, options)
    _submodule_prefixes(view, submodules)  # checked; PyTorch does not filter optimizer state
    osd = _optimizer_state(view, optims)
    if options.flatten_optimizer_state_dict:
        osd = _flattened(osd)
    return _finished(osd, options)


def get_state_dict(model: nn.Module, optimizers, *, submodules: Iterable[nn.Module] | None = None,
                   options: StateDictOptions | None = None) -> tuple[dict, dict]:  # fmt: skip
    """``(get_model_state_dict(...), get_optimizer_state_dict(...))`` in one call.

    Example::

        >>> model_sd, optim_sd = get_state_dict(model, opt)
        >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt/step-100")
    """
    options = _checked_options(options)
    _check_model(model)
    optims = _checked_optimizers(optimizers)
    view = _View(model, options)
    prefixes = _submodule_prefixes(view, submodules)
    sd = _model_state(view, options, prefixes)
    _check_not_empty_model(sd, options, prefixes, "get_state_dict")
    osd = _optimizer_state(view, optims)
    if options.flatten_optimizer_state_dict:
        osd = _flattened(osd)
    return _finished(sd, options), _finished(osd, options)


def set_model_state_dict(model: nn.Module, model_state_dict: Mapping, *,
                         options: StateDictOptions | None = None) -> _IncompatibleKeys:  # fmt: skip
    """Load ``model_state_dict``: shards, full tensors, or rank 0's full tensors to broadcast.

    Keys are canonical paths (the model's own keys are accepted too); a dict keyed by
    submodules (``{submodule: its state dict}``) is accepted as in PyTorch. Returns
    ``(missing_keys, unexpected_keys)``, the same on every rank. Example::

        >>> set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        >>> r = set_model_state_dict(model, adapters, options=StateDictOptions(strict=False))
        >>> r.missing_keys                           # the keys the dict did not have
    """
    options = _checked_options(options)
    _check_model(model)
    view = _View(model, options)
    given = _model_input(view, model_state_dict)
    return _load_model(view, given, options)


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: Mapping, *,
                             options: StateDictOptions | None = None) -> None:  # fmt: skip
    """Load a path-keyed optimizer state dict (nested or flattened, sharded or full).

    With several optimizers each takes the state and groups of its own parameters. Nothing
    is loaded unless every optimizer's part is valid. Example::

        >>> set_optimizer_state_dict(model, opt, osd)
        >>> set_optimizer_state_dict(model, opt, flat, options=StateDictOptions(
        ...     flatten_optimizer_state_dict=True))
    """
    options = _checked_options(options)
    _check_model(model)
    optims = _checked_optimizers(optimizers)
    optim_state_dict = _check_optimizer_input(optim_state_dict, options)
    _load_optimizers(_View(model, options), optims, optim_state_dict, options)


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict: Mapping,
                   optim_state_dict: Mapping,
                   options: StateDictOptions | None = None) -> _IncompatibleKeys:  # fmt: skip
    """Load the optimizers' state, then the model's; returns the model's incompatible keys.

    Example::

        >>> set_state_dict(model, opt, model_state_dict=sd, optim_state_dict=osd)
    """
    options = _checked_options(options)
    _check_model(model)
    optims = _checked_optimizers(optimizers)
    optim_state_dict = _check_optimizer_input(optim_state_dict, options)
    view = _View(model, options)
    given = _model_input(view, model_state_dict)
    _load_optimizers(view, optims, optim_state_dict, options)
    if not given and not options.broadcast_from_rank0:
        return _IncompatibleKeys([], [])
    return _load_model(view, given, options)


# ---------------------------------------------------------------------------- checks


def _checked_options(options) -> StateDictOptions:
    """``options`` as ours (PyTorch's own ``StateDictOptions`` is converted), checked."""
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        names = [f.name for f in dataclasses.fields(StateDictOptions)]
        if not (dataclasses.is_dataclass(options) and type(options).__name__ == "StateDictOptions"):
            raise TypeError(
                f"options must be a StateDictOptions or None, got {type(options).__name__}; "
                "build it with dtensor.checkpoint.state_dict.StateDictOptions(...)"
            )
        options = StateDictOptions(**{n: getattr(options, n) for n in names if hasattr(options, n)})
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name == "dsd_fqn_modifiers":
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"StateDictOptions.dsd_fqn_modifiers must be a method name (a non-empty str), "
                    f"got {value!r}; the default is '_fqn_modifiers'"
                )
        elif not isinstance(value, bool):
            raise ValueError(f"StateDictOptions.{f.name} must be True or False, got {value!r}")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(
            "StateDictOptions.broadcast_from_rank0=True needs full_state_dict=True (rank 0 "
            "holds full tensors): pass StateDictOptions(full_state_dict=True, "
            "broadcast_from_rank0=True)"
        )
    return options


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def _checked_optimizers(optimizers) -> tuple[torch.optim.Optimizer, ...]:
    """One optimizer or an iterable of them, as a non-empty tuple."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    if not isinstance(optimizers, Iterable) or isinstance(optimizers, (str, Mapping)):
        raise TypeError(
            f"optimizers must be a torch.optim.Optimizer or an iterable of them, "
            f"got {type(optimizers).__name__}"
        )
    optims = tuple(optimizers)
    if not optims:
        raise ValueError(
            "optimizers is empty: pass the optimizer(s) built on the model's parameters"
        )
    bad = [type(o).__name__ for o in optims if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise TypeError(
            f"optimizers holds objects that are not optimizers: {bad}; pass the "
            "torch.optim.Optimizer(s) themselves (not a scheduler or a state dict)"
        )
    return optims


def _check_optimizer_input(osd, options: StateDictOptions) -> Mapping:
    """``osd`` checked; with ``broadcast_from_rank0`` the ranks that only receive may pass
    None (accelerate's FULL_STATE_DICT load does), taken as ``{}`` as PyTorch takes it."""
    if osd is None and options.broadcast_from_rank0:
        return {}
    if not isinstance(osd, Mapping):
        raise TypeError(f"optim_state_dict must be a dict, got {type(osd).__name__}")
    if not osd and not options.broadcast_from_rank0:
        raise ValueError(
            "optim_state_dict is empty; pass the optimizer state dict to load (with "
            "broadcast_from_rank0=True only rank 0 needs one)"
        )
    return osd


def _check_not_empty_model(sd: dict, options: StateDictOptions, prefixes, fn: str) -> None:
    """PyTorch's check: an empty model state dict is an error unless an option explains it."""
    explained = (prefixes is not None or options.ignore_frozen_params or not options.strict
                 or (options.full_state_dict and options.cpu_offload))  # fmt: skip
    if not sd and not explained:
        raise ValueError(
            f"{fn}: the model has no parameters or buffers, so its state dict is empty; pass "
            "the model whose state you want (or StateDictOptions(strict=False) to allow it)"
        )


# ---------------------------------------------------------------------------- names


class _View:
    """One model's names for one call: canonical keys and the paths of each parameter."""

    def __init__(self, model: nn.Module, options: StateDictOptions) -> None:
        self.model = model
        self.modifiers = options.dsd_fqn_modifiers
        self._canonical: dict[str, str] = {}
        self._aliases: dict[int, list[str]] | None = None
        self._params: dict[int, nn.Parameter] = {}

    def canonical(self, key: str) -> str:
        """``key`` without the wrappers' path parts (compile, DDP, activation checkpointing)."""
        if key not in self._canonical:
            self._canonical[key] = _canonical_key(self.model, key, self.modifiers)
        return self._canonical[key]

    @property
    def aliases(self) -> dict[int, list[str]]:
        """``id(parameter)`` -> its canonical paths, the first as ``named_parameters`` lists it.

        The parameters at rest (the shards the optimizer holds) are included even while a
        sharded module registers gathered copies (``state_dict(keep_vars=True)`` gives them).
        """
        if self._aliases is None:
            named = list(self.model.named_parameters(remove_duplicate=False))
            named += [(k, v) for k, v in self.model.state_dict(keep_vars=True).items()
                      if isinstance(v, nn.Parameter)]  # fmt: skip
            self._aliases = {}
            for name, p in named:
                names = self._aliases.setdefault(id(p), [])
                self._params[id(p)] = p
                if self.canonical(name) not in names:
                    names.append(self.canonical(name))
        return self._aliases

    def frozen_names(self) -> set[str]:
        """Every path of every parameter with ``requires_grad=False``."""
        aliases = self.aliases
        return {n for i, names in aliases.items() if not self._params[i].requires_grad
                for n in names}  # fmt: skip

    def paths_of(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The path of each parameter the optimizer holds, in ``state_dict()``'s numbering."""
        aliases = self.aliases
        out = []
        for group in optimizer.param_groups:
            for p in group[_PARAMS]:
                if id(p) not in aliases:
                    raise CheckpointError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that the model "
                        "does not have; build the optimizer on model.parameters() after sharding"
                    )
                out.append(aliases[id(p)][0])
        return out


def _canonical_key(model: nn.Module, key: str, modifiers: str) -> str:
    """Walk ``key`` down the module tree, leaving out the parts wrappers add."""
    obj, kept = model, []
    for part in key.split("."):
        if isinstance(obj, nn.Module):
            hidden = _hidden_child(obj, part, modifiers)
            if hidden is not None:
                obj = hidden
        if part == _WRAPPED or _is_wrapper_part(obj, part):
            obj = getattr(obj, part, None)
            continue
        kept.append(part)
        obj = obj._modules.get(part) if isinstance(obj, nn.Module) else None
    return ".".join(kept)


def _hidden_child(obj: nn.Module, part: str, modifiers: str):
    """The child whose path part ``obj``'s keys leave out before ``part``, if any: the one
    its ``dsd_fqn_modifiers`` method names, or the module an activation-checkpoint wrapper
    wraps (its state-dict hooks drop ``_checkpoint_wrapped_module.``)."""
    if part in obj._modules or part == _WRAPPED:
        return None
    method = getattr(obj, modifiers, None)
    child = method().get(part) if callable(method) else None
    if child is None and _WRAPPED in obj._modules:
        child = _WRAPPED
    return obj._modules.get(child) if child is not None else None


def _is_wrapper_part(obj, part: str) -> bool:
    if part == "_orig_mod":
        return type(obj).__name__ == "OptimizedModule"
    if part == "module":
        return isinstance(obj, nn.parallel.DistributedDataParallel)
    return False


def _submodule_prefixes(view: _View, submodules) -> list[str] | None:
    """The canonical path prefix of each module of ``submodules`` (None: no filtering)."""
    if submodules is None:
        return None
    if isinstance(submodules, nn.Module) or not isinstance(submodules, Iterable):
        raise TypeError(
            f"submodules must be a set of modules of model, got {type(submodules).__name__}; "
            "pass submodules={model.layer}"
        )
    wanted = list(submodules)
    if not wanted:
        return None
    names: dict[int, str] = {}
    for name, module in view.model.named_modules():
        names.setdefault(id(module), name)
    prefixes = []
    for module in wanted:
        if not isinstance(module, nn.Module) or id(module) not in names:
            raise ValueError(
                f"submodules holds a {type(module).__name__} that is not a module of model; "
                "pass modules reachable from model.named_modules()"
            )
        name = view.canonical(names[id(module)])
        prefixes.append(f"{name}." if name else "")
    return prefixes


# ---------------------------------------------------------------------------- get


def _model_state(view: _View, options: StateDictOptions, prefixes) -> dict:
    """The model's state dict, canonical keys, frozen parameters and other modules left out."""
    sd = {view.canonical(k): v for k, v in view.model.state_dict().items()}
    if options.ignore_frozen_params:
        frozen = view.frozen_names()
        sd = {k: v for k, v in sd.items() if k not in frozen}
    if prefixes is None:
        return sd
    out: dict = {}
    for key, value in sd.items():
        for prefix in prefixes:
            if not key.startswith(prefix):
                continue
            new = key if options.keep_submodule_prefixes else key[len(prefix) :]
            if not options.keep_submodule_prefixes and new in out and out[new] is not value:
                raise ValueError(
                    f"with keep_submodule_prefixes=False two submodules both give the key {new!r}; "
                    "pass one submodule at a time or keep_submodule_prefixes=True"
                )
            out[new] = value
    return out


def _optimizer_state(view: _View, optims) -> dict:
    """The optimizers' merged state dict keyed by path (this rank's shards)."""
    state: dict = {}
    groups: list = []
    for optimizer in optims:
        _ensure_state(optimizer)
        paths = view.paths_of(optimizer)
        native = optimizer.state_dict()
        state.update({paths[i]: s for i, s in native[_STATE].items()})
        groups.extend(dict(g, params=[paths[i] for i in g[_PARAMS]]) for g in native[_GROUPS])
    return {_STATE: state, _GROUPS: groups}


def _flattened(osd: dict) -> dict:
    """``{"state.<path>.<name>": v, "param_groups.<path>.<key>": v}``, PyTorch's flat form."""
    flat: dict = {}

    def walk(node: Mapping, prefix: str) -> None:
        for key, value in node.items():
            here = f"{prefix}.{key}"
            if isinstance(value, Mapping):
                walk(value, here)
            elif isinstance(value, (torch.Tensor, int, float)):
                flat[here] = value
            else:
                raise ValueError(
                    f"flatten_optimizer_state_dict=True: optimizer state {here!r} is a "
                    f"{type(value).__name__}; the flat form holds tensors, ints and floats only "
                    "(use the nested form, flatten_optimizer_state_dict=False)"
                )

    for path, entry in osd[_STATE].items():
        walk(entry, f"{_STATE}.{path}")
    for group in osd[_GROUPS]:
        for path in group[_PARAMS]:
            for key, value in group.items():
                if key != _PARAMS:
                    flat[f"{_GROUPS}.{path}.{key}"] = value
    return flat


def _finished(sd: dict, options: StateDictOptions) -> dict:
    """Gather and offload as asked; ``{}`` on ranks other than 0 with full + cpu_offload.

    Every rank runs the gathers, including ranks that will then return nothing.
    """
    out = _converted(sd, options)
    return {} if _kept_by_rank0_only(options) else out


def _converted(value, options: StateDictOptions):
    """``value`` with DTensors gathered (``full_state_dict``), tensors on CPU (``cpu_offload``)."""
    if isinstance(value, Mapping):
        return {k: _converted(v, options) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_converted(v, options) for v in value)
    if isinstance(value, DTensor) and options.full_state_dict:
        value = value.full_tensor()
    if isinstance(value, torch.Tensor) and options.cpu_offload:
        value = value.detach().cpu()
    return value


def _kept_by_rank0_only(options: StateDictOptions) -> bool:
    """Whether this rank returns an empty dict: full + cpu_offload keeps tensors on rank 0."""
    return options.full_state_dict and options.cpu_offload and Group.of().rank != 0


def _ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has never stepped: zeros, and step counters at 0."""
    params = [p for g in optimizer.param_groups for p in g[_PARAMS]]
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


# ---------------------------------------------------------------------------- set: model


def _model_input(view: _View, given) -> dict:
    """``given`` keyed by the model's own keys (canonical paths translated back)."""
    if not isinstance(given, Mapping):
        raise TypeError(f"model_state_dict must be a dict, got {type(given).__name__}")
    if given and isinstance(next(iter(given)), nn.Module):
        given = _from_submodule_keys(view, given)
    own = {view.canonical(k): k for k in view.model.state_dict()}
    bad = [k for k in given if not isinstance(k, str)]
    if bad:
        raise TypeError(f"model_state_dict keys must be str paths, got {bad[:3]}")
    return {own.get(k, k): v for k, v in given.items()}


def _from_submodule_keys(view: _View, given: Mapping) -> dict:
    """``{submodule: its state dict}`` (PyTorch's deprecated form) as one path-keyed dict."""
    names = {id(m): n for n, m in view.model.named_modules()}
    out = {}
    for module, sub in given.items():
        if not isinstance(module, nn.Module) or id(module) not in names:
            raise ValueError(
                "model_state_dict keyed by modules must use modules of model, got a "
                f"{type(module).__name__} that is not one"
            )
        prefix = view.canonical(names[id(module)])
        out.update({f"{prefix}.{k}" if prefix else k: v for k, v in sub.items()})
    return out


def _load_model(view: _View, given: dict, options: StateDictOptions) -> _IncompatibleKeys:
    model = view.model
    current = model.state_dict()
    meta = [k for k, v in current.items() if isinstance(v, torch.Tensor) and _local(v).is_meta]
    if meta:
        raise ValueError(
            f"model has tensors on the meta device ({meta[:3]}); call "
            "model.to_empty(device=...) before set_model_state_dict"
        )
    if not given and not options.broadcast_from_rank0:
        if options.strict:
            raise ValueError(
                "model_state_dict is empty; pass the state dict to load (with "
                "broadcast_from_rank0=True only rank 0 needs one)"
            )
        return _IncompatibleKeys([], [])
    unexpected: list[str] = []
    if options.broadcast_from_rank0:
        given, unexpected = _broadcast_model(current, given, options.strict)
    if options.full_state_dict:
        given = {k: _shard_like(v, current[k]) if k in current else v for k, v in given.items()}
    result = model.load_state_dict(given, strict=options.strict)
    if unexpected:
        result = _IncompatibleKeys(result.missing_keys, list(result.unexpected_keys) + unexpected)
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _broadcast_model(current: dict, given: dict, strict: bool) -> tuple[dict, list[str]]:
    """Rank 0's full tensors, broadcast to every rank, for the keys of ``current`` it has.

    Rank 0 checks its dict first (missing and unexpected keys under ``strict``, shapes) and
    every rank raises the same error before any tensor moves. Returns this rank's blocks (a
    DTensor's, or the whole of a plain tensor) and rank 0's unexpected keys.
    """
    group = Group.of()
    problems, plan = [], None
    if group.rank == 0:
        tensors = [k for k, v in current.items() if isinstance(v, torch.Tensor)]
        missing = [k for k in tensors if k not in given]
        unexpected = [k for k in given if k not in current]
        if strict and missing:
            problems.append(f"rank 0's model_state_dict lacks {missing} (pass strict=False to "
                            "keep the model's values for them)")  # fmt: skip
        if strict and unexpected:
            problems.append(f"rank 0's model_state_dict has keys the model does not: {unexpected}")
        problems += [_full_tensor_problem(k, given[k], current[k]) for k in tensors if k in given]
        plan = {"present": [k for k in tensors if k in given], "unexpected": unexpected}
    plan = group.agree([p for p in problems if p], plan)[0]
    # each full tensor is cut to this rank's block before the next one arrives: one full
    # tensor at a time in memory, as PyTorch's broadcast holds
    mine = {k: _shard_like(_broadcast_tensor(given.get(k), current[k], group), current[k])
            for k in plan["present"]}  # fmt: skip
    return mine, plan["unexpected"]


def _full_tensor_problem(key: str, value, like) -> str | None:
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return f"rank 0's model_state_dict[{key!r}] is a {type(value).__name__}, not a full tensor"
    if tuple(value.shape) != tuple(like.shape):
        return (f"rank 0's model_state_dict[{key!r}] has shape {tuple(value.shape)}, "
                f"the model's is {tuple(like.shape)}")  # fmt: skip
    return None


def _broadcast_tensor(value, like, group: Group) -> torch.Tensor:
    """``value`` (rank 0's) on every rank, in ``like``'s shape, dtype and device."""
    return _broadcast(value, like.shape, like.dtype, _local(like).device, group)


def _broadcast(value, shape, dtype: torch.dtype, device, group: Group) -> torch.Tensor:
    """``value`` (rank 0's) on every rank, as a new tensor of ``shape`` and ``dtype``."""
    full = torch.empty(tuple(shape), dtype=dtype, device=device)
    if group.rank == 0:
        full.copy_(value)
    if group.pg is not None:
        nbytes = full.numel() * full.element_size()
        debug.note_collective("broadcast", group.pg, nbytes, mesh_dim="checkpoint")
        with debug.annotate_failures():
            dist.broadcast(full, src=dist.get_global_rank(group.pg, 0), group=group.pg)
    return full


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
    # a copy, never a view: the full tensor is freed once every block is cut from it
    local = block.to(dtype=like.dtype, device=like.to_local().device, copy=True).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


# ---------------------------------------------------------------------------- set: optimizer


def _load_optimizers(view: _View, optims, osd: Mapping, options: StateDictOptions) -> None:
    """Check every optimizer's part of ``osd``, then load them all."""
    for optimizer in optims:
        _ensure_state(optimizer)
    for optimizer in optims:
        view.paths_of(optimizer)  # every parameter belongs to the model
    if options.broadcast_from_rank0:
        nested = _broadcast_optimizer(view, optims, osd, options.strict)
    else:
        nested = _nested_input(view, optims, osd, options.strict)
    if nested is None:  # a native (integer-keyed) state dict
        optims[0].load_state_dict(dict(osd))
        return
    natives = [_native_for(view, o, nested, options.strict) for o in optims]
    for optimizer, native in zip(optims, natives, strict=True):
        optimizer.load_state_dict(native)


def _nested_input(view: _View, optims, osd: Mapping, strict: bool) -> dict | None:
    """``osd`` in the nested path-keyed form (flat keys unflattened); None if it is native."""
    if _STATE not in osd:
        return _unflattened(view, optims, osd, strict)
    state, groups = osd[_STATE], osd.get(_GROUPS)
    if (
        not isinstance(state, Mapping)
        or not isinstance(groups, list)
        or not all(isinstance(g, Mapping) and isinstance(g.get(_PARAMS), list) for g in groups)
    ):
        raise ValueError(
            "optim_state_dict must be {'state': {path: {...}}, 'param_groups': [{..., 'params': "
            "[path, ...]}]} as get_optimizer_state_dict returns, or its flattened form"
        )
    int_groups = bool(groups) and all(isinstance(p, int) for g in groups for p in g[_PARAMS])
    if (state and all(isinstance(k, int) for k in state)) or (not state and int_groups):
        if len(optims) != 1:
            raise ValueError(
                "an integer-keyed optim_state_dict can only load into one optimizer; get a "
                "path-keyed one with get_optimizer_state_dict(model, optimizers)"
            )
        return None
    return {_STATE: dict(state), _GROUPS: list(groups)}


def _unflattened(view: _View, optims, flat: Mapping, strict: bool) -> dict:
    """The nested form of a flat ``{"state.<path>.<name>": v, "param_groups.<path>.<key>": v}``.

    Keys of parameters the model does not have are ignored, as PyTorch does (a flat dict may
    cover several models' optimizers).
    """
    known = {n for names in view.aliases.values() for n in names}
    state: dict = {}
    for key, value in flat.items():
        if not isinstance(key, str) or not key.startswith(f"{_STATE}."):
            continue
        path, rest = _known_prefix(key[len(_STATE) + 1 :], known)
        if path is None:
            continue
        node = state.setdefault(path, {})
        *outer, last = rest.split(".")
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = value
    groups, missing = [], []
    for optimizer in optims:
        for group in optimizer.param_groups:
            paths = [_flat_alias(flat, view.aliases[id(p)], group) for p in group[_PARAMS]]
            out = {k: v for k, v in group.items() if k != _PARAMS}
            for k in out if paths else ():
                flat_key = f"{_GROUPS}.{paths[0]}.{k}"
                if flat_key in flat:
                    out[k] = flat[flat_key]
                elif strict:
                    missing.append(flat_key)
            groups.append(dict(out, params=paths))
    if missing:
        raise ValueError(
            f"optim_state_dict (flat) lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            "pass StateDictOptions(strict=False) to keep the optimizer's values for them"
        )
    return {_STATE: state, _GROUPS: groups}


def _known_prefix(rest: str, known: set[str]) -> tuple[str | None, str]:
    """Split ``"<path>.<name>"`` where ``<path>`` is a parameter path of the model."""
    at = rest.find(".")
    while at != -1:
        if rest[:at] in known:
            return rest[:at], rest[at + 1 :]
        at = rest.find(".", at + 1)
    return None, rest


def _flat_alias(flat: Mapping, names: list[str], group: dict) -> str:
    """Which of a tied parameter's paths the flat dict uses for its group values."""
    keys = [k for k in group if k != _PARAMS]
    for name in names:
        if any(f"{_GROUPS}.{name}.{k}" in flat for k in keys):
            return name
    return names[0]


def _native_for(view: _View, optimizer, nested: dict, strict: bool) -> dict:
    """The part of ``nested`` that is ``optimizer``'s, in its own integer numbering.

    Each of the optimizer's groups takes the values of the loaded group that holds its
    parameters (under any of their paths); full tensors are cut to each parameter's shard.
    """
    state_in = nested[_STATE]
    group_of: dict[str, dict] = {}
    for g in nested[_GROUPS]:
        for path in g[_PARAMS]:
            group_of.setdefault(path, g)
    state, groups, missing, unmatched, pos = {}, [], [], [], 0
    for index, group in enumerate(optimizer.param_groups):
        match, ids = None, []
        for p in group[_PARAMS]:
            names = view.aliases[id(p)]
            key = next((n for n in names if n in state_in), None)
            match = match or next((group_of[n] for n in names if n in group_of), None)
            if key is not None:
                state[pos] = _shard_entry(state_in[key], p)
            elif strict and p.requires_grad and optimizer.state.get(p):
                missing.append(names[0])
            ids.append(pos)
            pos += 1
        if match is None and group[_PARAMS]:
            unmatched.append(index)
        base = match if match is not None else group
        groups.append(dict({k: v for k, v in base.items() if k != _PARAMS}, params=ids))
    if missing or (strict and unmatched):
        raise ValueError(
            f"optim_state_dict has no state for {missing} and no param group for the optimizer's "
            f"groups {unmatched}; pass StateDictOptions(strict=False) to keep the optimizer's own"
        )
    return {_STATE: state, _GROUPS: groups}


def _shard_entry(value, param):
    """An optimizer state entry with full, parameter-shaped tensors cut to ``param``'s shard."""
    if isinstance(value, Mapping):
        return {k: _shard_entry(v, param) for k, v in value.items()}
    if (
        isinstance(value, torch.Tensor)
        and value.ndim > 0
        and tuple(value.shape) == tuple(param.shape)
    ):
        return _shard_like(value, param)
    return value


def _broadcast_optimizer(view: _View, optims, given: Mapping, strict: bool) -> dict:
    """Rank 0's optimizer state dict (nested or flat), rebuilt on every rank.

    Rank 0 describes it (tensors by shape and dtype, everything else as JSON) in one
    exchange that also carries its problems, so every rank raises together; then each tensor
    is broadcast in turn.
    """
    group = Group.of()
    problems, leaves, tensors = [], None, []
    if group.rank == 0:
        try:
            nested = _nested_input(view, optims, given, strict)
            if nested is None:
                raise ValueError(
                    "broadcast_from_rank0 needs a path-keyed optim_state_dict: build it with "
                    "get_optimizer_state_dict(model, optimizers), not optimizer.state_dict()"
                )
            leaves, tensors = _describe(nested)
        except Exception as e:  # any error: the other ranks wait in agree() for rank 0
            problems.append(f"rank 0's optim_state_dict: {type(e).__name__}: {e}")
    leaves = group.agree(problems, leaves)[0]
    out: dict = {}
    sent = iter(tensors)
    for path, kind, payload in leaves:
        if kind == "tensor":
            device = group._device() if group.pg is not None else torch.device("cpu")
            value = _broadcast(next(sent, None), payload[0], _dtype(payload[1]), device, group)
            if value.ndim == 0:  # a step counter stays on the host, as PyTorch keeps it
                value = value.cpu()
        else:
            value = decode_value(payload)
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    out.setdefault(_STATE, {})
    return out


def _describe(nested: dict) -> tuple[list, list]:
    """``[(path, "tensor", [shape, dtype]) or (path, "value", json)]`` and the tensors."""
    leaves, tensors = [], []

    def walk(node: Mapping, path: list) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping) and value:
                walk(value, path + [key])
            elif isinstance(value, DTensor):
                raise ValueError(
                    f"{'.'.join(map(str, path + [key]))} is a DTensor; broadcast_from_rank0 takes "
                    "full tensors (get them with StateDictOptions(full_state_dict=True))"
                )
            elif isinstance(value, torch.Tensor):
                leaves.append((path + [key], "tensor", [list(value.shape), str(value.dtype)]))
                tensors.append(value)
            else:
                leaves.append(
                    (path + [key], "value", encode_value(".".join(map(str, path + [key])), value))
                )

    walk(nested, [])
    return leaves, tensors


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"rank 0 described a tensor of unknown dtype {name!r}")
    return dtype
