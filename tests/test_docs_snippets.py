"""Every ```python block of README.md and docs/*.md runs, or says in the docs why it cannot.

The convention, an HTML comment right above a block (invisible on the rendered page):

    <!-- snippet: ranks=4 -->                         run on a world of 4 ranks
    <!-- snippet: skip: needs a GPU -->               not run; the reason is required
    <!-- snippet: ranks=2                             setup lines run before the block, for
    import torch                                      names the prose takes as given (a
    model = ...                                       model, a batch)
    -->

A block without a comment runs in a world of one. Blocks run in the harness's worker pools
(tests/harness.py), every rank in the same fresh temporary directory (relative paths such as
``ckpt/step-000100`` land there) and with the repository root on ``sys.path`` (what a reader
has when running from the clone's root, which ``from examples.gpt import ...`` needs). A
failure names the file and line of the block; tracebacks carry the doc's own line numbers.
A skipped block is still compiled, so its syntax is checked.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*```(\w*)\s*$")  # indented too: a block inside a list item
_MARKER = re.compile(r"^<!-- snippet:(.*)$")


@dataclass(frozen=True)
class Snippet:
    doc: str  # path relative to the repository root
    line: int  # line of the first line of code (1-based)
    code: str
    ranks: int = 1
    setup: str = ""
    skip: str | None = None

    @property
    def label(self) -> str:
        return f"{self.doc}:{self.line}"


def _parse_marker(lines: list[str], start: int, doc: str) -> tuple[dict, int]:
    """The options and setup of the marker comment starting at ``lines[start]``, and the
    index of its last line."""
    first = _MARKER.match(lines[start]).group(1).strip()
    body, end = [], start
    if first.endswith("-->"):
        first = first[:-3].strip()
    else:
        end += 1
        while end < len(lines) and lines[end].strip() != "-->":
            body.append(lines[end])
            end += 1
        if end == len(lines):
            raise ValueError(f"{doc}:{start + 1}: snippet comment never closed with '-->'")
    where = f"{doc}:{start + 1}"
    if first.startswith("skip"):
        reason = first[len("skip") :].lstrip(":").strip()
        if not reason or body:
            raise ValueError(f"{where}: write '<!-- snippet: skip: <reason> -->' on one line")
        return {"skip": reason}, end
    options = {}
    for item in first.split():
        key, _, value = item.partition("=")
        if key != "ranks" or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{where}: unknown snippet option {item!r}; use ranks=N or skip:")
        options["ranks"] = int(value)
    options["setup"] = "\n".join(body)
    return options, end


def snippets(path: Path, root: Path = ROOT) -> list[Snippet]:
    """Every ```python block of ``path`` with its marker's options."""
    doc = str(path.relative_to(root))
    lines = path.read_text().splitlines()
    found, pending, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        if _MARKER.match(line):
            pending, i = _parse_marker(lines, i, doc)
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].lstrip().startswith("```"):
                end += 1
            if fence.group(1) == "python":
                code = textwrap.dedent("\n".join(lines[i + 1 : end]))
                found.append(Snippet(doc, i + 2, code, **(pending or {})))
            elif pending is not None:
                raise ValueError(f"{doc}:{i + 1}: a snippet comment above a non-python block")
            pending, i = None, end + 1
            continue
        if pending is not None and line.strip():
            raise ValueError(f"{doc}:{i + 1}: a snippet comment must sit right above its block")
        i += 1
    return found


ALL = [s for path in DOCS for s in snippets(path)]


def _run_snippet(doc: str, line: int, code: str, setup: str, workdir: str) -> None:
    """Runs on every rank: the setup, then the block, compiled under the doc's name with its
    line numbers, in ``workdir``; what the block prints is swallowed."""
    namespace = {"__name__": "__snippet__"}
    here = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if setup:
                exec(
                    compile(setup, f"{doc} (setup of the block at line {line})", "exec"), namespace
                )
            exec(compile("\n" * (line - 1) + code, str(ROOT / doc), "exec"), namespace)
    finally:
        os.chdir(here)


@pytest.mark.parametrize("snippet", ALL, ids=[s.label for s in ALL])
def test_doc_snippet_runs(snippet: Snippet, tmp_path):
    compile("\n" * (snippet.line - 1) + snippet.code, snippet.label, "exec")  # syntax, always
    if snippet.skip is not None:
        pytest.skip(f"{snippet.label}: {snippet.skip}")
    run_on_ranks(
        snippet.ranks,
        _run_snippet,
        doc=snippet.doc,
        line=snippet.line,
        code=snippet.code,
        setup=snippet.setup,
        workdir=str(tmp_path),
    )


def test_every_doc_is_scanned_and_markers_parse(tmp_path):
    assert {s.doc for s in ALL} >= {"README.md", "docs/dtensor.md", "docs/device_mesh.md"}
    bad = tmp_path / "bad.md"
    cases = {
        "<!-- snippet: skip -->\n```python\npass\n```\n": "skip: <reason>",
        "<!-- snippet: ranks=two -->\n```python\npass\n```\n": "unknown snippet option",
        "<!-- snippet: ranks=2 -->\n\ntext\n```python\npass\n```\n": "right above",
        "<!-- snippet: ranks=2\nx = 1\n": "never closed",
    }
    for text, message in cases.items():
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            snippets(bad, root=tmp_path)
    bad.write_text("<!-- snippet: ranks=3\nx = 1\n-->\n\n```python\nprint(x)\n```\n")
    (s,) = snippets(bad, root=tmp_path)
    assert (s.ranks, s.setup, s.code, s.line) == (3, "x = 1", "print(x)", 6)
