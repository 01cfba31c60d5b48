"""GPU checks of fully_shard (NCCL, CUDA streams, CPU offload); skipped without a GPU.

Each check runs in its own real ``torchrun`` job (see tests/gpu_checks.py) so that NCCL
and CUDA state never leak into the gloo worker pool the other tests share.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (verified on a lent GPU only)")


def _torchrun(check: str, nproc: int = 1) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(ROOT / "tests" / "gpu_checks.py"), check,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0 and f"gpu check {check}: ok" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )


def test_bf16_mixed_precision_matches_torch_fsdp2_on_one_gpu():
    _torchrun("bf16")


def test_cpu_offload_matches_no_offload_and_keeps_state_on_host():
    _torchrun("offload")


def test_cuda_memory_counters_agree_with_tracked_state():
    _torchrun("memory")


@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_match_one_process():
    _torchrun("parity2", nproc=2)
