"""Every public name of ``torch.distributed.checkpoint`` is in ``dtensor.checkpoint`` with a
compatible signature, or listed with its reason in docs/checkpoint.md.

The names are computed from the installed torch at test time (attributes without a leading
underscore that are not modules), so a name a new torch adds fails here until it is
provided or listed. "Compatible": PyTorch's parameter names (of a function, or of a class's
constructor) appear in ours in the same order, and any parameter ours adds has a default.
"""

from __future__ import annotations

import inspect
import re
import types
from pathlib import Path

import pytest
import torch.distributed.checkpoint as tdcp

import dtensor.checkpoint as dcp

DOC = Path(__file__).resolve().parent.parent / "docs" / "checkpoint.md"
# a row of the table of names not provided: | `Name` | reason |
_NOT_PROVIDED = re.compile(r"^\|\s*`(\w+)`\s*\|\s*not provided:\s*(.+?)\s*\|\s*$", re.MULTILINE)


def torch_names() -> list[str]:
    return sorted(
        n
        for n in dir(tdcp)
        if not n.startswith("_") and not isinstance(getattr(tdcp, n), types.ModuleType)
    )


def not_provided() -> dict[str, str]:
    """The names docs/checkpoint.md lists as not provided, with their reasons."""
    return {m[1]: m[2] for m in _NOT_PROVIDED.finditer(DOC.read_text())}


def _params(obj) -> list[inspect.Parameter]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    if target is object.__init__:
        return []
    params = list(inspect.signature(target).parameters.values())
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    return [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def signature_problem(theirs, ours) -> str | None:
    """Why ``ours`` cannot stand in for ``theirs`` (None when it can)."""
    if inspect.isclass(theirs) != inspect.isclass(ours):
        return f"PyTorch's is a {'class' if inspect.isclass(theirs) else 'function'}, ours is not"
    want = [p.name for p in _params(theirs)]
    have = _params(ours)
    names = [p.name for p in have]
    missing = [n for n in want if n not in names]
    if missing:
        return f"lacks parameters {missing} (PyTorch: {want}, ours: {names})"
    if [n for n in names if n in want] != want:
        return f"parameters in another order (PyTorch: {want}, ours: {names})"
    extra = [p.name for p in have if p.name not in want and p.default is p.empty]
    if extra:
        return f"adds parameters without defaults: {extra}"
    return None


def test_the_names_are_found():
    names = torch_names()
    assert {"save", "load", "FileSystemWriter", "Metadata", "DefaultLoadPlanner"} <= set(names)


@pytest.mark.parametrize("name", torch_names())
def test_each_pytorch_name_is_provided_or_listed_with_a_reason(name):
    listed = not_provided()
    if not hasattr(dcp, name):
        assert name in listed, (
            f"torch.distributed.checkpoint.{name} is neither in dtensor.checkpoint nor listed "
            "in docs/checkpoint.md's table of names not provided (| `Name` | not provided: why |)"
        )
        assert len(listed[name]) > 20, f"{name}: give a real reason in docs/checkpoint.md"
        return
    assert name not in listed, f"{name} is provided; remove it from the not-provided table"
    problem = signature_problem(getattr(tdcp, name), getattr(dcp, name))
    assert problem is None, f"dtensor.checkpoint.{name}: {problem}"


def test_the_signature_check_can_fail():
    def theirs(state_dict, *, checkpoint_id=None, planner=None): ...

    def reordered(state_dict, *, planner=None, checkpoint_id=None): ...

    def required_extra(state_dict, extra, *, checkpoint_id=None, planner=None): ...

    def fine(state_dict, *, checkpoint_id=None, planner=None, strict=True): ...

    assert "lacks parameters ['planner']" in signature_problem(
        theirs, lambda state_dict, *, checkpoint_id=None: 0
    )
    assert "another order" in signature_problem(theirs, reordered)
    assert "without defaults: ['extra']" in signature_problem(theirs, required_extra)
    assert signature_problem(theirs, fine) is None
    assert "class" in signature_problem(tdcp.FileSystemWriter, fine)
