"""fsdp2.tools.MemoryTracker against direct counts: parameters, gradients and optimizer state
exactly (unique storages of the live tensors), peaks within 5% of what glibc's malloc itself
reports in use after every operator, and memory freed by ``resize_(0)`` or by dropping pages
counted as freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtensor.spec import local_of
from fsdp2 import _host_memory, fully_shard
from fsdp2.tools import CATEGORIES, MemoryTracker
from tests.harness import run_on_ranks

DIM, BATCH, BLOCKS = 256, 256, 3


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        ).split()
    ]


def _libc_mallinfo2():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    fn = getattr(libc, "mallinfo2", None)
    if fn is not None:
        fn.restype = _Mallinfo2
    return fn


_MALLINFO2 = _libc_mallinfo2()
needs_mallinfo = pytest.mark.skipif(_MALLINFO2 is None, reason="glibc's mallinfo2 is needed")


def _malloc_in_use() -> int:
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd  # heap chunks in use + malloc's own mappings


class _MallocPeak(TorchDispatchMode):
    """The direct count: bytes malloc has in use, after every operator (as the tracker)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = _malloc_in_use()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _malloc_in_use() - self.base)
        return out


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = local_of(t) if hasattr(t, "placements") else t
            s = t.untyped_storage()
            seen[s.data_ptr(), s.nbytes()] = s.nbytes()
    return sum(seen.values())


def _direct(model, opt, *extra) -> dict[str, int]:
    """Live bytes of parameters, gradients and optimizer state, counted from the objects."""
    params = list(model.parameters())
    return {
        "sharded_params": _unique_bytes(params),
        "sharded_grads": _unique_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": _unique_bytes(tree_leaves(list(opt.state.values()))),
        "buffers": _unique_bytes([*model.buffers(), *extra]),
    }


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(DIM, DIM), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(DIM, 8))


def _step(model, opt, x) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _check_step(model, opt, x) -> MemoryTracker:
    """One measured step after a warm-up one: totals exact, peak within 5% of malloc's."""
    _step(model, opt, x)
    model(x).square().mean().backward()  # leave gradients alive into the measured step
    direct0 = _direct(model, opt, x)
    entry = sum(direct0.values())
    with MemoryTracker(model, opt, x) as tracker:
        assert tracker.current == entry  # nothing else was alive to see
        with _MallocPeak() as malloc:
            opt.step()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    direct = _direct(model, opt, x)
    got = tracker.by_category()
    for cat in ("sharded_params", "sharded_grads", "optimizer_state"):
        assert got[cat] == direct[cat], (cat, got[cat], direct[cat])
    assert got["unsharded_params"] == got["unsharded_grads"] == 0
    measured = entry + malloc.peak
    assert abs(tracker.peak - measured) <= 0.05 * measured, (tracker.peak, measured)
    assert tracker.peak == sum(tracker.by_category("peak").values())
    return tracker


@needs_mallinfo
def test_single_process_totals_and_peak_match_direct_counts():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tracker = _check_step(model, opt, torch.randn(BATCH, DIM))
    assert tracker.by_category()["sharded_grads"] > 0  # backward then step: grads alive
    phases = tracker.by_phase()
    assert set(phases) == {"forward", "backward", "optimizer"}
    # forward keeps what backward needs; the peak is in backward (grads + activations)
    assert phases["forward"]["by_category"]["activations"] >= BLOCKS * BATCH * DIM * 4
    assert tracker.peak == max(p["peak"] for p in phases.values())
    stats = tracker.by_module()
    assert list(stats)[:2] == ["Sequential", "0"] and stats["0"].calls == 1
    assert stats["0"].after_forward - stats["0"].before_forward == BATCH * DIM * 4  # its output


