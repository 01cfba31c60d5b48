"""Process groups the library creates on its own: the implicit default group of a lone process
(no environment writes, a timeout argument) and async checkpointing's background group
(held weakly in device_mesh's cache, recreated after a re-initialization)."""

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

from device_mesh import groups as _groups

# One fresh interpreter (a default group in pytest's own process would leak into other tests).
LONE_PROCESS_SCRIPT = textwrap.dedent(
    """
    import gc, os, tempfile, weakref
    from datetime import timedelta
    import torch, torch.distributed as dist

    calls = []
    real_init = dist.init_process_group

    def recording_init(*args, **kwargs):
        calls.append(kwargs)
        return real_init(*args, **kwargs)

    dist.init_process_group = recording_init
    from device_mesh import groups as _groups, init_device_mesh
    from dtensor import checkpoint as dcp
    from dtensor.checkpoint._comm import Group

    env = dict(os.environ)
    init_device_mesh("cpu", (1,))
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    changed = {k for k in env.keys() | os.environ.keys() if env.get(k) != os.environ.get(k)}
    assert not changed, f"the library wrote os.environ: {sorted(changed)}"
    assert calls[-1]["timeout"] == timedelta(seconds=600), calls[-1]

    # async checkpointing's background group: one per ranks, held weakly
    tmp = tempfile.mkdtemp()
    dcp.async_save({"w": torch.arange(5.0)}, checkpoint_id=f"{tmp}/a").result()
    side = Group.of().companion().pg
    assert side is not dist.group.WORLD and Group.of().companion().pg is side
    side_ref = weakref.ref(side)
    del side
    dist.destroy_process_group()
    gc.collect()
    assert side_ref() is None, "destroy_process_group() did not free the background group"

    # a re-initialized world gets a new background group, not the destroyed one
    _groups.ensure_default_group("cpu", timeout=timedelta(seconds=7))
    assert calls[-1]["timeout"] == timedelta(seconds=7), calls[-1]
    dcp.async_save({"w": torch.arange(6.0)}, checkpoint_id=f"{tmp}/b").result()
    out = {"w": torch.zeros(6)}
    dcp.load(out, checkpoint_id=f"{tmp}/b")
    assert torch.equal(out["w"], torch.arange(6.0))
    dist.destroy_process_group()

    # DEVICE_MESH_TIMEOUT_S overrides the default of an implicit initialization
    os.environ["DEVICE_MESH_TIMEOUT_S"] = "9"
    init_device_mesh("cpu", (1,))
    assert calls[-1]["timeout"] == timedelta(seconds=9), calls[-1]
    dist.destroy_process_group()
    print("lone process ok", flush=True)
    """
)


def test_lone_process_default_group_and_background_group_lifetime(tmp_path):
    script = tmp_path / "lone.py"
    script.write_text(LONE_PROCESS_SCRIPT)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DEVICE_MESH_TIMEOUT_S")
    }
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0 and "lone process ok" in out.stdout, out.stdout + out.stderr


def test_timeout_comes_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv("DEVICE_MESH_TIMEOUT_S", raising=False)
    assert _groups.default_timeout() == timedelta(seconds=600)
    monkeypatch.setenv("DEVICE_MESH_TIMEOUT_S", "2.5")
    assert _groups.default_timeout() == timedelta(seconds=2.5)
    for bad in ("ten", "0", "-3", "inf", "nan", ""):
        monkeypatch.setenv("DEVICE_MESH_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="DEVICE_MESH_TIMEOUT_S must be a positive number"):
            _groups.default_timeout()
