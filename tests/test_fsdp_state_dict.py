"""state_dict() and load_state_dict() see the sharded fp32 DTensors in every module state:
at rest, after unshard(), between forward and backward (the root keeps its gathered
parameters), after a backward that keeps them (reshard_after_backward=False), and from inside
a forward. named_parameters() follows PyTorch's FSDP2: the gathered (here bf16) parameters
while they are kept; saving swaps the shards in for the save only, so it changes nothing
else (PyTorch's pre-hook reshards: a deliberate difference, docs/fsdp2.md). Loading drops
any gathered copy, so the next forward computes with the loaded values."""

from __future__ import annotations

import torch

from dtensor import DTensor, Shard
from examples.gpt import gpt_loss
from fsdp2 import MixedPrecisionPolicy
from tests.harness import run_on_ranks
from tests.test_fsdp_runtime import _batch, _sharded

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _snapshot(model) -> dict:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _check_sd(sd: dict, expected: dict, where: str) -> None:
    assert sd.keys() == expected.keys(), where
    for key, value in sd.items():
        assert isinstance(value, DTensor), (where, key, type(value))
        assert value.dtype == torch.float32 and value.placements == (Shard(0),), (where, key)
        assert torch.equal(value.full_tensor(), expected[key]), (where, key)


def _params(model) -> dict:
    """name -> (DTensor?, dtype) of what named_parameters() shows."""
    return {n: (isinstance(p, DTensor), p.dtype) for n, p in model.named_parameters()}


def _check(model, expected: dict, where: str, gathered: set) -> None:
    """``gathered``: prefixes of the modules whose bf16 gathered parameters are registered;
    state_dict() gives the shards and leaves them registered (and their memory kept)."""
    before = _params(model)
    for name, (is_dt, dtype) in before.items():
        kept = any(name.startswith(g) for g in gathered) if gathered else False
        want = (False, torch.bfloat16) if kept else (True, torch.float32)
        assert (is_dt, dtype) == want, (where, name, is_dt, dtype)
    _check_sd(model.state_dict(), expected, where)
    assert _params(model) == before, where


ROOT = ("tok_emb.", "pos_emb.", "ln_f.", "head.")


def _state_dict_in_every_state():
    model = _sharded(mp_policy=BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = _snapshot(model)
    _check(model, expected, "at rest", set())
    model.unshard()
    for block in model.blocks:
        block.unshard(async_op=True).wait()
    _check(model, expected, "after unshard()", {*ROOT, "blocks."})
    x, y = _batch()
    loss = gpt_loss(model, x, y)  # the root keeps its bf16 parameters until backward
    _check(model, expected, "between forward and backward", set(ROOT))
    loss.backward()
    opt.step()
    opt.zero_grad()
    expected = _snapshot(model)
    model.set_reshard_after_backward(False)
    gpt_loss(model, x, y).backward()
    _check(model, expected, "after a backward that keeps the parameters", {*ROOT, "blocks."})
    seen = []
    handle = model.blocks[1].register_forward_hook(lambda m, i, o: seen.append(model.state_dict()))
    model(x)
    handle.remove()
    _check_sd(seen[0], expected, "from inside a block's forward")
    model.set_reshard_after_backward(True)
    opt.zero_grad()


def test_state_dict_and_named_parameters_in_every_module_state():
    run_on_ranks(2, _state_dict_in_every_state)


def _load_while_unsharded():
    x, _ = _batch()
    src = _sharded(seed=1)
    model = _sharded()
    model.unshard()  # gathered copies of the old values ...
    for block in model.blocks:
        block.unshard()
    model.load_state_dict(src.state_dict())  # ... are dropped, not used by the next forward
    with torch.no_grad():
        torch.testing.assert_close(model(x), src(x), rtol=0, atol=0)
    # loading from inside a forward is refused: autograd already saved the old values
    errors = []

    def load_inside(module, inputs, output):
        try:
            model.load_state_dict(src.state_dict())
        except RuntimeError as e:
            errors.append(str(e))

    handle = model.blocks[0].register_forward_hook(load_inside)
    model(x)
    handle.remove()
    assert errors and "inside its forward or backward" in errors[0], errors
    for value in model.state_dict().values():
        assert value.dtype == torch.float32


def test_load_state_dict_drops_gathered_copies():
    run_on_ranks(2, _load_while_unsharded)


def _load_and_convert_drop_kept_rows():
    from fsdp2._param_group import ShardedState

    x, y = _batch()
    src = _sharded(seed=1)
    model = _sharded(reshard_after_forward=2)
    gpt_loss(model, x, y)  # every group keeps the rows of 2 ranks for its backward
    groups = [m._fsdp.group for m in (model, *model.blocks)]
    assert all(g.state is ShardedState.SHARDED_POST_FORWARD for g in groups)
    model.load_state_dict(src.state_dict())  # the kept rows hold the old values: dropped
    assert all(g.state is ShardedState.SHARDED and g._kept_rows is None for g in groups)
    with torch.no_grad():
        torch.testing.assert_close(model(x), src(x), rtol=0, atol=0)
    gpt_loss(model, x, y)
    model.double()  # a dtype change drops them too
    assert all(g.state is ShardedState.SHARDED for g in groups)
    with torch.no_grad():
        torch.testing.assert_close(model(x), src.double()(x), rtol=0, atol=0)


def test_load_and_dtype_changes_drop_rows_kept_after_forward():
    run_on_ranks(4, _load_and_convert_drop_kept_rows)


def _state_dict_on_one_rank_only():
    """rank 0 alone calls state_dict() (a log line, a rank-0 save) while the root keeps its
    gathered parameters: nothing changes on rank 0 that the others do not do, so the next
    step's collectives stay in step (a resharding pre-hook, as PyTorch's, would make rank 0
    gather again alone: a collective mismatch)."""
    import torch.distributed as dist

    model = _sharded()
    x, y = _batch()
    gpt_loss(model, x, y).backward()
    with torch.no_grad():
        model(x)  # the root keeps its gathered parameters
    if dist.get_rank() == 0:
        assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    gpt_loss(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_state_dict_on_one_rank_only_keeps_ranks_in_step():
    run_on_ranks(2, _state_dict_on_one_rank_only)


def _load_after_an_exception_in_backward():
    src = _sharded(seed=1)
    model = _sharded()
    x, y = _batch()
    loss = gpt_loss(model, x, y)

    def fail(grad):
        raise RuntimeError("boom in backward")

    model.blocks[0].register_full_backward_hook(lambda *a: fail(None))
    try:
        loss.backward()
    except RuntimeError as e:
        assert "boom" in str(e)
    # the failed backward left its groups mid-backward; that is not "inside a backward"
    model.load_state_dict(src.state_dict())
    for (name, p), q in zip(model.named_parameters(), src.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name


def test_load_state_dict_after_an_exception_in_backward():
    run_on_ranks(2, _load_after_an_exception_in_backward)
