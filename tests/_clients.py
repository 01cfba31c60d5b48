"""Run a client library of PyTorch's FSDP2 / DTensor / DeviceMesh / distributed checkpoints
(accelerate, with transformers and PEFT under it) on this project's instead, by changing what
its import statements bind - without editing the client.

``ported(level)`` swaps, for the length of a ``with`` block:

* ``torch.distributed.fsdp``'s ``fully_shard`` / ``FSDPModule`` / the policies -> ``fsdp2``;
* ``torch.distributed.tensor``'s ``DTensor`` / ``distribute_tensor`` / the placements ->
  ``dtensor``; ``torch.distributed.device_mesh``'s ``init_device_mesh`` / ``DeviceMesh`` ->
  ``device_mesh``;
* with ``level="full"`` also the checkpoint names: ``torch.distributed.checkpoint`` itself
  (the module object, where accelerate writes ``import torch.distributed.checkpoint as
  dist_cp``) -> ``dtensor.checkpoint``, the ``torch.distributed.checkpoint.state_dict``
  helpers and ``StateDictOptions`` -> ``dtensor.checkpoint.state_dict``, and
  ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` (``...checkpoint.default_planner``),
  ``FileSystemWriter`` / ``FileSystemReader`` (``...checkpoint.filesystem``) -> ours.

``level="mid"`` is a port half done: fully_shard, DTensor and DeviceMesh are ours, the
checkpoint imports still PyTorch's.

A client takes PyTorch's names in two ways, and each is swapped its own way:

* at module level (``from torch.distributed.tensor import DTensor`` at the top of a
  transformers module): the client module's attribute is rebound to ours, by identity (the
  idea of ``_ported`` in tests/test_torchtitan_interop.py);
* inside a function, at call time - almost all of accelerate's (``from torch.distributed.fsdp
  import fully_shard`` in ``fsdp2_prepare_model``, ``import torch.distributed.checkpoint as
  dist_cp`` in ``save_fsdp_model``): ``builtins.__import__`` is wrapped, and an import
  statement executed by a client module (its globals' ``__name__`` is under ``CLIENTS``) of a
  ported PyTorch module gets a stand-in module whose swapped names are ours and whose other
  names are PyTorch's. Nothing outside the clients sees a change.

Why not set the names on PyTorch's modules themselves for the run (``setattr(
torch.distributed.tensor, "DTensor", ours)``): this project reads PyTorch's classes from
PyTorch's modules at run time, to recognise PyTorch's objects handed to it
(``dtensor.tensor.is_torch_dtensor`` reads ``torch.distributed.tensor.DTensor``,
``device_mesh._interop.is_torch_device_mesh`` ``torch.distributed.device_mesh.DeviceMesh``,
``dtensor.placement.is_torch_placement`` ``...placement_types.Placement``), so with the
attributes swapped it takes its own DTensors for PyTorch's (measured: ``full_tensor()`` then
recursed without end in ``is_torch_placement``). Swapping at the import sites is what
changing the client's import lines does.

Example:
    >>> with ported("full") as swapped:
    ...     accelerator.save_state("ckpt")        # accelerate's own code, on ours
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import os
import sys
import types

#: PyTorch module -> (candidate modules of ours, in order, the names swapped)
SHARDING = {
    "torch.distributed.fsdp": (
        ("fsdp2",),
        ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy"),
    ),
    "torch.distributed.tensor": (
        ("dtensor",),
        ("DTensor", "distribute_tensor", "Shard", "Replicate", "Partial", "Placement"),
    ),
    "torch.distributed.tensor.placement_types": (
        ("dtensor.placement",),
        ("Shard", "Replicate", "Partial", "Placement"),
    ),
    "torch.distributed.device_mesh": (("device_mesh",), ("init_device_mesh", "DeviceMesh")),
}  # fmt: skip

CHECKPOINT = {
    "torch.distributed.checkpoint.state_dict": (
        ("dtensor.checkpoint.state_dict",),
        ("StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
         "set_model_state_dict", "set_optimizer_state_dict"),
    ),
    "torch.distributed.checkpoint.default_planner": (
        ("dtensor.checkpoint.default_planner", "dtensor.checkpoint"),
        ("DefaultSavePlanner", "DefaultLoadPlanner"),
    ),
    "torch.distributed.checkpoint.filesystem": (
        ("dtensor.checkpoint.filesystem", "dtensor.checkpoint"),
        ("FileSystemWriter", "FileSystemReader"),
    ),
}  # fmt: skip

#: PyTorch modules replaced whole (``import torch.distributed.checkpoint as dist_cp``)
CHECKPOINT_MODULES = {"torch.distributed.checkpoint": "dtensor.checkpoint"}

#: what accelerate reads off the module it binds as ``dist_cp``
DIST_CP_NAMES = ("save", "load", "FileSystemWriter", "FileSystemReader")

#: client packages: their import statements and module globals are ported
CLIENTS = ("accelerate", "transformers", "peft")


class PortIncomplete(RuntimeError):
    """This project lacks a name a client imports from PyTorch."""


def _ours(candidates: tuple[str, ...], name: str):
    for module_name in candidates:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    return None


def _tables(level: str):
    """({torch module name: {name: ours}}, {torch module name: our module}, what ours lacks)."""
    groups = dict(SHARDING)
    modules = {}
    if level == "full":
        groups.update(CHECKPOINT)
    names, missing = {}, []
    for theirs_name, (candidates, wanted) in groups.items():
        importlib.import_module(theirs_name)
        for name in wanted:
            ours = _ours(candidates, name)
            if ours is None:
                missing.append(f"{theirs_name}.{name} (looked in {', '.join(candidates)})")
            else:
                names.setdefault(theirs_name, {})[name] = ours
    if level == "full":
        for theirs_name, ours_name in CHECKPOINT_MODULES.items():
            importlib.import_module(theirs_name)
            ours = importlib.import_module(ours_name)
            modules[theirs_name] = ours
            for name in DIST_CP_NAMES:
                if not hasattr(ours, name):
                    missing.append(f"{ours_name}.{name} (accelerate calls dist_cp.{name})")
    return names, modules, missing


class _StandIn(types.ModuleType):
    """A PyTorch module as a client's import statement sees it: some names ours."""

    def __init__(self, real: types.ModuleType, overrides: dict):
        super().__init__(real.__name__, getattr(real, "__doc__", None))
        self.__dict__["_real"] = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self.__dict__["_real"], name)