def test_resize_to_zero_counts_as_freed():
    t = torch.empty(1 << 16)  # 256 KiB
    with MemoryTracker(t) as tracker:
        before = tracker.current
        x = torch.ones(1 << 14)  # 64 KiB, made inside: registered
        x.add_(1)
        assert tracker.current == before + (1 << 16)
        x.untyped_storage().resize_(0)
        t.untyped_storage().resize_(0)
        torch.zeros(1)  # any operator samples; so does leaving the context
    assert before == 1 << 18
    # a count of the storages at the size they were registered with would still say 320 KiB
    assert tracker.current == 0
    assert tracker.peak == (1 << 18) + (1 << 16) + 4


# --------------------------------------------------------------------------- fully_shard
def _sharded(reshard: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    for i in range(0, 2 * BLOCKS, 2):
        fully_shard(model[i], reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _unsharded_storages(model):
    states = {id(s): s for m in model.modules() if (s := m.__dict__.get("_fsdp_state"))}
    return [p.storage for s in states.values() if s.group is not None for p in s.group.params]


def _fsdp_totals_and_peak(reshard: bool):
    saved = _host_memory.wants_mapping
    _host_memory.wants_mapping = lambda nbytes, device: False  # every buffer from malloc
    try:
        model, opt = _sharded(reshard)
        torch.manual_seed(dist.get_rank())
        tracker = _check_step(model, opt, torch.randn(BATCH // 2, DIM))
        assert tracker.by_phase()["backward"]["by_category"]["unsharded_grads"] > 0
        assert tracker.by_category("peak")["unsharded_params"] > 0
        # after forward: gathered parameters freed by resize_(0) (reshard) or still there
        x = torch.randn(BATCH // 2, DIM)
        with MemoryTracker(model, opt) as tracker:
            loss = model(x).square().mean()
            after_forward = tracker.by_category()["unsharded_params"]
            loss.backward()
        storages = _unsharded_storages(model)
        assert storages and all(type(s).__name__ == "ResizableStorage" for s in storages)
        gathered = sum(s.nbytes for s in storages)
        # blocks reshard or not; the root's own (last Linear) follows the same setting
        assert after_forward == (0 if reshard else gathered), (after_forward, gathered)
        assert tracker.by_category()["unsharded_params"] == 0  # resharded after backward
    finally:
        _host_memory.wants_mapping = saved


@needs_mallinfo
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fully_shard_totals_and_peak_match_direct_counts(reshard):
    run_on_ranks(2, _fsdp_totals_and_peak, reshard=reshard)


def _dropped_pages_count_as_freed():
    saved = _host_memory.wants_mapping
    _host_memory.wants_mapping = lambda nbytes, device: torch.device(device).type == "cpu"
    try:
        model, opt = _sharded(True)
        x = torch.randn(BATCH // 2, DIM)
        _step(model, opt, x)
        storages = _unsharded_storages(model)
        assert storages and all(type(s).__name__ == "MappedStorage" for s in storages)
        with MemoryTracker(model, opt) as tracker:
            loss = model(x).square().mean()
            after_forward = tracker.by_category()
            loss.backward()
        # freed by dropping pages: the storages keep their full size...
        assert all(s.tensor.untyped_storage().nbytes() == s.nbytes for s in storages)
        # ...yet after forward every group resharded: what the page bank still holds for
        # the next gather counts as a communication buffer; after backward nothing is held
        assert after_forward["unsharded_params"] == 0, after_forward
        assert after_forward["comm_buffers"] > 0, after_forward
        assert tracker.by_category()["unsharded_params"] == 0
        assert tracker.by_category()["comm_buffers"] == 0
        assert tracker.by_category("peak")["unsharded_params"] > 0
    finally:
        _host_memory.wants_mapping = saved


@pytest.mark.skipif(not _host_memory.huge_pages_available(), reason="no host mappings here")
def test_fully_shard_dropped_pages_count_as_freed():
    run_on_ranks(2, _dropped_pages_count_as_freed)


def test_categories_and_bad_input():
    assert len(set(CATEGORIES)) == len(CATEGORIES) == 9
    with pytest.raises(TypeError, match="modules, optimizers or tensors"):
        MemoryTracker("model")
    with pytest.raises(ValueError, match="'current' or 'peak'"):
        MemoryTracker().by_category("max")
