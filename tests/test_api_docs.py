"""Every public name has a docstring with an example and a row in docs/api.md.

The public surface is what ``__all__`` lists (STYLE: "the public surface is what each
``__init__.__all__`` lists"). The packages and modules are found, not listed: every package
under ``device_mesh/``, ``dtensor/`` and ``fsdp2/`` whose ``__init__.py`` sets ``__all__``,
and every public module (no ``_`` in its path) that sets one, unless its package already
re-exports all of its names (``fsdp2.fully_shard``). A new package (``fsdp2.tools``) is
covered the day it gets an ``__all__``.

- (a) the docstring of each name (the class's for a class) contains an example: a line
  starting ``Example`` or a ``>>>`` prompt;
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
_EXAMPLE = re.compile(r"^\s*(Example|>>>)", re.MULTILINE)


def _static_all(path: Path) -> list[str] | None:
    """The literal ``__all__`` of a source file, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))
    return None


def public_modules(root: Path = ROOT) -> dict[str, list[str]]:
    """``{module name: its __all__}`` for every public package and module with one."""
    found: dict[str, list[str]] = {}
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if any(p.startswith("_") for p in parts) or "__main__" in parts:
                continue
            names = _static_all(path)
            if names is not None:
                found[".".join(parts)] = names
    for name in list(found):
        parent = name.rpartition(".")[0]
        if parent in found and set(found[name]) <= set(found[parent]):
            del found[name]  # its names are documented under the package that re-exports them
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
    } <= set(MODULES)
    assert "fsdp2.fully_shard" not in MODULES  # all re-exported by fsdp2


def test_every_public_name_has_an_example():
    missing = []
    for module, name in NAMES:
        obj = getattr(importlib.import_module(module), name)
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
