"""Replacing a checkpoint ([Note: replacing a checkpoint] in dtensor/checkpoint/api.py): a
crash between the two renames leaves a checkpoint that ``load`` finds, what killed saves
leave behind is removed by the next save, and a save still in flight is never touched."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import dtensor.checkpoint.api as api
from dtensor import checkpoint as dcp
from dtensor.checkpoint.tools import verify


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
    assert future.result(timeout=60) is None  # committed: it replaced the synchronous one
    assert torch.equal(_load(path)["model"]["w"], torch.full((5, 3), 2.0))
    # with nothing in flight any more, the next save removes the leftover
    dcp.save(_state(4.0), checkpoint_id=path)
    assert _aside(tmp_path, "partial") == [] and _aside(tmp_path, "old") == []
    assert torch.equal(_load(path)["model"]["w"], torch.full((5, 3), 4.0))
