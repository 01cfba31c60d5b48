"""Replacing a checkpoint ([Note: replacing a checkpoint] in dtensor/checkpoint/api.py): a
crash between the two renames leaves a checkpoint that ``load`` finds, what killed saves
leave behind is removed by the next save, and a save still in flight is never touched; a
save makes three exchanges ([Note: the three exchanges of a save])."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dtensor.checkpoint.api as api
from device_mesh import init_device_mesh
from dtensor import Shard, distribute_tensor
from dtensor import checkpoint as dcp
from dtensor.checkpoint import CheckpointError
from dtensor.checkpoint._comm import Group
from dtensor.checkpoint.tools import verify
from tests.harness import run_on_ranks


class _Killed(BaseException):
    """Stands for the process dying: no except clause of the library catches it."""


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((5, 3), value), "b": torch.arange(3.0) + value}, "step": 7}


def _load(path) -> dict:
    sd = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(3)}, "step": 0}
    dcp.load(sd, checkpoint_id=path)
    return sd


def _aside(tmp_path, kind: str) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".ckpt.{kind}-"))


def test_a_crash_between_the_two_renames_leaves_a_checkpoint_load_finds(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    dcp.save(_state(1.0), checkpoint_id=path)
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".ckpt.partial-"):
            raise _Killed("the process died between moving the old checkpoint aside and this")
        return real_rename(src, dst)

    monkeypatch.setattr(api.os, "rename", rename)
    with pytest.raises(_Killed):
        dcp.save(_state(2.0), checkpoint_id=path)
    monkeypatch.setattr(api.os, "rename", real_rename)
    assert not path.exists() and len(_aside(tmp_path, "old")) == 1
    # load finds the previous checkpoint, complete
    sd = _load(path)
    assert torch.equal(sd["model"]["w"], torch.full((5, 3), 1.0)) and sd["step"] == 7
    # the next save puts a checkpoint at the path again and drops the stale one
    dcp.save(_state(3.0), checkpoint_id=path)
    assert torch.equal(_load(path)["model"]["b"], torch.arange(3.0) + 3.0)
    assert _aside(tmp_path, "old") == [] and _aside(tmp_path, "partial") == []


def _leave_killed_save(tmp_path, token: str) -> None:
    """What a save killed while writing leaves: its partial directory, half written."""
    partial = tmp_path / f".ckpt.partial-{token}"
    partial.mkdir()
    (partial / "rank-00000.safetensors").write_bytes(b"\0" * 100)


def test_the_next_save_removes_what_killed_saves_left(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save(_state(1.0), checkpoint_id=path)
    _leave_killed_save(tmp_path, "0123456789ab")
    _leave_killed_save(tmp_path, "ba9876543210")
    kept_old = tmp_path / ".ckpt.old-00000000cafe"  # a crash after both renames
    dcp.save(_state(0.5), checkpoint_id=kept_old)  # a complete checkpoint, moved aside
    assert _aside(tmp_path, "partial") and _aside(tmp_path, "old")
    (tmp_path / "other").mkdir()
    (tmp_path / ".other.partial-0123456789ab").mkdir()  # another path's: not ours to remove
    dcp.save(_state(2.0), checkpoint_id=path)
    assert _aside(tmp_path, "partial") == [] and _aside(tmp_path, "old") == []
    assert (tmp_path / ".other.partial-0123456789ab").is_dir()
    assert verify(path) == []
    assert torch.equal(_load(path)["model"]["w"], torch.full((5, 3), 2.0))


def test_a_save_in_flight_keeps_its_partial_directory(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    dcp.save(_state(1.0), checkpoint_id=path)
    writing, release = threading.Event(), threading.Event()
    real_write = api.write_file

    def slow_write(file, items):
        if threading.current_thread().name.startswith("dcp-async-save"):
            writing.set()
            assert release.wait(timeout=60)
        return real_write(file, items)

    monkeypatch.setattr(api, "write_file", slow_write)
    future = dcp.async_save(_state(2.0), checkpoint_id=path)
    try:
        assert writing.wait(timeout=60)
        in_flight = _aside(tmp_path, "partial")
        assert len(in_flight) == 1
        _leave_killed_save(tmp_path, "0123456789ab")
        # a save of the same process to the same path meanwhile: it must not remove the
        # async save's directory, so it removes nothing (the leftover waits for a later save)
        dcp.save(_state(3.0), checkpoint_id=path)
        assert set(in_flight) <= set(_aside(tmp_path, "partial"))
        assert ".ckpt.partial-0123456789ab" in _aside(tmp_path, "partial")
    finally:
        release.set()
    md = future.result(timeout=60)  # committed: it replaced the synchronous one
    assert {"model.w", "model.b", "step"} <= set(md.state_dict_metadata)  # PyTorch's Metadata
    assert torch.equal(_load(path)["model"]["w"], torch.full((5, 3), 2.0))
    # with nothing in flight any more, the next save removes the leftover
    dcp.save(_state(4.0), checkpoint_id=path)
    assert _aside(tmp_path, "partial") == [] and _aside(tmp_path, "old") == []
    assert torch.equal(_load(path)["model"]["w"], torch.full((5, 3), 4.0))


_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
                "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list",
                "gather", "gather_object", "monitored_barrier", "recv", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "scatter", "send", "isend", "irecv")  # fmt: skip


class _CountCollectives:
    """Counts calls of every torch.distributed collective, and the library's exchanges."""

    def __enter__(self):
        self.calls: dict[str, int] = {}
        self._saved = {name: getattr(dist, name) for name in _COLLECTIVES}
        self._saved_agree = Group.agree
        for name, fn in self._saved.items():
            setattr(dist, name, self._counting(name, fn))
        Group.agree = self._counting("agree", Group.agree)
        return self

    def _counting(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        Group.agree = self._saved_agree


def _ranks_state(value: float) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = distribute_tensor(torch.full((6, 4), value), mesh, [Shard(0)])
    return {"model": {"w": w, "b": torch.arange(3.0) + value}, "step": 7}


def _save_counts_its_collectives(directory: str) -> None:
    path = Path(directory) / "ckpt"
    dcp.save(_ranks_state(1.0), checkpoint_id=path)  # one to replace
    state = _ranks_state(2.0)
    with _CountCollectives() as count:
        dcp.save(state, checkpoint_id=path)
    # three exchanges of JSON, each an all_gather of the lengths and one of the bytes
    assert count.calls == {"agree": 3, "all_gather": 6}, count.calls
    sd = {"model": {"w": _ranks_state(0.0)["model"]["w"], "b": torch.zeros(3)}, "step": 0}
    dcp.load(sd, checkpoint_id=path)
    assert torch.equal(sd["model"]["w"].full_tensor(), torch.full((6, 4), 2.0))


def test_a_save_makes_three_exchanges(tmp_path):
    run_on_ranks(2, _save_counts_its_collectives, directory=str(tmp_path))


def _one_rank_cannot_snapshot(directory: str) -> None:
    """A value only rank 1 cannot save is shared in the first exchange: every rank raises,
    rank 0's partial directory is removed and the previous checkpoint is left as it was."""
    path = Path(directory) / "ckpt"
    dcp.save(_ranks_state(1.0), checkpoint_id=path)
    state = _ranks_state(2.0)
    if dist.get_rank() == 1:
        state["extra"] = object()
    with _CountCollectives() as count, pytest.raises(CheckpointError, match=r"extra.*\[rank 1\]"):
        dcp.save(state, checkpoint_id=path)
    assert count.calls == {"agree": 1, "all_gather": 2}, count.calls
    dist.barrier()
    assert sorted(p.name for p in Path(directory).iterdir()) == ["ckpt"]
    assert verify(path) == []
    sd = {"model": {"w": _ranks_state(0.0)["model"]["w"], "b": torch.zeros(3)}, "step": 0}
    dcp.load(sd, checkpoint_id=path)
    assert torch.equal(sd["model"]["w"].full_tensor(), torch.full((6, 4), 1.0))


def test_a_value_one_rank_cannot_save_fails_every_rank_in_the_first_exchange(tmp_path):
    run_on_ranks(2, _one_rank_cannot_snapshot, directory=str(tmp_path))
