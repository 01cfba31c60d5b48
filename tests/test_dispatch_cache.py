"""The dispatch fast path ([Note: the dispatch fast path] in dtensor/_dispatch.py): a repeated
call propagates nothing, builds no spec, runs the pipeline not at all, and still does
everything the pipeline would (redistribution, version counters, writes through views)."""

import contextlib

import torch
import torch.distributed as dist

from device_mesh import init_device_mesh
from dtensor import DTensor, Replicate, Shard, _dispatch, distribute_tensor
from dtensor._spec import DTensorSpec, TensorMeta
from dtensor.debug import CommDebugMode
from tests.harness import run_on_ranks


@contextlib.contextmanager
def _counting():
    """Counts of sharding propagations, pipeline runs and spec/meta constructions."""
    counts = {"propagate": 0, "pipeline": 0, "spec": 0, "meta": 0}
    propagate, pipeline = _dispatch._propagate, _dispatch.dispatch_by_rule
    spec_init, meta_init = DTensorSpec.__init__, TensorMeta.__init__

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    _dispatch._propagate = counted("propagate", propagate)
    _dispatch.dispatch_by_rule = counted("pipeline", pipeline)
    DTensorSpec.__init__ = counted("spec", spec_init)
    TensorMeta.__init__ = counted("meta", meta_init)
    try:
        yield counts
    finally:
        _dispatch._propagate, _dispatch.dispatch_by_rule = propagate, pipeline
        DTensorSpec.__init__, TensorMeta.__init__ = spec_init, meta_init


def _check_repeated_ops_hit():
    mesh = init_device_mesh("cpu", (2,))
    _dispatch.clear_cache()
    full = torch.randn(6, 4)
    x = distribute_tensor(full, mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    with _counting() as counts:
        first = (x + x) @ w
    assert counts["propagate"] == 2 and counts["pipeline"] == 2, counts
    first.sum(), first.view(-1), first.detach()
    with _counting() as counts:
        for _ in range(5):
            out = (x + x) @ w
            total, flat, alias = out.sum(), out.view(-1), out.detach()
    assert counts == {"propagate": 0, "pipeline": 0, "spec": 0, "meta": 0}, counts
    # outputs share the first call's spec object: the next op's key compares by identity
    assert out._spec is first._spec
    torch.testing.assert_close(out.full_tensor(), (full + full) @ w.full_tensor())
    torch.testing.assert_close(total.full_tensor(), out.full_tensor().sum())
    assert flat.placements == (Shard(0),) and flat.shape == (24,)
    assert alias.to_local().data_ptr() == out.to_local().data_ptr()
    # a new cache (clear_cache) propagates again
    _dispatch.clear_cache()
    with _counting() as counts:
        x + x
    assert counts["propagate"] == 1, counts


def _check_hits_redistribute_like_the_pipeline():
    mesh = init_device_mesh("cpu", (2,))
    _dispatch.clear_cache()
    a_full, b_full = torch.randn(4, 6), torch.randn(6, 3)
    a = distribute_tensor(a_full, mesh, [Shard(0)])
    b = distribute_tensor(b_full, mesh, [Shard(0)])  # mm gathers it: Shard(0) -> Replicate
    counts_per_call = []
    for _ in range(3):
        with CommDebugMode() as comm, _counting() as counts:
            out = a @ b
        counts_per_call.append((comm.get_comm_counts(), counts["propagate"]))
        torch.testing.assert_close(out.full_tensor(), a_full @ b_full)
        assert b.placements == (Shard(0),)  # the input keeps its layout
    # the same all-gather on every call; only the first one propagated
    assert counts_per_call[0][0] == {"all_gather": 1}, counts_per_call
    assert [c for c, _ in counts_per_call[1:]] == [{"all_gather": 1}] * 2, counts_per_call
    assert [p for _, p in counts_per_call] == [1, 0, 0], counts_per_call


def _check_scalar_types_are_part_of_the_key():
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.arange(4), mesh, [Shard(0)])
    assert (x * 2).dtype == torch.int64
    doubled = x * 2.0  # equal to 2 as a dict key, but a float result
    assert doubled.dtype == torch.float32 and doubled.to_local().dtype == torch.float32
    assert (x * True).dtype == torch.int64


