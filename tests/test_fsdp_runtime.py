"""fully_shard's collectives (counted), controls, life cycle and errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from device_mesh import DeviceMesh
from dtensor import DTensor
from dtensor.debug import CommDebugMode
from examples.gpt import GPT, GPTConfig, gpt_loss
from fsdp2 import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from tests.harness import run_on_ranks
from tests.test_fsdp_parity import ROUTES, _on_route

VOCAB, SEQ = 67, 3


def _cfg(**kw) -> GPTConfig:
    base = dict(vocab_size=VOCAB, dim=30, n_layers=2, n_heads=3, max_seq_len=SEQ, bias=False)
    base.update(kw)
    return GPTConfig(**base)


def _sharded(cfg=None, seed=0, **kw):
    torch.manual_seed(seed)
    model = GPT(cfg or _cfg())
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _batch(n=2):
    g = torch.Generator().manual_seed(dist.get_rank() + 10)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(
        0, VOCAB, (n, SEQ), generator=g
    )


# ------------------------------------------------------------------------------ counts
def _group_shapes(cfg):
    """Parameter shapes per group, in the order fully_shard takes them."""
    ref = GPT(cfg)
    blocks = [[p.shape for p in b.parameters()] for b in ref.blocks]
    root = [p.shape for n, p in ref.named_parameters() if not n.startswith("blocks.")]
    return [root, *blocks]


def _row(shapes, ws):
    return sum(math.ceil(s[0] / ws) * math.prod(s[1:]) for s in shapes)


def _counts(reshard_after_forward):
    cfg = _cfg()
    ws = dist.get_world_size()
    model = _sharded(cfg, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    groups = _group_shapes(cfg)
    for step in range(2):  # the second step runs with prefetching on
        x, y = _batch()
        with CommDebugMode() as fwd:
            loss = gpt_loss(model, x, y)
        with CommDebugMode() as bwd:
            loss.backward()
        with CommDebugMode() as opt_comm:
            opt.step()
            opt.zero_grad()
        assert fwd.get_comm_counts() == {"all_gather": 3}, (step, fwd)
        resharded_blocks = 0 if reshard_after_forward is False else 2
        expect = {"reduce_scatter": 3}
        if resharded_blocks:
            expect["all_gather"] = resharded_blocks
        assert bwd.get_comm_counts() == expect, (step, bwd)
        assert opt_comm.get_total_counts() == 0
        # bytes: each rank contributes its padded row to an all-gather, and every row
        # (plus one has-grad flag per parameter) to a reduction
        assert fwd.get_total_bytes("all_gather") == 4 * sum(_row(g, ws) for g in groups)
        reduce_bytes = 4 * ws * sum(_row(g, ws) + len(g) for g in groups)
        assert bwd.get_total_bytes("reduce_scatter") == reduce_bytes
        block_bytes = 4 * sum(_row(g, ws) for g in groups[1:])
        assert bwd.get_total_bytes("all_gather") == (block_bytes if resharded_blocks else 0)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("reshard_after_forward", [None, False])
def test_collective_counts_and_bytes(reshard_after_forward, route):
    kw = {"reshard_after_forward": reshard_after_forward}
    run_on_ranks(2, _on_route, route=route, target=_counts, **kw)


def _counts_int():
    model = _sharded(_cfg(), reshard_after_forward=2)
    x, y = _batch()
    loss = gpt_loss(model, x, y)
    with CommDebugMode() as bwd:
        loss.backward()
    # backward re-gathers every group (root included: it was given 2 too) within its pair
    sizes = sorted(r.group_size for r in bwd.records if r.kind == "all_gather")
    assert sizes == [2, 2, 2], sizes


def test_int_reshard_regathers_within_smaller_group():
    run_on_ranks(4, _counts_int)


# ------------------------------------------------------------------------------ controls
def _unshard_reshard():
    model = _sharded()
    block = model.blocks[0]
    fp = block.attn.qkv._fsdp_locations["weight"]
    handle = block.unshard(async_op=True)
    assert isinstance(block.attn.qkv.weight, DTensor)  # registered when the gather is waited on
    handle.wait()
    # gathered and kept for the next forward; the module registers the unsharded parameters
    # (as in PyTorch's FSDP2), so code that reads them after unshard() sees full tensors
    assert fp.is_unsharded_allocated and fp.unsharded_param.shape == (90, 30)
    assert block.attn.qkv.weight is fp.unsharded_param
    assert not isinstance(block.attn.qkv.weight, DTensor)
    assert dict(block.named_parameters())["attn.qkv.weight"] is fp.unsharded_param
    block.reshard()
    assert not fp.is_unsharded_allocated and isinstance(block.attn.qkv.weight, DTensor)
    block.unshard()
    # state_dict() gives the shards and changes nothing else (PyTorch's pre-hook reshards)
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())
    assert fp.is_unsharded_allocated and block.attn.qkv.weight is fp.unsharded_param
    block.reshard()
    model.unshard()
    for b in model.blocks:
        b.unshard()
    x, _ = _batch()
    with CommDebugMode() as comm:
        model(x)  # every group was gathered already: forward issues no all-gather
    assert comm.get_comm_counts().get("all_gather", 0) == 0, comm
    model.reshard()
    assert isinstance(model.tok_emb.weight, DTensor)


def test_unshard_and_reshard():
    run_on_ranks(2, _unshard_reshard)


def _generate():
    cfg = _cfg()
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = _sharded(cfg)
    register_fsdp_forward_method(model, "generate")
    prompt = torch.tensor([[1, 2]])
    out = model.generate(prompt, 4)
    assert torch.equal(out, ref.generate(prompt, 4))
    # as after any forward: the blocks resharded, the root (reshard_after_forward=False by
    # default) keeps its gathered parameters registered until reshard()
    assert all(isinstance(p, DTensor) for b in model.blocks for p in b.parameters())
    assert not isinstance(model.tok_emb.weight, DTensor)
    model.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_register_fsdp_forward_method_generate():
    run_on_ranks(2, _generate)


def _divide_factor():
    cfg = _cfg()
    a, b = _sharded(cfg), _sharded(cfg)
    b.set_gradient_divide_factor(1.0)
    x, y = _batch()
    gpt_loss(a, x, y).backward()
    gpt_loss(b, x, y).backward()
    ws = dist.get_world_size()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q.grad.to_local(), p.grad.to_local() * ws)


def test_gradient_divide_factor_sums():
    run_on_ranks(3, _divide_factor)


def _keep_unsharded():
    model = _sharded(reshard_after_forward=False)
    model.set_reshard_after_backward(False)
    x, y = _batch()
    gpt_loss(model, x, y).backward()
    fc = model.blocks[1].mlp.fc
    # the memory is kept, and the module registers the unsharded parameter (as PyTorch's)
    assert fc._fsdp_locations["weight"].is_unsharded_allocated
    assert fc.weight is fc._fsdp_locations["weight"].unsharded_param
    with CommDebugMode() as comm:
        gpt_loss(model, x, y).backward()
    assert comm.get_comm_counts() == {"reduce_scatter": 3}  # nothing re-gathered
    model.reshard()
    for block in model.blocks:
        block.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_reshard_after_backward_false_keeps_parameters():
    run_on_ranks(2, _keep_unsharded)


class _DataSGD(torch.optim.Optimizer):
    """An older optimizer's habit: writes through ``p.data`` (a tensor whose version counter
    is not the parameter's)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])


