"""Run one benchmark arm in its own process(es) and read back the JSON it writes.

Every benchmark script re-launches itself as a worker (``--worker ... --out FILE``), under
``torchrun`` for a world of ``nproc`` ranks or as one plain process, so each arm's peak RSS is
its own. Rank 0 writes its result as JSON to ``FILE``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run_worker(script: str, flags: list[str], *, nproc: int | None, what: str) -> dict:
    """``script flags --out FILE`` under torchrun with ``nproc`` ranks (None: one plain
    process); returns the JSON the worker wrote. Exits naming ``what`` if it fails.

    Example::

        >>> run_worker(__file__, ["--worker", "ours"], nproc=2, what="ours ws2")["step_s"]
        6.1
    """
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    launch = [sys.executable]
    if nproc is not None:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run([*launch, script, *flags, "--out", out], env=env,
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"benchmark arm {what} failed:\n{proc.stderr[-4000:]}")
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)