def _check_per_step_scalars_reuse_one_entry(foreach: bool):
    """An optimizer's scalars change every step (bias corrections, a scheduled learning
    rate): pointwise ops key a number by its type, so step 2 on adds no cache entry, runs
    the pipeline for nothing, and the results stay those of plain tensors."""
    mesh = init_device_mesh("cpu", (2,))
    _dispatch.clear_cache()
    torch.manual_seed(0)
    full = [torch.randn(6, 4), torch.randn(8)]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    plain = [torch.nn.Parameter(t.clone()) for t in full]
    opts = [torch.optim.AdamW(ps, lr=1e-2, foreach=foreach) for ps in (params, plain)]
    sizes = []
    for step in range(6):
        for opt, ps in zip(opts, (params, plain)):
            opt.param_groups[0]["lr"] = 1e-2 / (step + 1)  # a schedule
            for p, g in zip(ps, full):
                p.grad = distribute_tensor(g * step, mesh, [Shard(0)]) if ps is params else g * step
            with _counting() as counts:
                opt.step()
        caches = _dispatch._caches_of(mesh)
        sizes.append((len(caches.fast), len(caches.rules), counts["pipeline"]))
    assert len(set(sizes[2:])) == 1 and (foreach or sizes[-1][2] == 0), sizes
    for p, q in zip(params, plain):
        torch.testing.assert_close(p.full_tensor(), q.detach())
    # a value-free key still tells an int from a float
    x = distribute_tensor(torch.arange(4), mesh, [Shard(0)])
    assert (x * 3).dtype == torch.int64 and (x * 3.5).dtype == torch.float32
    torch.testing.assert_close((x * 3.5).full_tensor(), torch.arange(4) * 3.5)
    torch.testing.assert_close((x * 5).full_tensor(), torch.arange(4) * 5)


def _check_in_place_and_view_hits():
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
    local = x.to_local()
    versions = [local._version]
    for _ in range(3):
        assert x.add_(1.0) is x
        versions.append(local._version)
    assert versions == sorted(set(versions)), versions  # every call bumped the counter
    torch.testing.assert_close(x.full_tensor(), torch.full((4, 2), 3.0))
    # row 1 lives on one rank: the view is gathered, and a write into it is carried back,
    # on the fast path (the second table) as on the pipeline (the first)
    tables = [distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]) for _ in range(2)]
    for table in tables:
        table[1].zero_()
        want = torch.ones(4, 3)
        want[1] = 0
        torch.testing.assert_close(table.full_tensor(), want)
    assert isinstance(tables[1][1], DTensor)
    assert dist.get_world_size() == 2


def test_repeated_ops_hit_the_fast_path():
    run_on_ranks(2, _check_repeated_ops_hit)


def test_fast_path_hits_redistribute_like_the_pipeline():
    run_on_ranks(2, _check_hits_redistribute_like_the_pipeline)


def test_scalar_types_are_part_of_the_cache_key():
    run_on_ranks(2, _check_scalar_types_are_part_of_the_key)


def test_per_step_optimizer_scalars_reuse_one_cache_entry():
    run_on_ranks(2, _check_per_step_scalars_reuse_one_entry, foreach=False)
    run_on_ranks(2, _check_per_step_scalars_reuse_one_entry, foreach=True)


def test_in_place_and_view_ops_on_the_fast_path():
    run_on_ranks(2, _check_in_place_and_view_hits)


def _check_outputs_keep_the_input_mesh_object():
    # equal meshes of two roots are different meshes to fsdp2 and tensor parallelism
    meshes = [init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2,))]
    assert meshes[0] is not meshes[1] and meshes[0] == meshes[1]
    for mesh in meshes:
        x = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        for _ in range(2):
            assert (x + x).device_mesh is mesh
            assert x.detach().device_mesh is mesh


def test_outputs_keep_the_input_mesh_object():
    run_on_ranks(2, _check_outputs_keep_the_input_mesh_object)


