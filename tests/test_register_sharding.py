"""PyTorch's two escape hatches for ops DTensor cannot shard: ``register_sharding`` (a rule of
one's own, for a custom op or over a built-in rule) and ``implicit_replication`` (plain
tensors mixed with DTensors taken as replicated). Both take effect on ops that already ran
(the dispatch caches are not allowed to answer from before), and both are named by the
errors a user meets without them."""

import threading

import pytest
import torch

from device_mesh import init_device_mesh
from dtensor import DTensor, Replicate, Shard, distribute_tensor
from dtensor._ops import _common
from dtensor.experimental import implicit_replication, register_sharding
from dtensor.experimental._register_sharding import _forget_decisions
from tests.harness import run_on_ranks

aten = torch.ops.aten


# Defined at import, once per process (each worker imports this module once).
@torch.library.custom_op("dtensor_test_rs::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, w: torch.Tensor, *, k: float) -> torch.Tensor:
    """Row-local: each row of ``x`` times ``k`` plus the whole of ``w``."""
    return x * k + w


@scale_rows.register_fake
def _scale_rows_fake(x, w, *, k):
    return torch.empty_like(x)


@torch.library.custom_op("dtensor_test_rs::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, k: float) -> None:
    """In place: ``x`` times ``k``."""
    x.mul_(k)


@scale_.register_fake
def _scale_fake(x, k):
    return None


@torch.library.custom_op("dtensor_test_rs::unruled", mutates_args=())
def unruled(x: torch.Tensor) -> torch.Tensor:
    """An op nothing gives a rule."""
    return x.clone()


@unruled.register_fake
def _unruled_fake(x):
    return torch.empty_like(x)


def _restoring_rules(check):
    """Run ``check`` and put every rule back afterwards: the worker pool outlives this file,
    and the other tests there must see the library's own rules."""
    saved = dict(_common._RULES)
    try:
        check()
    finally:
        _common._RULES.clear()
        _common._RULES.update(saved)
        _forget_decisions()


def _check_custom_op():
    mesh = init_device_mesh("cpu", (2,))
    x, w = torch.randn(6, 4), torch.randn(4)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    dw = distribute_tensor(w, mesh, [Shard(0)])
    with pytest.raises(NotImplementedError, match="no sharding rule for dtensor_test_rs"):
        scale_rows(dx, dw, k=3.0)
    seen = []

    @register_sharding(scale_rows)
    def rows(x, w, *, k):
        seen.append((tuple(x.shape), x.placements, tuple(w.shape), k))
        return [([Shard(0)], [Shard(0), Replicate()])]  # k is a keyword: no entry needed

    for _ in range(2):  # the second call is served by the caches
        out = scale_rows(dx, dw, k=3.0)
        assert isinstance(out, DTensor) and out.placements == (Shard(0),)
        torch.testing.assert_close(out.full_tensor(), scale_rows(x, w, k=3.0))
    assert seen == [((6, 4), (Shard(0),), (4,), 3.0)]  # asked once, specs and values
    assert dw.placements == (Shard(0),)  # the input moved for the op, not in place

    # PyTorch's long form, a None for the non-tensor argument, and a lone placement
    @register_sharding(scale_rows._opoverload)
    def rows_long(x, w, *, k):
        return [(Shard(0), [Shard(0), Replicate(), None])]

    torch.testing.assert_close(scale_rows(dx, dw, k=2.0).full_tensor(), x * 2.0 + w)

    # a wrong number of placements is named, with what the op takes
    @register_sharding(scale_rows)
    def too_few(x, w, *, k):
        return [([Shard(0)], [Shard(0)])]

    with pytest.raises(ValueError, match=r"1 input placement.*2 tensor input\(s\) \(\(6, 4\)"):
        scale_rows(dx, dw, k=3.0)

    @register_sharding(scale_rows)
    def two_outputs(x, w, *, k):
        return [([Shard(0), Shard(0)], [Shard(0), Replicate()])]

    with pytest.raises(ValueError, match=r"2 output placement\(s\), but the op has 1"):
        scale_rows(dx, dw, k=3.0)

    @register_sharding(scale_rows)
    def not_pairs(x, w, *, k):
        return [Shard(0)]

    with pytest.raises(ValueError, match=r"list of \(output_placements, input_placements\)"):
        scale_rows(dx, dw, k=3.0)


def _check_in_place_custom_op():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(6, 4)

    @register_sharding(scale_)
    def any_dim(x, k):  # no output: the op returns nothing
        return [([], [Shard(d), None]) for d in range(x.ndim)]

    for p in (Shard(0), Shard(1), Replicate()):
        dx = distribute_tensor(x, mesh, [p])
        scale_(dx, 2.0)
        assert dx.placements == (p,)
        torch.testing.assert_close(dx.full_tensor(), x * 2)
    # on a 2-D mesh each mesh dim keeps its own placement of the written tensor
    mesh2 = init_device_mesh("cpu", (1, 2))
    dx = distribute_tensor(x, mesh2, [Replicate(), Shard(1)])
    scale_(dx, 3.0)
    assert dx.placements == (Replicate(), Shard(1))
    torch.testing.assert_close(dx.full_tensor(), x * 3)


def _check_override_softmax():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(4, 6, 8)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    for _ in range(2):  # the library's rule, twice: into the fast path's cache
        assert torch.softmax(dx, dim=2).placements == (Shard(0),)

    @register_sharding(aten._softmax.default)
    def only_dim_1(x, dim, half_to_float):
        return [([Shard(1)], [Shard(1), None, None])]

    out = torch.softmax(dx, dim=-1)
    assert out.placements == (Shard(1),)  # as declared, not the cached decision
    torch.testing.assert_close(out.full_tensor(), torch.softmax(x, dim=-1))

    # PyTorch's docstring example: any dim but the softmax dim
    @register_sharding(aten._softmax.default)
    def custom_softmax_sharding(x, dim, half_to_float):
        softmax_dim = dim if dim >= 0 else dim + x.ndim
        shardings = [([Replicate()], [Replicate(), None, None])]
        for d in range(x.ndim):
            if d != softmax_dim:
                shardings.append(([Shard(d)], [Shard(d), None, None]))
        return shardings

    assert torch.softmax(dx, dim=2).placements == (Shard(0),)
    dx0 = torch.softmax(dx, dim=0)  # Shard(0) must move: to the first option as cheap
    assert dx0.placements == (Replicate(),)
    torch.testing.assert_close(dx0.full_tensor(), torch.softmax(x, dim=0))

    # a placement that does not fit the tensor is named
    @register_sharding(aten._softmax.default)
    def bad_dim(x, dim, half_to_float):
        return [([Shard(5)], [Shard(0), None, None])]

    with pytest.raises(ValueError, match=r"bad_dim.*Shard\(dim=5\)"):
        torch.softmax(dx, dim=2)


def _check_registration_errors():
    with pytest.raises(TypeError, match="expected an op"):
        register_sharding("softmax")
    with pytest.raises(ValueError, match="handler of its own"):
        register_sharding(aten.equal.default)


def test_register_sharding_for_a_custom_op():
    run_on_ranks(2, _restoring_rules, check=_check_custom_op)


def test_register_sharding_for_an_in_place_custom_op():
    run_on_ranks(2, _restoring_rules, check=_check_in_place_custom_op)


def test_register_sharding_overrides_a_rule_after_it_ran():
    run_on_ranks(2, _restoring_rules, check=_check_override_softmax)


def test_register_sharding_rejects_what_is_no_op():
    _check_registration_errors()


def _add_in_thread(a, b) -> str:
    result = []

    def run():
        try:
            a + b
            result.append("ran")
        except ValueError as e:
            result.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return result[0]


def _check_implicit_replication():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(4, 3)
    full = torch.arange(12.0).reshape(4, 3)  # the same on both ranks
    dx = distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"shape \(4, 3\) mixed with DTensors") as info:
        dx + full
    assert "dtensor.experimental.implicit_replication()" in str(info.value)
    with implicit_replication():
        for _ in range(2):  # the second call may be served by a cache
            out = dx + full
            assert out.placements == (Shard(0),)
            torch.testing.assert_close(out.full_tensor(), x + full)
        torch.testing.assert_close((dx * full[0]).full_tensor(), x * full[0])  # broadcast
        torch.testing.assert_close(torch.cat([dx, full]).full_tensor(), torch.cat([x, full]))
        with implicit_replication():
            pass
        out = dx + full  # still inside the outer block
        assert "mixed with DTensors" in _add_in_thread(dx, full)  # per thread
        y = dx.clone()
        y.add_(full)
        torch.testing.assert_close(y.full_tensor(), x + full)
    # outside again, the very calls that ran are refused: no cache answers for them
    with pytest.raises(ValueError, match="mixed with DTensors"):
        dx + full
    with pytest.raises(ValueError, match="mixed with DTensors"):
        torch.cat([dx, full])
    with pytest.raises(ValueError, match="in-place target is a plain torch.Tensor"):
        with implicit_replication():
            full.clone().add_(dx)


def test_implicit_replication():
    run_on_ranks(2, _check_implicit_replication)


def _check_no_rule_message():
    mesh = init_device_mesh("cpu", (2,))
    dx = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    with pytest.raises(NotImplementedError, match=r"no sharding rule for dtensor_test_rs") as info:
        unruled(dx)
    message = str(info.value)
    assert "dtensor.experimental.register_sharding(op)" in message, message
    assert "dtensor.experimental.implicit_replication()" in message, message


def test_the_no_rule_error_names_both_escape_hatches():
    run_on_ranks(2, _check_no_rule_message)
