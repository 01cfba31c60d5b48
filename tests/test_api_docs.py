"""Every public name has a docstring with an example and a row in docs/api.md.

The public surface is what ``__all__`` lists (STYLE: "the public surface is what each
``__init__.__all__`` lists"). The packages are found, not listed: every package under
``device_mesh/``, ``dtensor/`` and ``fsdp2/`` (no ``_`` in its path) whose ``__init__.py``
sets ``__all__`` - so a new package (``fsdp2.tools``) is covered the day it gets one - plus
the public lower-layer modules fsdp2 builds on (``LOWER_LAYER``: docs/dtensor.md).

- (a) the docstring of each name (the class's for a class) contains an example: a line
  starting ``Example`` or a ``>>>`` prompt (constants, which have no docstring of their own,
  are exempt);
- (b) docs/api.md has a section headed ``## `package` `` holding a row or line that starts
  with the name in backticks (``| `name(` `` or ``| `name` ``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("device_mesh", "dtensor", "fsdp2")
API_DOC = ROOT / "docs" / "api.md"
LOWER_LAYER = ("dtensor.spec", "dtensor.buffers")  # public modules, not packages
_EXAMPLE = re.compile(r"^\s*(Example|>>>)", re.MULTILINE)


def _static_all(path: Path, module: str) -> list[str] | None:
    """The ``__all__`` of a source file: read without importing it when it is a literal
    list, else (built from other lists) by importing the module."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", 0)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            if isinstance(node, ast.Assign):
                try:
                    return list(ast.literal_eval(node.value))
                except ValueError:
                    pass
            return list(importlib.import_module(module).__all__)
    return None


def public_modules(root: Path = ROOT) -> dict[str, list[str]]:
    """``{module name: its __all__}`` for every public package with one, and LOWER_LAYER."""
    found: dict[str, list[str]] = {}
    for top in ROOTS:
        for path in sorted((root / top).rglob("__init__.py")):
            parts = list(path.parent.relative_to(root).parts)
            if any(p.startswith("_") for p in parts):
                continue
            names = _static_all(path, ".".join(parts))
            if names is not None:
                found[".".join(parts)] = names
    for module in LOWER_LAYER:
        path = root / (module.replace(".", "/") + ".py")
        if path.exists():
            found[module] = _static_all(path, module) or []
    return found


MODULES = public_modules()
NAMES = [(module, name) for module, names in MODULES.items() for name in names]


def _sections(text: str) -> dict[str, str]:
    """docs/api.md's ``## `module` `` sections by module name."""
    parts = re.split(r"^## `([\w.]+)`[^\n]*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_packages_are_found():
    assert {
        "device_mesh",
        "dtensor",
        "dtensor.parallel",
        "dtensor.checkpoint",
        "dtensor.experimental",
        "fsdp2",
        "dtensor.spec",
        "dtensor.buffers",
    } <= set(MODULES)


def test_every_public_name_has_an_example():
    missing = []
    for module, name in NAMES:
        obj = getattr(importlib.import_module(module), name)
        if not (inspect.isclass(obj) or callable(obj) or inspect.ismodule(obj)):
            continue  # a constant (a tuple of names) has no docstring of its own: its row does
        doc = inspect.getdoc(obj) or ""
        if not _EXAMPLE.search(doc):
            missing.append(f"{module}.{name}")
    assert not missing, (
        "public names whose docstring has no example (add an 'Example::' block with '>>>' "
        "lines): " + ", ".join(missing)
    )


def test_every_public_name_is_in_the_api_reference():
    sections = _sections(API_DOC.read_text())
    missing = []
    for module, name in NAMES:
        body = sections.get(module, "")
        if not re.search(rf"^\s*\|?\s*`{re.escape(name)}[`(\[]", body, flags=re.MULTILINE):
            where = module if module in sections else f"{module} (add a section '## `{module}`')"
            missing.append(f"{name} in {where}")
    assert not missing, "docs/api.md lacks a row for: " + "; ".join(missing)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_static_all_is_the_runtime_all(module):
    assert list(importlib.import_module(module).__all__) == MODULES[module]
