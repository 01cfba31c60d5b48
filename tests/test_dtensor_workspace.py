"""The collective workspace: buffers are reused only when nothing references them, within
bounds, and redistributions through it give the same values as without it."""

import pytest
import torch
import torch.distributed as dist

from device_mesh import init_device_mesh
from dtensor import DTensor, Partial, Replicate, Shard, Workspace, _workspace, collective_workspace
from tests.harness import run_on_ranks

MB = 1 << 20


def _ptr(t):
    return t.untyped_storage().data_ptr()


# ------------------------------------------------------------------------- one process
def test_a_buffer_is_reused_only_once_nothing_references_it():
    ws = Workspace()
    a = ws.empty((256, 1024), torch.float32, "cpu")
    a_ptr = _ptr(a)
    view = a[3:].t()
    del a
    b = ws.empty((256, 1024), torch.float32, "cpu")  # the view keeps the first one busy
    b_ptr = _ptr(b)
    assert b_ptr != a_ptr and ws.kept == 2 and ws.hits == 0
    del b
    assert _ptr(ws.empty((256, 1024), torch.float32, "cpu")) == b_ptr  # the free one
    del view
    both = [ws.empty((256, 1024), torch.float32, "cpu") for _ in range(2)]
    assert {_ptr(t) for t in both} == {a_ptr, b_ptr} and ws.hits == 3 and ws.kept == 2


def test_a_buffer_saved_for_backward_stays_busy_until_backward_ran():
    ws = Workspace()
    x = ws.empty((512, 512), torch.float32, "cpu").fill_(2.0).requires_grad_()
    loss = (x * x).sum()  # autograd keeps x for the gradient
    del x
    assert not ws._buffers[0].is_free()
    assert _ptr(ws.empty((512, 512), torch.float32, "cpu")) != ws._buffers[0].storage.data_ptr()
    loss.backward()
    del loss
    assert all(b.is_free() for b in ws._buffers) and ws.kept == 2


