"""Every operator of PyTorch's OpInfo database on sharded DTensors equals the op on full tensors.

Like PyTorch's own ``test_dtensor_ops.py``: the float32 CPU OpInfos of ``op_db`` and the
``_foreach_`` ops, a sample each, forward and backward, on Replicate, Shard(0) and
Shard(last) at world size 2, and Shard(0) again at world size 3 (other splits, other empty
blocks). ``TEST_ALL=1`` adds a 2-D mesh (Shard(last), Shard(0)) at both world sizes and
Shard(last) at 3 (make test stays within its 5 minutes; the 2-D mesh at 2 ranks is a 2x1
mesh, mostly a repeat of Shard(last)).
See ``tests/_op_coverage.py``; ``benchmarks/op_coverage.py`` runs two samples each and
PyTorch's DTensor beside ours.

What may fail is listed in ``tests/op_coverage_expected.txt``, one line per
``op|layout|direction@world size`` with the outcome and why. The list can only shrink: an
outcome not on it fails the test, and so does a listed case that now passes (delete its
line). A ``wrong`` outcome (values or metadata that differ from the op on full tensors) may
never be listed. ``TEST_ALL=1 OPCOV_UPDATE=1`` rewrites the list from a run of every layout
(review the diff).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.harness import run_on_ranks

EXPECTED = Path(__file__).with_name("op_coverage_expected.txt")
RUNS = {2: ("replicate", "shard0", "shardlast"), 3: ("shard0",)}
RUNS_ALL = {2: (*RUNS[2], "shard2d"), 3: ("shard0", "shardlast", "shard2d")}  # TEST_ALL=1


def _runs() -> dict:
    return RUNS_ALL if os.environ.get("TEST_ALL") else RUNS


def _coverage(path: str, layouts: tuple) -> None:
    import torch.distributed as dist

    from tests import _op_coverage as oc

    res = oc.run_ops(oc.ours(), layouts, samples_per_op=1)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps({"|".join(k): v for k, v in res.items()}))


def read_expected(path: Path = EXPECTED) -> dict:
    """``{"op|layout|dir@ws": (outcome, reason)}`` from the checked-in list."""
    out = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, outcome, reason = (part.strip() for part in line.split("  ", 2))
        out[key] = (outcome, reason)
    return out


def write_expected(results: dict, path: Path = EXPECTED) -> None:
    lines = [
        "# Expected failures of tests/test_dtensor_op_coverage.py: op|layout|direction@world size,",
        "# outcome, reason. This list may only shrink; 'wrong' is never allowed.",
    ]
    for key in sorted(results):
        outcome, reason = results[key]
        if outcome not in ("pass", "skip"):
            lines.append(f"{key}  {outcome}  {reason}")
    path.write_text("\n".join(lines) + "\n")


def _run(ws: int, tmp_path) -> dict:
    out = tmp_path / f"coverage_ws{ws}.json"
    run_on_ranks(ws, _coverage, timeout_s=600, path=str(out), layouts=_runs()[ws])
    got = json.loads(out.read_text())
    return {f"{k}@{ws}": tuple(v) for k, v in got.items()}


@pytest.mark.timeout(900)
def test_op_coverage_matches_the_expected_list(tmp_path):
    results = {}
    for ws in _runs():
        results.update(_run(ws, tmp_path))
    if os.environ.get("OPCOV_UPDATE"):
        write_expected(results)
    ran = {f"{layout}@{ws}" for ws, layouts in _runs().items() for layout in layouts}
    # entries of layouts this run did not cover (TEST_ALL's) are not judged by it
    expected = {
        k: v
        for k, v in read_expected().items()
        if k.split("|", 1)[1].replace("|fwd", "").replace("|bwd", "") in ran
    }
    wrong = sorted(f"{k}: {d}" for k, (o, d) in results.items() if o == "wrong")
    assert not wrong, f"{len(wrong)} ops give values or metadata that differ:\n" + "\n".join(wrong)
    listed_wrong = sorted(k for k, (o, _) in expected.items() if o == "wrong")
    assert not listed_wrong, f"'wrong' may not be listed as expected: {listed_wrong}"
    new = sorted(
        f"{k}: {o} {d}"
        for k, (o, d) in results.items()
        if o not in ("pass", "skip") and expected.get(k, ("",))[0] != o
    )
    assert not new, "failures not on tests/op_coverage_expected.txt:\n" + "\n".join(new)
    fixed = sorted(k for k in expected if results.get(k, ("pass",))[0] in ("pass", "skip"))
    assert not fixed, (
        "listed as failing but pass now (delete their lines from "
        "tests/op_coverage_expected.txt):\n" + "\n".join(fixed)
    )
