import logging
import os
import sys

import pytest

from tests import harness

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session", autouse=True)
def _worker_pools():
    """Start pools lazily; end every worker this session started when it ends."""
    yield
    harness.shutdown_all()


def pytest_terminal_summary(terminalreporter):
    s = harness.STATS
    if s["pool_starts"]:
        terminalreporter.write_line(
            f"harness: {s['pool_starts']} worker pool start(s), "
            f"{s['pool_start_seconds']:.1f}s spent starting worlds"
        )
    props = sys.modules.get("tests._properties")  # examples run per property, if any ran
    if props is not None and props.STATS:
        for line in props.summary_lines():
            terminalreporter.write_line(line)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "nightly: a long-running variant (elastic restarts, the soak, the GPU check's whole "
        "CPU run) that `make test` skips and `make test-all` (TEST_ALL=1) runs",
    )


def pytest_collection_modifyitems(config, items):
    """``make test`` stays within five minutes on the 2-core machine: the long-running
    variants marked ``nightly`` run with ``TEST_ALL=1`` (``make test-all``) only."""
    if os.environ.get("TEST_ALL") == "1":
        return
    skip = pytest.mark.skip(reason="nightly: runs in `make test-all` (TEST_ALL=1)")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption(
        "--world-size-8",
        action="store_true",
        help="also run the 8-process tests (about 50 s on a 2-core machine)",
    )
    parser.addoption(
        "--layout-seeds",
        type=int,
        default=0,
        help="extra random fully_shard layouts to train (tests/test_fsdp_layouts.py)",
    )
