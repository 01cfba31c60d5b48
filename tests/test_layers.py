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


# Each layer builds on the ones below through their public names only: no private module or
# name imported from them, none of DTensor's internals read or written from above dtensor, and
# no private member of DeviceMesh used from above device_mesh.
_LOWER = {"dtensor", "device_mesh"}
_DTENSOR_INTERNALS = {"_local_tensor", "_spec", "_local"}
_LOWER_CLASSES = {"DTensor", "DeviceMesh", "DTensorSpec", "Placement", "Shard", "Partial"}


def _private_members(path: pathlib.Path, cls: str) -> set[str]:
    """The private methods and attributes (``self._x = ...``, class-level ``_x = ...``) of
    class ``cls`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = {
        t.id
        for n in body.body
        for t in getattr(n, "targets", [getattr(n, "target", 0)])
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


_MESH_INTERNALS = _private_members(ROOT / "device_mesh" / "mesh.py", "DeviceMesh")


def _own_names(package: pathlib.Path) -> set[str]:
    """The functions, classes and attributes a package defines itself: ``x._name`` of one of
    them is the package's own, whatever else shares the name."""
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def _private_attribute_use(node, path, lower, own) -> str | None:
    where = f"{path.name}:{node.lineno}"
    private = node.attr.startswith("_") and not node.attr.startswith("__")
    if private and getattr(node.value, "id", None) in _LOWER_CLASSES:
        return f"{where} uses {node.value.id}.{node.attr}"
    if "dtensor" in lower and node.attr in _DTENSOR_INTERNALS:
        verb = "writes" if isinstance(node.ctx, ast.Store) else "reads"
        return f"{where} {verb} DTensor's .{node.attr}"
    receiver = getattr(node.value, "id", None)
    if node.attr in _MESH_INTERNALS and node.attr not in own and receiver not in ("self", "cls"):
        return f"{where} uses DeviceMesh's .{node.attr} ({ast.unparse(node)})"
    return None


def _private_uses(path: pathlib.Path, lower=frozenset(_LOWER), own=frozenset()) -> list[str]:
    """Private names of the ``lower`` packages that ``path`` imports or uses; ``own``: the
    names its package defines itself (see ``_own_names``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        modules, names = [], []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute):
            hit = _private_attribute_use(node, path, lower, own)
            if hit:
                bad.append(hit)
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] not in lower:
                continue
            private = [p for p in parts[1:] if p.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{path.name}:{node.lineno} imports {private} from {module}")
    return bad


def _package_private_uses(package: str, lower) -> list[str]:
    own = frozenset(_own_names(ROOT / package))
    return [
        hit
        for path in sorted((ROOT / package).rglob("*.py"))
        for hit in _private_uses(path, frozenset(lower), own)
    ]


def test_fsdp2_uses_only_public_dtensor_and_device_mesh_names():
    bad = _package_private_uses("fsdp2", _LOWER)
    assert not bad, "use the public names (dtensor.comm, dtensor.spec, ...):\n" + "\n".join(bad)


def test_dtensor_uses_only_public_device_mesh_names():
    """dtensor (with dtensor.parallel and dtensor.checkpoint) builds on device_mesh's public
    surface: what it keeps with a mesh goes through ``DeviceMesh.resources``."""
    bad = _package_private_uses("dtensor", {"device_mesh"})
    assert not bad, "use device_mesh's public names (mesh.resources, ...):\n" + "\n".join(bad)


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
        "g = mesh._dim_groups[0]\n"
        "root = spec.mesh._get_root_mesh()\n"
        "self._root = m._flatten\n"  # self's own; _flatten: a name the package defines
    )
    hits = _private_uses(path, own=frozenset({"_flatten"}))
    lines = (1, 2, 3, 4, 7, 8, 9, 10, 11)
    assert [h.split(" ", 1)[0] for h in hits] == [f"sample.py:{i}" for i in lines], hits
    assert "writes DTensor's ._local_tensor" in hits[4] and "reads DTensor's ._spec" in hits[5]
    assert "uses DeviceMesh._concatenate" in hits[6]
    assert "uses DeviceMesh's ._dim_groups (mesh._dim_groups)" in hits[7]
    assert "._get_root_mesh (spec.mesh._get_root_mesh)" in hits[8]
    # dtensor owns DTensor's internals: only device_mesh's names are checked there
    below_dtensor = _private_uses(
        path, lower=frozenset({"device_mesh"}), own=frozenset({"_flatten"})
    )
    assert [h.split(" ", 1)[0] for h in below_dtensor] == [f"sample.py:{i}" for i in (4, 9, 10, 11)]


# --------------------------------------------------------------------------- import cycles
_LIBRARY = ("device_mesh", "dtensor", "fsdp2")


def _module_files(root: pathlib.Path, packages=_LIBRARY) -> dict[str, pathlib.Path]:
    """``{module name: file}`` of every module of ``packages``; a package is its
    ``pkg.__init__`` (what ``import pkg`` runs), so it is a node of its own."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[".".join(path.relative_to(root).with_suffix("").parts)] = path
    return found


