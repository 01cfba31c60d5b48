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
            # fsdp2/tools/tables.py renders the tools' summaries for command lines and
            # examples only: presentation, imported by nothing in the library
            if "rich" in _imported_roots(path) and path != ROOT / "fsdp2/tools/tables.py":
                bad.append(f"{path.relative_to(ROOT)} imports rich")
    assert not bad, "\n".join(bad)


# fsdp2 builds on dtensor and device_mesh through their public names only: no private module
# or name imported from them, and none of DTensor's internals read or written.
_LOWER = {"dtensor", "device_mesh"}
_DTENSOR_INTERNALS = {"_local_tensor", "_spec", "_local"}
_LOWER_CLASSES = {"DTensor", "DeviceMesh", "DTensorSpec", "Placement", "Shard", "Partial"}


def _private_uses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        modules, names = [], []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            names = [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and getattr(node.value, "id", None) in _LOWER_CLASSES
        ):
            bad.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
            continue
        elif isinstance(node, ast.Attribute) and node.attr in _DTENSOR_INTERNALS:
            verb = "writes" if isinstance(node.ctx, ast.Store) else "reads"
            bad.append(f"{path.name}:{node.lineno} {verb} DTensor's .{node.attr}")
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] not in _LOWER:
                continue
            private = [p for p in parts[1:] if p.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{path.name}:{node.lineno} imports {private} from {module}")
    return bad


def test_fsdp2_uses_only_public_dtensor_and_device_mesh_names():
    bad = [hit for path in sorted((ROOT / "fsdp2").rglob("*.py")) for hit in _private_uses(path)]
    assert not bad, "use the public names (dtensor.comm, dtensor.spec, ...):\n" + "\n".join(bad)


def test_the_private_name_check_catches_each_kind(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text(
        "import dtensor._collectives\n"
        "from dtensor._spec import DTensorSpec\n"
        "from dtensor.placement import _StridedShard\n"
        "from device_mesh import _groups\n"
        "from dtensor.comm import Pending\n"  # public: not reported
        "from torch._C import _disabled_torch_function_impl\n"  # not ours: not reported
        "dt._local_tensor = x\n"
        "y = dt._spec\n"
        "m = DeviceMesh._concatenate([a, b])\n"
    )
    hits = _private_uses(path)
    assert [h.split(" ", 1)[0] for h in hits] == [f"sample.py:{i}" for i in (1, 2, 3, 4, 7, 8, 9)]
    assert "writes DTensor's ._local_tensor" in hits[4] and "reads DTensor's ._spec" in hits[5]
    assert "uses DeviceMesh._concatenate" in hits[6]
