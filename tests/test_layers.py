"""Imports point only down the layers: device_mesh <- dtensor <- {parallel, checkpoint, fsdp2}."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# package -> top-level project packages it must not import
FORBIDDEN = {
    "device_mesh": {"dtensor", "fsdp2"},
    "dtensor": {"fsdp2"},
}


def _imported_roots(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down_the_layers(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        hits = _imported_roots(path) & FORBIDDEN[package]
        if hits:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, "layer violation:\n" + "\n".join(bad)


def test_library_code_does_not_print_or_import_rich():
    bad = []
    for package in ("device_mesh", "dtensor", "fsdp2"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__main__.py":
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} prints")
            if "rich" in _imported_roots(path):
                bad.append(f"{path.relative_to(ROOT)} imports rich")
    assert not bad, "\n".join(bad)