def _kept_across_a_step(how: str, raf=None):
    """Gathered parameters (or the rows reshard_after_forward=k keeps) kept across an
    optimizer step - a no_grad forward between backward and step, or
    reshard_after_backward=False - are stale: the next forward gathers again and the run
    equals one process ([Note: stale gathered copies]), whichever way the step writes."""
    cfg = _cfg()
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = _sharded(cfg, reshard_after_forward=raf)
    if how == "data_writes":
        opts = [_DataSGD(m.parameters(), lr=0.5) for m in (ref, model)]
    else:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    if how == "keep_after_backward":
        model.set_reshard_after_backward(False)
    ws, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randint(0, VOCAB, (2 * ws, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (2 * ws, SEQ), generator=g)
        rows = slice(2 * rank, 2 * rank + 2)
        gpt_loss(ref, x, y).backward()
        gpt_loss(model, x[rows], y[rows]).backward()
        if how in ("no_grad_forward", "data_writes"):
            with torch.no_grad():
                model(x[rows])  # the root keeps its gathered (pre-step) parameters
        for opt in opts:
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(model(x[rows]), ref(x[rows]), rtol=1e-5, atol=2e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        torch.testing.assert_close(full, q.detach(), rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize(
    "how,raf,ws",
    [
        ("no_grad_forward", None, 2),
        ("keep_after_backward", None, 2),
        ("data_writes", None, 2),
        ("no_grad_forward", 2, 4),  # the rows reshard_after_forward=2 keeps
    ],
    ids=["no_grad_forward", "keep_after_backward", "data_writes", "kept_rows"],
)
def test_parameters_kept_across_an_optimizer_step_are_gathered_again(how, raf, ws):
    run_on_ranks(ws, _kept_across_a_step, how=how, raf=raf)


def _optimizer_on_unsharded():
    model = _sharded()
    model.unshard()  # the root registers its gathered parameters ...
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # ... so the optimizer holds them
    x, y = _batch()
    gpt_loss(model, x, y).backward()
    before = [p.full_tensor().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"SGD\.step: .* unsharded \(gathered\) parameters"):
        opt.step()
    after = [p.full_tensor() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_optimizer_built_on_unsharded_parameters_raises_at_step():
    run_on_ranks(2, _optimizer_on_unsharded)


def _not_last_backward():
    cfg = _cfg()
    a, b = _sharded(cfg), _sharded(cfg)
    x, y = _batch(4)
    gpt_loss(a, x, y).backward()
    b.set_is_last_backward(False)
    gpt_loss(b, x[:2], y[:2]).mul(0.5).backward()
    b.set_is_last_backward(True)
    gpt_loss(b, x[2:], y[2:]).mul(0.5).backward()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q.grad.to_local(), p.grad.to_local(), rtol=1e-5, atol=1e-7)


def test_set_is_last_backward_micro_batches():
    run_on_ranks(2, _not_last_backward)


class _Branchy(nn.Module):
    """``extra`` is used only where the input asks for it: on some ranks, not others."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.extra = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.inner(x)
        return self.extra(h) if use_extra else h


def _used_on_some_ranks():
    ws, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = _Branchy()
    model = copy.deepcopy(ref)
    fully_shard(model.inner)
    fully_shard(model)
    inputs = [torch.randn(2, 5, generator=torch.Generator().manual_seed(r)) for r in range(ws)]
    uses = [r == 0 for r in range(ws)]  # only rank 0 runs `extra`
    model(inputs[me], uses[me]).square().sum().backward()
    for r in range(ws):  # the reference: the mean over ranks' losses on one process
        ref(inputs[r], uses[r]).square().sum().div(ws).backward()
    for name, p in model.named_parameters():
        want = dict(ref.named_parameters())[name].grad
        torch.testing.assert_close(p.grad.full_tensor(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("route", ROUTES)
def test_parameter_used_on_some_ranks_only(route):
    run_on_ranks(3, _on_route, route=route, target=_used_on_some_ranks)


def _dtype_and_state_dict():
    cfg = _cfg()
    model = _sharded(cfg)
    model.double()
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.dtype == torch.float64
        assert p.to_local().dtype == torch.float64
    x, y = _batch()
    gpt_loss(model, x, y).backward()
    assert all(p.grad.dtype == torch.float64 for p in model.parameters())
    model.float()
    # state_dict round trip between two sharded models
    src = _sharded(cfg)
    opt = torch.optim.SGD(src.parameters(), lr=0.1)
    gpt_loss(src, x, y).backward()
    opt.step()
    dst = _sharded(cfg)
    dst.load_state_dict(src.state_dict())
    for p, q in zip(src.parameters(), dst.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor())


def test_dtype_conversion_and_state_dict_round_trip():
    run_on_ranks(2, _dtype_and_state_dict)


def _mp_output_dtype():
    torch.manual_seed(0)
    model = GPT(_cfg())
    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fully_shard(model, mp_policy=root)
    x, _ = _batch()
    assert model(x).dtype == torch.float32
    assert model.blocks[0](torch.randn(1, SEQ, 30)).dtype == torch.bfloat16  # inputs cast too


def test_mixed_precision_output_dtype():
    run_on_ranks(2, _mp_output_dtype)


# ------------------------------------------------------------------------------ errors
def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _errors():
    ws = dist.get_world_size()
    # fully_shard twice on one module
    lin = nn.Linear(4, 4)
    fully_shard(lin)
    _raises(ValueError, "already passed to fully_shard", lambda: fully_shard(lin))
    # a mesh with more ranks than the world refuses to exist
    _raises(ValueError, rf"world size is {ws}", lambda: DeviceMesh("cpu", list(range(ws + 1))))
    _raises(
        TypeError,
        r"mesh must be a device_mesh\.DeviceMesh.*got builtins\.str",
        lambda: fully_shard(nn.Linear(2, 2), mesh="dp"),
    )
    # a 0-d parameter
    m = nn.Linear(3, 3)
    m.scale = nn.Parameter(torch.tensor(1.0))
    _raises(ValueError, r"'scale' is 0-d", lambda: fully_shard(m))
    assert not isinstance(m, FSDPModule) and not isinstance(m.weight, DTensor)  # untouched
    # parameters on different devices
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    _raises(ValueError, "different devices.*meta", lambda: fully_shard(m))
    # reshard_after_forward that does not divide the group
    _raises(
        ValueError,
        rf"reshard_after_forward=3 must divide the shard group size {ws}",
        lambda: fully_shard(nn.Linear(3, 3), reshard_after_forward=3),
    )
    _raises(
        TypeError,
        "reshard_after_forward must be",
        lambda: fully_shard(nn.Linear(3, 3), reshard_after_forward=1.5),
    )
    # shard_placement_fn returning something else
    _raises(
        ValueError,
        "shard_placement_fn must return Shard",
        lambda: fully_shard(nn.Linear(3, 3), shard_placement_fn=lambda p: 1),
    )
    # a submodule's forward before the root's
    model = _sharded()
    _raises(
        RuntimeError,
        "ran before the forward of the fully_shard module FSDPGPT",
        lambda: model.blocks[0](torch.randn(1, SEQ, 30)),
    )
    # deepcopy of a sharded module
    _raises(RuntimeError, "deepcopy of a fully_shard module", lambda: copy.deepcopy(model))
    # a tied weight whose other use no fully_shard call covers (the root is head itself, so
    # its forward cannot see the embedding): the optimizer step refuses the stale original
    torch.manual_seed(0)
    tied = GPT(_cfg(tie_weights=True))
    fully_shard(tied.head)
    opt = torch.optim.SGD(tied.parameters(), lr=0.1)
    x, y = _batch()
    gpt_loss(tied, x, y).backward()
    _raises(RuntimeError, r"SGD.step: 1 of the optimizer's parameters \('weight'\)", opt.step)


def test_errors_are_clear_and_raised_on_every_rank():
    run_on_ranks(4, _errors)