def _is_client(globals_) -> bool:
    name = (globals_ or {}).get("__name__") or ""
    return name.split(".")[0] in CLIENTS


def _client_modules():
    for module_name, module in list(sys.modules.items()):
        if module is not None and module_name.split(".")[0] in CLIENTS:
            yield module_name, module


def _nodes(names: dict, modules: dict) -> dict[str, types.ModuleType]:
    """What a client's import statement gets for each PyTorch module name: a stand-in with
    the swapped names, ours for a module replaced whole, and stand-ins for the parents that
    lead to them (``torch`` -> ``torch.distributed`` -> ours as ``.checkpoint``)."""
    nodes: dict[str, types.ModuleType] = {}
    for theirs_name, overrides in names.items():
        nodes[theirs_name] = _StandIn(sys.modules[theirs_name], overrides)
    nodes.update(modules)
    for theirs_name in sorted(nodes, key=lambda n: -n.count(".")):
        parts = theirs_name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent, child = ".".join(parts[:i]), ".".join(parts[: i + 1])
            if parent not in nodes:
                nodes[parent] = _StandIn(sys.modules[parent], {})
            if isinstance(nodes[parent], _StandIn):  # never set anything on ours
                nodes[parent].__dict__[parts[i]] = nodes[child]
    return nodes


def _import_hook(real_import, nodes: dict, modules: dict, record: dict):
    """``builtins.__import__`` that hands a client's import statements the stand-ins."""

    def client_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if level != 0 or not name.startswith("torch.") or not _is_client(globals):
            return module
        if fromlist:  # from torch.x.y import z: z is read off the module torch.x.y
            hit = nodes.get(name)
        elif name in nodes or any(name.startswith(m + ".") for m in modules):
            hit = nodes["torch"]  # import torch.x.y [as z]: read off torch, then .x, .y
        else:
            hit = None
        if hit is None:
            return module
        record["imports"].add((globals.get("__name__"), name))
        return hit

    return client_import


