"""A short sample of the soak (tests/soak.py; ``make soak`` runs 1,000 steps): 60 steps with a
checkpoint every 20, and nothing a rank holds may grow from step 10 to step 60 - live tensor
bytes within 1%, the same process groups, threads, open files, Python objects (by type) and
library buffers.

RSS is measured but not asserted here: the test pool's workers run with PyTorch's own c10d
flight recorder on, whose ring of entries fills as a run goes (over 50 steps the RSS grew
0.7-1.1%, 0.3-0.8% after ``malloc_trim``). ``make soak`` runs its workers with that ring off
and judges the trimmed RSS over 1,000 steps (tests/soak.py's docstring has the measurements)."""

from __future__ import annotations

import pytest

from tests import soak


@pytest.mark.nightly  # 50 s of make test's time; make test-all runs it
@pytest.mark.parametrize("layout", ["fsdp", "2d"])
def test_nothing_grows_over_60_steps_and_3_checkpoints(layout, tmp_path):
    # one block of width 128: the TP activations (4 x 64 x 128 floats) still use the workspace
    results = soak.run(layout, 60, 20, early=10, directory=tmp_path, dim=128, layers=1)
    assert len(results) == soak.LAYOUTS[layout][0]
    for r in results:
        assert soak.problems(r, 10, 60, rss=False) == [], r["rank"]
        b = r["points"]["60"]
        assert b["tensor_bytes"] > 0 and b["process_groups"] >= 1
        assert r["losses"]["60"] < r["losses"]["10"]  # it trained
    if layout == "2d":  # the tensor-parallel dim's workspace was in use and kept its buffers
        assert all(r["points"]["60"]["workspace_buffers"] > 0 for r in results)


def test_problems_names_what_grew():
    same = {k: 1000 for k in (*soak.EXACT, *soak.WITHIN_1PCT)}
    same.update(objects=10, by_type={"builtins.dict": 5})
    grown = dict(same, threads=1001, rss_bytes=1020, rss_trimmed_bytes=1020, objects=12)
    grown["by_type"] = {"builtins.dict": 7}
    found = soak.problems({"points": {"10": same, "60": grown}}, 10, 60)
    assert found == [
        "threads: 1000 -> 1001",
        "rss_trimmed_bytes: 1,000 -> 1,020 (+2.00%)",
        "objects: 10 -> 12 (builtins.dict +2)",
    ]
    assert soak.problems({"points": {"10": same, "60": dict(same)}}, 10, 60) == []
    assert soak.problems({"points": {"10": same, "60": grown}}, 10, 60, rss=False) == [
        "threads: 1000 -> 1001",
        "objects: 10 -> 12 (builtins.dict +2)",
    ]