def test_requests_out_of_bounds_are_plain_allocations():
    ws = Workspace()
    small = ws.empty((_workspace.MIN_BYTES // 4 - 1,), torch.float32, "cpu")
    large = ws.empty((_workspace.MAX_BYTES // 4 + 1,), torch.float32, "cpu")
    meta = ws.empty((MB,), torch.float32, "meta")
    assert ws.held_bytes == 0 and ws.kept == 0
    assert small.numel() and large.numel() and meta.device.type == "meta"


def test_only_a_buffer_of_the_exact_size_serves_and_spans_the_tensor():
    ws = Workspace()
    t = ws.empty((9 * MB,), torch.uint8, "cpu")
    ptr = _ptr(t)
    del t
    smaller = ws.empty((8 * MB,), torch.uint8, "cpu")  # a larger free buffer is not used
    assert _ptr(smaller) != ptr and ws.kept == 2 and ws.hits == 0
    assert smaller.untyped_storage().nbytes() == smaller.numel()  # nothing stale around it
    del smaller
    assert _ptr(ws.empty((9 * MB,), torch.uint8, "cpu")) == ptr and ws.hits == 1


def test_a_kept_storage_handle_keeps_the_buffer_busy():
    ws = Workspace()
    t = ws.empty((MB,), torch.uint8, "cpu").fill_(1)
    handle = t.untyped_storage()  # the workspace's own storage object, handed back
    del t
    u = ws.empty((MB,), torch.uint8, "cpu").fill_(2)
    assert u.data_ptr() != handle.data_ptr() and handle[0] == 1
    del u, handle
    assert all(b.is_free() for b in ws._buffers)


def test_a_storage_moved_to_shared_memory_leaves_the_workspace():
    ws = Workspace()
    t = ws.empty((MB,), torch.uint8, "cpu")
    t.share_memory_()  # another process may map it: never ours to hand out again
    shared = ws._buffers[0]
    del t
    ws.empty((MB,), torch.uint8, "cpu")
    assert ws.kept == 2 and ws.hits == 0 and ws.held_bytes == MB
    assert not any(b is shared for b in ws._buffers)


def test_a_default_device_context_does_not_reach_the_buffers():
    ws = Workspace()
    with torch.device("meta"):
        t = ws.empty((MB,), torch.uint8, "cpu")
    assert t.device.type == "cpu" and ws._buffers[0].storage.device.type == "cpu"
    del t
    assert ws.empty((MB,), torch.uint8, "cpu").device.type == "cpu" and ws.hits == 1


def test_threads_never_share_a_buffer():
    import threading

    ws = Workspace()
    clashes = []

    def work(tag):
        for _ in range(300):
            t = ws.empty((MB // 4,), torch.uint8, "cpu").fill_(tag)
            t[::4096].add_(0)  # let the other threads run between the fill and the check
            if not bool((t == tag).all()):
                clashes.append(tag)
            del t  # at most one buffer per thread at a time

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not clashes and ws.kept <= 4 and ws.hits + ws.kept == 1200


def test_at_most_per_size_buffers_of_one_size():
    ws = Workspace(budget=1 << 30)
    held = [ws.empty((MB,), torch.uint8, "cpu") for _ in range(_workspace.PER_SIZE + 2)]
    assert ws.kept == _workspace.PER_SIZE and ws.plain == 2
    assert len({_ptr(t) for t in held}) == len(held)


def test_a_working_set_over_the_budget_does_not_churn():
    ws = Workspace(budget=3 * MB)
    for _ in range(5):  # four buffers live at once, room for three
        live = [ws.empty((MB,), torch.uint8, "cpu") for _ in range(4)]
        del live
    assert (ws.kept, ws.evicted) == (3, 0) and ws.hits == 12 and ws.plain == 5


def test_only_stale_free_buffers_are_evicted_and_only_to_make_room(monkeypatch):
    monkeypatch.setattr(_workspace, "STALE_AFTER", 3)
    ws = Workspace(budget=3 * MB)
    ws.empty((MB,), torch.uint8, "cpu")  # kept, and free again at once (nothing holds it)
    old = ws._buffers[0]  # buffers are told apart by identity: an address comes back

    def kept(buf):
        return any(b is buf for b in ws._buffers)

    busy = ws.empty((2 * MB,), torch.uint8, "cpu")
    assert ws.empty((2 * MB,), torch.uint8, "cpu") is not None and ws.plain == 1  # not stale
    assert kept(old) and ws.evicted == 0
    for _ in range(3):  # time passes: the 1 MiB buffer goes stale
        ws.empty((2 * MB,), torch.uint8, "cpu")
    assert ws.plain == 4
    half = ws.empty((MB // 2,), torch.uint8, "cpu")  # evicting the stale one makes room
    assert ws.evicted == 1 and not kept(old)
    big = ws.empty((3 * MB,), torch.uint8, "cpu")  # no stale bytes can make room: none go
    assert ws.evicted == 1 and ws.plain == 5 and ws.held_bytes == 2 * MB + MB // 2
    del busy, half, big


def test_budget_zero_turns_it_off_and_clear_lets_go():
    ws = Workspace()
    t = ws.empty((MB,), torch.uint8, "cpu")
    ws.clear()
    assert ws.held_bytes == 0 and t.numel() == MB  # the tensor lives on with its memory
    ws.budget = 0
    ws.empty((MB,), torch.uint8, "cpu")
    assert ws.held_bytes == 0 and ws.plain == 1


def test_a_resized_storage_is_dropped():
    ws = Workspace()
    t = ws.empty((MB,), torch.uint8, "cpu")
    t.untyped_storage().resize_(0)  # e.g. freed by resizing, as fsdp2 frees parameters
    del t
    u = ws.empty((MB,), torch.uint8, "cpu")
    assert u.untyped_storage().nbytes() == MB and ws.kept == 2 and ws.held_bytes == MB


# ------------------------------------------------------------------------- on a mesh
# (global shape, source placement, target placement) on a 1-D mesh; every buffer is at least
# the workspace's MIN_BYTES at 2 and 3 ranks, and dim 1 (37) is uneven at both
_CASES = [
    ((8, 37, 256), Shard(1), Replicate()),  # sequence all-gather
    ((8, 37, 256), Partial(), Shard(1)),  # row-parallel reduce-scatter
    ((8, 37, 256), Replicate(), Shard(2)),  # a local slice
    ((37, 256, 8), Partial(), Replicate()),  # all-reduce
    ((5, 37, 256), Shard(0), Replicate()),  # dim-0 all-gather (received in place)
    ((37, 256, 8), Shard(0), Shard(1)),  # all-to-all, received in place
    ((8, 37, 256), Shard(1), Shard(2)),  # all-to-all into buffers, then cat
]


def _moved(mesh, full, src, dst):
    if isinstance(src, Partial):  # each rank holds full / k ... plus its rank, summed below
        k, r = mesh.size(), mesh.get_local_rank()
        local = full / k + (r - (k - 1) / 2) * 0.25
        dt = DTensor.from_local(local, mesh, (src,), shape=full.shape)
    else:
        dt = DTensor.from_local(
            full.chunk(mesh.size(), src.dim)[mesh.get_local_rank()]
            if isinstance(src, Shard)
            else full,
            mesh,
            (src,),
            shape=full.shape,
        )
    return dt.redistribute(placements=(dst,)).to_local()


def _same_values_and_no_overwrite():
    ws_size = dist.get_world_size()
    plain = init_device_mesh("cpu", (ws_size,), mesh_dim_names=("tp",))
    pooled = init_device_mesh("cpu", (ws_size,), mesh_dim_names=("tp",))
    ws = collective_workspace(pooled)
    assert _workspace.workspace_of(plain, 0) is None
    for shape, src, dst in _CASES:
        kept = []
        served = ws.hits + ws.kept
        for i in range(4):  # results are kept while the next ones run
            torch.manual_seed(i)
            full = torch.randn(shape)
            want = _moved(plain, full, src, dst)
            got = _moved(pooled, full, src, dst)
            assert torch.equal(got, want), (shape, src, dst, i)
            kept.append((got, want.clone()))
        for got, want in kept:
            assert torch.equal(got, want), (shape, src, dst, "overwritten")
        assert len({_ptr(g) for g, _ in kept}) == len(kept)  # four results, four buffers
        assert ws.hits + ws.kept >= served + 4, (shape, src, dst, "not served")
    assert ws.kept > 0 and ws.hits > 0
    # A warm loop whose results are dropped keeps no new buffer.
    torch.manual_seed(7)
    full = torch.randn(8, 37, 256)
    _moved(pooled, full, Shard(1), Replicate())
    kept, plain, hits = ws.kept, ws.plain, ws.hits
    for _ in range(5):
        for shape, src, dst in _CASES:
            _moved(pooled, torch.randn(shape), src, dst)
    assert (ws.kept, ws.plain) == (kept, plain) and ws.hits > hits


@pytest.mark.parametrize("world", [2, 3])
def test_redistributions_through_a_workspace_match_and_keep_their_results(world):
    run_on_ranks(world, _same_values_and_no_overwrite)


def _async_in_flight():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    collective_workspace(mesh)
    torch.manual_seed(0)
    full = torch.randn(8, 37, 256)
    local = full.chunk(mesh.size(), 1)[mesh.get_local_rank()]
    dts = [DTensor.from_local(local * i, mesh, (Shard(1),), shape=full.shape) for i in (1, 2)]
    first = dts[0].redistribute(placements=(Replicate(),), async_op=True)
    second = dts[1].redistribute(placements=(Replicate(),), async_op=True)
    assert torch.equal(second.to_local(), full * 2)
    assert torch.equal(first.to_local(), full)


def test_async_redistributions_in_flight_get_their_own_buffers():
    run_on_ranks(2, _async_in_flight)


# ------------------------------------------------------------------------- a TP recipe
def _recipe_steps(layout_2d: bool):
    from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan
    from fsdp2 import parallelize_transformer

    # sizes that put the activations' buffers over MIN_BYTES: a (4, 64, 128) block gathers
    cfg = GPTConfig(vocab_size=96, dim=128, n_layers=2, n_heads=4, max_seq_len=64, fused_qkv=False)
    shape, names = ((2, 2), ("dp", "tp")) if layout_2d else ((2,), ("tp",))
    torch.manual_seed(0)
    batches = [(torch.randint(0, 96, (8, 64)), torch.randint(0, 96, (8, 64))) for _ in range(5)]
    runs = {}
    for budget in (0, _workspace.DEFAULT_BUDGET):  # off, then on
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        torch.manual_seed(1)
        model = GPT(cfg)
        parallelize_transformer(model, mesh, tp_plan=tp_plan())
        ws = _workspace.workspace_of(mesh, "tp")
        assert ws is not None and (not layout_2d or _workspace.workspace_of(mesh, "dp") is None)
        ws.budget = budget
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dp = mesh.get_local_rank("dp") if layout_2d else 0
        counts = []
        losses = []
        for x, y in batches:
            rows = slice(4 * dp, 4 * dp + 4) if layout_2d else slice(None)
            loss = gpt_loss(model, x[rows], y[rows])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
            counts.append((ws.hits, ws.kept, ws.plain))
        runs[budget] = (losses, {n: p.full_tensor() for n, p in model.named_parameters()}, counts)
    (off_losses, off_params, off_counts), (on_losses, on_params, on_counts) = runs.values()
    assert off_counts[-1][:2] == (0, 0)  # budget 0: nothing kept
    assert torch.equal(torch.stack(on_losses), torch.stack(off_losses))
    for name, p in on_params.items():
        assert torch.equal(p, off_params[name]), name
    # warm after the first step: every later request is served by a buffer already kept
    hits, kept, plain = zip(*on_counts)
    assert kept[0] > 0 and kept[-1] == kept[0] and plain[-1] == plain[0], on_counts
    assert hits[-1] - hits[1] == 3 * (hits[2] - hits[1]) > 0, on_counts  # the same each step


@pytest.mark.parametrize("layout_2d", [False, True], ids=["tp2", "fsdp2_tp2"])
def test_tp_recipe_reuses_buffers_every_step_and_changes_no_value(layout_2d):
    run_on_ranks(4 if layout_2d else 2, _recipe_steps, layout_2d=layout_2d)


def _full_tensor_keeps_no_buffer():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    ws = collective_workspace(mesh)
    torch.manual_seed(0)
    full = torch.randn(37, 512)
    dt = DTensor.from_local(full.chunk(mesh.size(), 0)[mesh.get_local_rank()], mesh,
                            (Shard(0),), shape=full.shape)  # fmt: skip
    got = dt.full_tensor()
    assert torch.equal(got, full) and (ws.hits, ws.kept) == (0, 0)
    dt.redistribute(placements=(Replicate(),))  # a plain redistribution does use it
    assert ws.kept == 1


def test_full_tensor_results_never_sit_in_the_workspace():
    run_on_ranks(2, _full_tensor_keeps_no_buffer)