def _resolve(name: str, modules) -> str | None:
    """The graph node of dotted ``name``: the module itself, a package's ``__init__``, or
    (for ``pkg.attr``) the longest prefix that is one; None outside the library."""
    parts = name.split(".")
    while parts:
        dotted = ".".join(parts)
        if dotted in modules:
            return dotted
        if f"{dotted}.__init__" in modules:
            return f"{dotted}.__init__"
        parts.pop()
    return None


def _under_type_checking(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks (never run)."""
    skipped = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test):
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def _import_edges(module: str, path: pathlib.Path, modules) -> dict[str, int]:
    """``{imported module: first line}`` for every import anywhere in ``path``: module level,
    inside functions and classes, relative or absolute (``if TYPE_CHECKING:`` aside)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _under_type_checking(tree)
    package = module.rsplit(".", 1)[0]  # a module's package; a package's own __init__'s too
    edges: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import name`: pkg.name if that is a module
                full = f"{base}.{alias.name}"
                named_module = _resolve(full, modules) in (full, f"{full}.__init__")
                targets.append(full if named_module else base)
        for target in targets:
            node_name = _resolve(target, modules)
            if node_name is not None and node_name != module:
                edges.setdefault(node_name, node.lineno)
    return edges


def _import_graph(root: pathlib.Path, packages=_LIBRARY) -> dict[str, dict[str, int]]:
    modules = _module_files(root, packages)
    return {m: _import_edges(m, path, modules) for m, path in modules.items()}


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def _describe_cycle(cycle: list[str], graph) -> str:
    return "\n".join(f"  {a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:]))


def test_the_library_has_no_import_cycle():
    """The modules of device_mesh, dtensor and fsdp2 import one another without a cycle,
    counting every import: at module level and inside function bodies (an import deferred
    into a function is still a dependency, and a cycle closed that way is still a cycle), and
    relative ones (``from . import x``). Imports under ``if TYPE_CHECKING:`` are left out:
    they never run, and with ``from __future__ import annotations`` they only name types
    (the layer test above still counts them).

    A package is the node of its ``__init__.py``, what ``import pkg`` runs: ``from dtensor
    import DTensor`` depends on ``dtensor/__init__.py``, ``from dtensor import comm`` on
    ``dtensor/comm.py`` (a submodule named by a from-import is that module). So a submodule
    that imports a sibling through its package's ``__init__`` (``from dtensor import
    DTensor`` inside dtensor) closes a cycle with the ``__init__`` that imports it: inside a
    package, siblings import each other directly (``from dtensor.tensor import DTensor``).
    The implicit import of the parent packages (``import a.b`` runs ``a/__init__.py``
    first) is no edge: every submodule would otherwise close a cycle with its ``__init__``.
    """
    graph = _import_graph(ROOT)
    assert "dtensor.__init__" in graph and "device_mesh.mesh" in graph
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle:\n" + _describe_cycle(cycle, graph)


def test_the_cycle_check_sees_deferred_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.low import f\n")
    (pkg / "low.py").write_text("def f():\n    from .high import g\n")  # deferred, relative
    (pkg / "high.py").write_text("from pkg import low, sub\n")  # modules pkg.low, pkg.sub
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.leaf import h\n")
    (pkg / "sub" / "leaf.py").write_text(
        "from pkg.sub import h\n"  # through its package's __init__
        "if TYPE_CHECKING:\n    import pkg.high\n"  # never runs: no edge
    )
    graph = _import_graph(tmp_path, ("pkg",))
    assert graph["pkg.__init__"] == {"pkg.low": 1}
    assert graph["pkg.low"] == {"pkg.high": 2}
    assert graph["pkg.high"] == {"pkg.low": 1, "pkg.sub.__init__": 1}
    assert graph["pkg.sub.leaf"] == {"pkg.sub.__init__": 1}
    assert _find_cycle(graph) == ["pkg.low", "pkg.high", "pkg.low"]
    del graph["pkg.high"]["pkg.low"]
    assert _find_cycle(graph) == ["pkg.sub.__init__", "pkg.sub.leaf", "pkg.sub.__init__"]
    del graph["pkg.sub.leaf"]["pkg.sub.__init__"]
    assert _find_cycle(graph) is None


def test_no_library_function_is_over_60_lines():
    """A function reads as one step when it fits on a screen: none of the library's is over
    60 lines, def to last line, docstring included (``ruff check`` holds their complexity
    to 15: pyproject.toml). Split a longer one into named steps."""
    long = []
    for package in ("device_mesh", "dtensor", "fsdp2"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
