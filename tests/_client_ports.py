"""Porting a client library (Lightning Fabric, torchtitan) to this project by its imports.

A client imports PyTorch's names in two ways, and each is swapped its own way for the length
of a ``with`` block, then put back:

* at module level (``from torch.distributed.tensor import DTensor``): the client module's
  attribute is rebound to ours - by identity, so only what it really took from PyTorch is
  touched (the idea of ``_ported`` in ``tests/test_torchtitan_interop.py``);
* inside a function, at call time (``from torch.distributed.checkpoint import save`` in
  Lightning's ``_distributed_checkpoint_save``): nothing in the client holds the name until it
  runs, so the attribute of the PyTorch module itself is swapped, for the names listed only
  (a PyTorch internal that imports the same name at call time would see ours too, which is
  why the list is kept to what the client imports that way). This project itself reads
  PyTorch's ``torch.distributed.tensor.DTensor``, ``...device_mesh.DeviceMesh`` and
  ``...placement_types.Placement`` at run time, to recognise PyTorch's objects
  (``tests/_clients.py`` explains): none of those may be swapped this way. Lightning's
  call-time names are not among them (its ``DTensor`` comes from ``torch.distributed._tensor``,
  a module object of its own). ``tests/_clients.py`` (accelerate) swaps at the import
  statement instead, with an import hook.

A name that ours lacks is left as PyTorch's and reported in ``Port.missing``, so a test can
say which piece of the port is not there yet.

Example:
    >>> table = {"torch.distributed.checkpoint": ("dtensor.checkpoint", ("save", "load"))}
    >>> with ported(table, clients=("lightning_fabric",), call_time=table) as port:
    ...     run_the_client()
    >>> port.missing   # [("torch.distributed.checkpoint", "Stateful")] if ours had no Stateful
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys

# torch module -> (our module, names)
Table = dict[str, tuple[str, tuple[str, ...]]]
# what this project reads off PyTorch's modules at run time (module docstring)
_READ_BY_US = {
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
    ("torch.distributed.tensor.placement_types", "Placement"),
}


@dataclasses.dataclass
class Port:
    """What a ``ported`` block swapped: client module attributes, PyTorch module attributes,
    and the names ours does not have (left as PyTorch's)."""

    rebound: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    torch_attrs: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    missing: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _pairs(table: Table, port: Port):
    for theirs_name, (ours_name, names) in table.items():
        theirs, ours = importlib.import_module(theirs_name), importlib.import_module(ours_name)
        for name in names:
            if not hasattr(theirs, name):
                continue  # not in this PyTorch: nothing of the client can have it
            if not hasattr(ours, name):
                port.missing.append((theirs_name, name))
                continue
            yield theirs, name, getattr(theirs, name), getattr(ours, name)


@contextlib.contextmanager
def ported(
    table: Table,
    *,
    clients: tuple[str, ...],
    call_time: Table | None = None,
    modules: dict[str, str] | None = None,
):
    """Rebind, in every loaded module whose name starts with one of ``clients``, each
    attribute that *is* one of ``table``'s PyTorch objects to ours, and each that is one of
    the PyTorch modules of ``modules`` (``import torch.distributed.checkpoint as dcp``) to
    our module; and set each name of ``call_time`` on the PyTorch module itself. Everything
    is restored on exit."""
    port = Port()
    undo: list[tuple[object, str, object]] = []
    by_id = {}
    for _, _name, theirs, ours in _pairs(table, port):
        by_id[id(theirs)] = (theirs, ours)
    for theirs_name, ours_name in (modules or {}).items():
        theirs = importlib.import_module(theirs_name)
        by_id[id(theirs)] = (theirs, importlib.import_module(ours_name))
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(clients):
            continue
        for attr, value in list(vars(module).items()):
            hit = by_id.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(module, attr, hit[1])
                undo.append((module, attr, value))
                port.rebound.add((module_name, attr))
    for module, name, theirs, ours in _pairs(call_time or {}, port):
        if (module.__name__, name) in _READ_BY_US:
            raise ValueError(f"{module.__name__}.{name} is read by this project: not swappable")
        setattr(module, name, ours)
        undo.append((module, name, theirs))
        port.torch_attrs.add((module.__name__, name))
    port.missing = sorted(set(port.missing))
    try:
        yield port
    finally:
        for module, attr, value in reversed(undo):
            setattr(module, attr, value)


def check_resumed(run: dict, arm: str) -> None:
    """A run that saved, went on, and was resumed from its checkpoint by a fresh model: the
    loaded values are the saved ones, and the resumed step (its loss, its learning rate when
    the run records one, every parameter) is the uninterrupted run's, bit for bit."""
    import torch

    for name, saved in run["saved"].items():
        assert torch.equal(run["loaded"][name], saved), f"{arm}: {name} not loaded as saved"
    assert run["resumed_loss"] == run["losses"][2], (arm, run["resumed_loss"], run["losses"])
    if "resumed_lr" in run:
        assert run["resumed_lr"] == run["lr"], (arm, run["resumed_lr"], run["lr"])
    for name, full in run["uninterrupted"].items():
        got = run["resumed"][name]
        assert torch.equal(got, full), (
            f"{arm}: {name} resumed differs by {(got - full).abs().max()}"
        )


def shared_path(tmp: str, tag: str) -> str:
    """``tmp/tag`` as rank 0 names it, on every rank (one checkpoint directory for all)."""
    import torch.distributed as dist

    obj = [f"{tmp}/{tag}"]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]