def _check_a_dropped_mesh_is_not_kept_by_the_caches():
    """Both caches hold specs, which hold their mesh (and its process groups): they live with
    the mesh, so a mesh the user let go of goes, entries and all ([Note: dispatch caches live
    with their mesh]). In module-level caches every mesh stayed alive until 8,192 entries."""
    import gc
    import weakref

    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.randn(5, 4), mesh, [Shard(0)])
    for _ in range(2):  # the pipeline, then the fast path
        y = (x * 2 + x).sum()
    caches = _dispatch._caches_of(mesh)
    assert len(caches.rules) > 0 and len(caches.fast) > 0
    gone = weakref.ref(mesh), weakref.ref(caches)
    del mesh, x, y, caches
    gc.collect()
    assert [r() for r in gone] == [None, None]
    # a new mesh starts with empty caches and fills them again
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    x = distribute_tensor(torch.randn(5, 4), mesh, [Shard(0)])
    torch.testing.assert_close((x * 2).full_tensor(), x.full_tensor() * 2)
    assert _dispatch._caches_of(mesh["dp"]) is _dispatch._caches_of(mesh)  # slices share
    assert len(_dispatch._caches_of(mesh).rules) > 0


def test_a_dropped_mesh_is_not_kept_by_the_caches():
    run_on_ranks(2, _check_a_dropped_mesh_is_not_kept_by_the_caches)


def _check_ops_across_roots_keep_their_own_meshes():
    """An op whose DTensors sit on equal meshes of two roots (fsdp2's per-module meshes meet
    in clip_grad_norm_'s foreach ops): a later call with a new, equal mesh must not get an
    earlier call's mesh back from the cache. Its entries live with the first DTensor's root
    and hold the other meshes until that root goes (then everything goes)."""
    import gc
    import weakref

    keep = init_device_mesh("cpu", (2,))
    a = distribute_tensor(torch.arange(4.0), keep, [Shard(0)])
    gone = []
    for i in range(3):
        other = init_device_mesh("cpu", (2,))
        b = distribute_tensor(torch.arange(4.0) * i, other, [Shard(0)])
        for _ in range(2):  # the pipeline, then the caches
            out = torch._foreach_add([a, b], 1.0)
            assert out[0].device_mesh is keep and out[1].device_mesh is other, i
            c = b * 2 + b  # the fast path (b's mesh first)
            assert c.device_mesh is other
            d = a + b  # the fast path with two meshes: outputs on the first
            assert d.device_mesh is keep
        torch.testing.assert_close(out[1].full_tensor(), torch.arange(4.0) * i + 1)
        gone.append(weakref.ref(other))
        del other, b, out, c, d
    gone.append(weakref.ref(keep))
    del keep, a
    gc.collect()
    assert [r() for r in gone] == [None] * 4


def test_ops_across_roots_keep_their_own_meshes():
    run_on_ranks(2, _check_ops_across_roots_keep_their_own_meshes)


def _check_both_caches_share_one_key():
    """[Note: one cache key]: the fast path's entry and the pipeline's decision for a call sit
    under the same key; calls the fast path leaves alone (a foreach op) still hit the rules."""
    mesh = init_device_mesh("cpu", (2,))
    _dispatch.clear_cache()
    x = distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])
    (x + x, x * 2.0, x.view(-1), x.sum())
    caches = _dispatch._caches_of(mesh)
    assert len(caches.fast) == 4 and set(caches.fast) <= set(caches.rules)
    for _ in range(2):
        with _counting() as counts:
            out = torch._foreach_add([x, x * 2], 1.0)
    assert counts["propagate"] == 0 and counts["pipeline"] == 1, counts
    torch.testing.assert_close(out[1].full_tensor(), x.full_tensor() * 2 + 1)


def test_both_caches_share_one_key():
    run_on_ranks(2, _check_both_caches_share_one_key)


def test_one_record_per_op():
    """[Note: one record per op]: every fact dispatch reads about an op is in its _OpFacts."""
    import dtensor.tensor

    aten = torch.ops.aten
    facts = _dispatch._facts_of
    assert dtensor.tensor._dispatch_impl is _dispatch.dispatch  # set_dispatch at import
    assert facts(aten.add.Tensor) is facts(aten.add.Tensor)
    assert facts(aten.add.Tensor).fast and facts(aten.add.Tensor).value_free
    assert facts(aten.add_.Tensor).inplace and not facts(aten.add.Tensor).inplace
    assert facts(aten.view.default).view and not facts(aten.view.default).inplace
    t_ = facts(aten.t_.default)
    assert t_.reshapes and t_.reshape is aten.t.default and not t_.fast
    assert facts(aten.index_put_.default).index and not facts(aten.index_put_.default).fast
    assert facts(aten._foreach_add.Scalar).multi and not facts(aten._foreach_add.Scalar).fast
    assert facts(aten.equal.default).custom is not None
    assert facts(aten.zero_.default).returns  # zero_ returns its target
