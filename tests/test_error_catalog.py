"""Every user-facing error the library raises has an entry in docs/troubleshooting.md.

The source of ``device_mesh/``, ``dtensor/`` and ``fsdp2/`` is parsed (no import, no process
group) for ``raise SomeError(message)``. An error counts when its class is one a user sees
(``ValueError``, ``TypeError``, ``RuntimeError``, ``NotImplementedError``, ``KeyError``,
``IndexError``, ``LookupError``, ``AttributeError``, ``argparse.ArgumentTypeError`` or one of
the library's own classes - any class whose name ends in ``Error`` except a bare
``AssertionError``, which marks an internal invariant) and it has a message.

Each error's *key* is what the catalog must contain, verbatim:

- a message written as a literal, an f-string, or literals joined with ``+``, ``%`` or
  ``.format()``: its template, each substituted value written ``{}``, whitespace collapsed,
  cut to its first ``KEY_CHARS`` characters (``{}: reshard_after_forward must be ...``);
- a message built by a helper (``torch_dtensor_message(...)``, ``"\\n".join(lines)``), or a
  template with fewer than ``MIN_LITERAL`` characters of its own text: the raising
  function's qualified name in backticks, ``dtensor._dispatch._check_inputs``.

In the catalog, ``\\|`` counts as ``|`` (a pipe inside a table cell). A failure lists, for each
missing error, the line to add under its area's heading.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("device_mesh", "dtensor", "fsdp2")
CATALOG = ROOT / "docs" / "troubleshooting.md"
KEY_CHARS = 60
MIN_LITERAL = 12
_INTERNAL = {"AssertionError"}

# Where a new entry goes: the first prefix of the file's path that matches names the heading.
AREAS = [
    ("device_mesh/", "Device mesh"),
    ("dtensor/parallel/", "Tensor parallelism"),
    ("dtensor/checkpoint/", "Checkpoints"),
    ("dtensor/experimental/", "DTensor"),
    ("dtensor/", "DTensor"),
    ("fsdp2/tools/", "fully_shard tools"),
    ("fsdp2/", "fully_shard"),
]


@dataclass(frozen=True)
class RaisedError:
    path: str  # relative to the repository root
    line: int
    qualname: str  # module.function (or module.Class.method)
    cls: str
    key: str
    message: str  # the template as a reader sees it (uncut), for the suggested line

    @property
    def area(self) -> str:
        return next(area for prefix, area in AREAS if self.path.startswith(prefix))

    def suggestion(self) -> str:
        shown = self.message.replace("|", "\\|")
        return (
            f"| `{self.cls}` | {shown} | `{self.qualname}` | <what it means> | <what to do> |"
            f"  (docs/troubleshooting.md, section '## {self.area}'; raised at "
            f"{self.path}:{self.line}; the key `{self.key}` must appear verbatim)"
        )


def _template(node: ast.expr) -> str | None:
    """The message's text with each substituted value as ``{}``; None when it is computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else "{}") + (right if right is not None else "{}")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        left = _template(node.left)
        return None if left is None else re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgx]", "{}", left)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
    ):
        left = _template(node.func.value)
        return None if left is None else re.sub(r"\{[^{}]*\}", "{}", left)
    return None


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class _Finder(ast.NodeVisitor):
    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root, self.scope, self.found = path, root, [], []
        self.module = _module(path, root)

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Raise(self, node: ast.Raise) -> None:
        exc = node.exc
        if not isinstance(exc, ast.Call) or not exc.args:
            return  # a re-raise, or an error without a message (an abstract method)
        cls = ast.unparse(exc.func)
        if not cls.endswith("Error") or cls in _INTERNAL:
            return
        qualname = ".".join([self.module, *self.scope])
        template = _template(exc.args[0])
        literal = 0 if template is None else len(template.replace("{}", "").strip(" :.,"))
        if template is None or literal < MIN_LITERAL:
            key, message = f"`{qualname}`", f"(message built by `{ast.unparse(exc.args[0])}`)"
        else:
            message = _collapse(template)
            key = message[:KEY_CHARS]
        rel = str(self.path.relative_to(self.root))
        self.found.append(RaisedError(rel, node.lineno, qualname, cls, key, message))


@functools.cache
def raised_errors(root: Path = ROOT) -> tuple[RaisedError, ...]:
    """Every user-facing error raised in the library's source, in file order."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            finder = _Finder(path, root)
            finder.visit(ast.parse(path.read_text(), filename=str(path)))
            found.extend(finder.found)
    return tuple(found)


def _catalog_text() -> str:
    return _collapse(CATALOG.read_text().replace("\\|", "|"))


def test_every_raised_error_is_in_the_catalog():
    text = _catalog_text()
    missing = [e for e in raised_errors() if _collapse(e.key.replace("\\|", "|")) not in text]
    assert not missing, (
        f"{len(missing)} error(s) the library raises have no entry in docs/troubleshooting.md; "
        "add a row for each (the message may be shortened, but keep the key):\n"
        + "\n".join(e.suggestion() for e in missing)
    )


def test_the_scan_finds_what_it_should():
    errors = raised_errors()
    assert len(errors) > 150  # the library raises ~230 user errors; a broken scan finds few
    by_key = {e.key: e for e in errors}
    # an f-string message: its template, placeholders as {}
    assert any(k.startswith("{}: local shapes do not fit shape={}") for k in by_key)
    # a message built by a helper: the raising function
    assert "`dtensor._dispatch._check_inputs`" in by_key
    # the library's own classes count; internal invariants do not
    classes = {e.cls for e in errors}
    assert {"CheckpointError", "FSDPStateError", "ValueError", "TypeError"} <= classes
    assert "AssertionError" not in classes


def test_templates_of_each_message_form():
    def key(src: str) -> str | None:
        return _template(ast.parse(src, mode="eval").body)

    assert key("'plain'") == "plain"
    assert key("f'{api}: x must be {n!r}'") == "{}: x must be {}"
    assert key("f'a {b}' + ' c'") == "a {} c"
    assert key("'a %s b %d' % (x, y)") == "a {} b {}"
    assert key("'a {} b {name}'.format(x, name=y)") == "a {} b {}"
    assert key("'\\n'.join(lines)") is None
    assert key("helper(x) + ' tail'") == "{} tail"