def _rebind(by_id: dict, record: dict) -> list:
    """Rebind the clients' module-level bindings of PyTorch's objects to ours, by identity."""
    undo = []
    for module_name, module in _client_modules():
        for attr, value in list(vars(module).items()):
            hit = by_id.get(id(value))
            if hit is not None and hit[0] is value:
                undo.append((module, attr, value))
                setattr(module, attr, hit[1])
                record["rebound"].add((module_name, attr))
    return undo


def _unbind(undo: list, by_id: dict) -> None:
    for module, attr, value in reversed(undo):
        setattr(module, attr, value)
    # a client module first imported during the run bound ours at its import: PyTorch's
    theirs_of = {id(ours): theirs for theirs, ours in by_id.values()}
    for _, module in _client_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, _StandIn):
                setattr(module, attr, value.__dict__["_real"])
            elif id(value) in theirs_of:
                setattr(module, attr, theirs_of[id(value)])


@contextlib.contextmanager
def ported(level: str = "full"):
    """Swap PyTorch's names for ours at the clients' import sites; restore on exit.

    ``level``: ``"torch"`` (nothing swapped), ``"mid"`` (sharding names only) or ``"full"``.
    Yields a dict: ``rebound`` (client module attributes rebound, as ``(module, name)``),
    ``imports`` (the client import statements that got a stand-in, as ``(client module,
    torch module)``). Raises ``PortIncomplete`` (before swapping anything) when this project
    lacks a name the port needs.
    """
    record = {"rebound": set(), "imports": set()}
    if level == "torch":
        yield record
        return
    if level not in ("mid", "full"):
        raise ValueError(f"level must be 'torch', 'mid' or 'full', got {level!r}")
    names, modules, missing = _tables(level)
    if missing:
        raise PortIncomplete("this project lacks: " + "; ".join(missing))
    by_id = {}
    for theirs_name, overrides in names.items():
        for name, ours in overrides.items():
            value = getattr(sys.modules[theirs_name], name)
            by_id[id(value)] = (value, ours)
    for theirs_name, ours in modules.items():
        by_id[id(sys.modules[theirs_name])] = (sys.modules[theirs_name], ours)
    real_import = builtins.__import__
    builtins.__import__ = _import_hook(real_import, _nodes(names, modules), modules, record)
    undo = []
    try:
        undo = _rebind(by_id, record)
        yield record
    finally:
        builtins.__import__ = real_import
        _unbind(undo, by_id)


# ----------------------------------------------------------------------------- accelerate


def reset_accelerate() -> None:
    """Forget accelerate's process-wide singletons (the next Accelerator starts afresh)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()


@contextlib.contextmanager
def fsdp2_accelerator(*, cpu: bool = True, **plugin_kwargs):
    """An ``Accelerator`` on FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2,
    **plugin_kwargs)``), adopting the default process group already initialized; accelerate's
    singletons are reset before and after, and the environment variables it sets are put back.

    On a CPU accelerate builds a ``MULTI_CPU`` state and turns FSDP on only for accelerator
    devices (``AcceleratorState.__init__`` lists the GPU-like distributed types), so with
    ``cpu=True`` the state is then marked FSDP with the plugin, as ``AcceleratorState`` does
    on a GPU (also in ``PartialState``, whose fields every later ``AcceleratorState()`` copies
    over its own): ``prepare``, ``save_state`` and ``load_state`` consult only
    ``distributed_type`` and ``fsdp_plugin``. ``OMP_NUM_THREADS=1`` keeps accelerate from
    changing the thread count.

    Example:
        >>> with fsdp2_accelerator(state_dict_type="SHARDED_STATE_DICT") as acc:
        ...     model, opt = acc.prepare(model, opt)
    """
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    reset_accelerate()
    environ = dict(os.environ)
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_kwargs)
        accelerator = Accelerator(cpu=cpu, fsdp_plugin=plugin)
        if accelerator.distributed_type != DistributedType.FSDP:
            accelerator.state.distributed_type = DistributedType.FSDP
            accelerator.state.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        assert accelerator.is_fsdp2, accelerator.distributed_type
        yield accelerator
    finally:
        reset_accelerate()
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
