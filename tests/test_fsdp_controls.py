"""The FSDPModule controls and fully_shard options, each against a reference.

Covers what the parity suite does not: ``set_unshard_in_backward(False)``,
``ignored_params``, list groups' single collective, ``set_reshard_after_forward`` after a
step, ``unshard(async_op=True)`` followed by forward without ``wait()``,
``cast_forward_inputs=False`` and a ``reduce_dtype`` below ``param_dtype`` (against torch
FSDP2), two roots in one process, the production route threshold, the CPU fallbacks without
huge pages or ``mremap``, HSDP with an int ``reshard_after_forward``, ``Shard(1)`` with a
divide factor; and that a failing ``fully_shard`` changes nothing, and that the check mode
for freed parameters turns a stale read into an error.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from device_mesh import groups as _groups
from device_mesh import init_device_mesh
from dtensor import DTensor, Shard
from dtensor.debug import CommDebugMode
from examples.gpt import GPT, gpt_loss
from fsdp2 import FSDPModule, MixedPrecisionPolicy, _host_memory, fully_shard
from fsdp2 import _collectives as C
from tests.harness import run_on_ranks
from tests.test_fsdp_parity import (
    PER_RANK,
    _batches,
    _build,
    _cfg,
    _compare,
    _on_route,
    _parity,
    _train,
)


def _reference(cfg, steps: int = 4):
    """The global batches and the single-process reference trained on them."""
    batches = _batches(dist.get_world_size(), steps=steps)
    ref = _build(cfg)
    return batches, ref, _train(ref, batches, local=False)


def _unwrapped(cfg) -> GPT:
    """The reference's model, before any fully_shard call (for custom wrappings)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    torch.manual_seed(0)
    model.reset_parameters()
    return model


def _local(x, y):
    rank = dist.get_rank()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[rows], y[rows]


# ----------------------------------------------------------------------------- backward gathers
def _no_unshard_in_backward():
    cfg = _cfg()
    batches, ref, ref_losses = _reference(cfg)
    model = _unwrapped(cfg)
    fully_shard(model.tok_emb)  # an embedding's backward never reads its weight
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.tok_emb.set_unshard_in_backward(False)
    x, y = _local(*batches[0])
    loss = gpt_loss(model, x, y)
    with CommDebugMode() as comm:
        loss.backward()
    # the two blocks re-gather, the embedding does not; all four groups reduce
    assert comm.get_comm_counts() == {"all_gather": 2, "reduce_scatter": 4}, comm
    model.zero_grad(set_to_none=True)
    losses = _train(model, batches, local=True)
    _compare(model, ref, losses, ref_losses)


def test_set_unshard_in_backward_false_skips_the_gather():
    run_on_ranks(2, _no_unshard_in_backward)


# ----------------------------------------------------------------------------- ignored params
def _ignored_params():
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fully_shard(model, ignored_params={model[2].bias})
    assert not isinstance(model[2].bias, DTensor) and isinstance(model[2].weight, DTensor)
    x = torch.randn(2 * ws, 4, generator=torch.Generator().manual_seed(2))
    mine = x[2 * rank : 2 * rank + 2]
    model(mine).square().sum().backward()
    # an ignored parameter's gradient is this rank's own, never reduced
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    plain.load_state_dict(ref.state_dict())
    plain(mine).square().sum().backward()
    torch.testing.assert_close(model[2].bias.grad, plain[2].bias.grad)
    ref(x).square().sum().div(ws).backward()
    torch.testing.assert_close(model[2].weight.grad.full_tensor(), ref[2].weight.grad)


def test_ignored_params_are_left_alone():
    run_on_ranks(3, _ignored_params)


# ----------------------------------------------------------------------------- list groups
def _list_group_one_collective():
    cfg = _cfg()
    batches, ref, ref_losses = _reference(cfg)
    model = _unwrapped(cfg)
    fully_shard([model.blocks[0], model.blocks[1]])  # one group, two modules
    fully_shard(model)
    x, y = _local(*batches[0])
    with CommDebugMode() as fwd:
        loss = gpt_loss(model, x, y)
    with CommDebugMode() as bwd:
        loss.backward()
    assert fwd.get_comm_counts() == {"all_gather": 2}, fwd  # root + the pair of blocks
    assert bwd.get_comm_counts() == {"all_gather": 1, "reduce_scatter": 2}, bwd
    model.zero_grad(set_to_none=True)
    losses = _train(model, batches, local=True)
    _compare(model, ref, losses, ref_losses)


def test_fully_shard_on_a_list_gathers_once():
    run_on_ranks(2, _list_group_one_collective)


# ----------------------------------------------------------------------------- changed mid-run
def _reshard_after_forward_changed_after_a_step():
    cfg = _cfg()
    ws = dist.get_world_size()
    batches, ref, ref_losses = _reference(cfg)
    model = _build(cfg, fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step, (x, y) in enumerate(batches):
        if step == 1:
            model.set_reshard_after_forward(False)  # every group, the root included
        if step == 2:
            for block in model.blocks:
                block.set_reshard_after_forward(True, recurse=False)
        x, y = _local(x, y)
        loss = gpt_loss(model, x, y)
        with CommDebugMode() as bwd:
            loss.backward()
        gathers = bwd.get_comm_counts().get("all_gather", 0)
        assert gathers == (0 if step == 1 else 2), (step, bwd)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
    _compare(model, ref, losses, ref_losses)


def test_set_reshard_after_forward_after_the_first_step():
    run_on_ranks(2, _reshard_after_forward_changed_after_a_step)


def _async_unshard_without_wait():
    cfg = _cfg()
    batches, ref, ref_losses = _reference(cfg)
    model = _build(cfg, fully_shard)
    handles = [model.unshard(async_op=True)] + [b.unshard(async_op=True) for b in model.blocks]
    x, y = _local(*batches[0])
    with CommDebugMode() as comm:
        gpt_loss(model, x, y)  # forward waits for the gathers in flight itself
    assert comm.get_comm_counts().get("all_gather", 0) == 0, comm
    for h in handles:
        h.wait()  # afterwards a no-op
    model.reset_iter_state()  # drop that forward (its backward never ran)
    losses = _train(model, batches, local=True)
    _compare(model, ref, losses, ref_losses)


def test_unshard_async_then_forward_without_wait():
    run_on_ranks(3, _async_unshard_without_wait)


# ----------------------------------------------------------------------------- dtypes vs torch
def _policies_match_torch(ours_policy, torch_policy, rtol, atol):
    cfg = _cfg()
    ws = dist.get_world_size()
    batches = _batches(ws)
    ours = _build(cfg, fully_shard, mp_policy=ours_policy)
    theirs = _build(cfg, torch_fully_shard, mp_policy=torch_policy)
    losses = _train(ours, batches, local=True)
    their_losses = _train(theirs, batches, local=True)
    _compare(ours, theirs, losses, their_losses, rtol=rtol, atol=atol)


def _no_input_cast():
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    _policies_match_torch(MixedPrecisionPolicy(**kw), TorchMP(**kw), 0.0, 0.0)


def _low_reduce_dtype():
    kw = dict(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    # both reduce in bf16; one bf16 rounding of the reduced gradient may differ (~4e-3)
    _policies_match_torch(MixedPrecisionPolicy(**kw), TorchMP(**kw), 1.6e-2, 1e-3)


def test_cast_forward_inputs_false_matches_torch():
    run_on_ranks(2, _no_input_cast)


def test_reduce_dtype_below_param_dtype_matches_torch():
    run_on_ranks(2, _low_reduce_dtype)


# ----------------------------------------------------------------------------- two roots
def _two_roots():
    cfg_a, cfg_b = _cfg(), _cfg(dim=24, n_heads=2)
    ws = dist.get_world_size()
    batches = _batches(ws)
    refs = [_build(cfg_a), _build(cfg_b)]
    ref_losses = [_train(r, batches, local=False) for r in refs]
    a, b = _build(cfg_a, fully_shard), _build(cfg_b, fully_shard)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (a, b)]
    losses = [[], []]
    for x, y in batches:  # interleaved, step by step
        x, y = _local(x, y)
        for i, (m, opt) in enumerate(zip((a, b), opts, strict=True)):
            loss = gpt_loss(m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses[i].append(total.item() / ws)
    ca, cb = a._fsdp.ctx.comm, b._fsdp.ctx.comm
    assert ca is not cb and ca.pool is not cb.pool and ca.pages is not cb.pages
    assert ca.streams is not cb.streams
    for m, ref, ls, rl in zip((a, b), refs, losses, ref_losses, strict=True):
        _compare(m, ref, ls, rl)


def test_two_independent_roots_in_one_process():
    run_on_ranks(2, _two_roots)


# ----------------------------------------------------------------------------- routes
def _production_threshold():
    # 512-wide blocks: their parameters average 1.5 MB (point to point); the root's 67-row
    # embeddings and head stay far below the threshold (staged)
    cfg = _cfg(dim=512, n_heads=8)
    model = _build(cfg, fully_shard)
    routes = {}
    for m in (model, *model.blocks):
        g = m._fsdp.group
        nbytes = sum(p.padded_numel for p in g.params) * g.mesh_info.shard_size * 4
        routes[type(m).__name__] = C.exchanges_blocks(
            g.mesh_info.shard_group, g.device, nbytes, len(g.params)
        )
    assert routes == {"FSDPGPT": False, "FSDPBlock": True}, routes
    ws = dist.get_world_size()
    batches = _batches(ws, steps=2)
    ref = _build(cfg)
    ref_losses = _train(ref, batches, local=False)
    theirs = _build(cfg, torch_fully_shard)
    their_losses = _train(theirs, batches, local=True)
    losses = _train(model, batches, local=True)
    # two ranks: the same arithmetic as torch FSDP2, to the bit. (Against one process, at
    # this width AdamW turns the rounding of a few near-zero gradients into steps of ~lr.)
    _compare(model, theirs, losses, their_losses, exact=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_production_route_threshold_mixes_routes():
    run_on_ranks(2, _production_threshold)


def _without(what: str):
    saved = {
        "huge_pages": ("huge_pages_available", lambda: False),
        "mremap": ("_mremap", lambda: None),
    }[what]
    name, replacement = saved
    original = getattr(_host_memory, name)
    wants = _host_memory.wants_mapping
    setattr(_host_memory, name, replacement)
    if what == "mremap":  # mappings on (small test parameters), page moves refused
        _host_memory.wants_mapping = lambda nbytes, device: torch.device(device).type == "cpu"
    try:
        _on_route("direct", functools.partial(_parity, oracle=False))
    finally:
        setattr(_host_memory, name, original)
        _host_memory.wants_mapping = wants


@pytest.mark.parametrize("what", ["huge_pages", "mremap"])
def test_fallbacks_without_huge_pages_or_mremap(what):
    run_on_ranks(3, _without, what=what)


# ----------------------------------------------------------------------------- HSDP, Shard(1)
def _hsdp_int_reshard():
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    _parity(shard_kw={"mesh": mesh, "reshard_after_forward": 2}, oracle=False)


def test_hsdp_with_int_reshard_after_forward():
    run_on_ranks(4, _on_route, route="staged", target=_hsdp_int_reshard)


def _shard1_divide_factor():
    cfg = _cfg()
    ws = dist.get_world_size()
    x, y = _local(*_batches(ws, steps=1)[0])
    ref = _build(cfg, fully_shard)
    ours = _build(cfg, fully_shard, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    ours.set_gradient_divide_factor(1.5)
    gpt_loss(ref, x, y).backward()
    gpt_loss(ours, x, y).backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        if p.ndim == 2:
            assert p.placements == (Shard(1),), name
        # divided by 1.5 instead of the world size
        torch.testing.assert_close(
            p.grad.full_tensor(), q.grad.full_tensor() * ws / 1.5, rtol=1e-5, atol=1e-6
        )


def test_shard1_with_a_divide_factor():
    run_on_ranks(3, _shard1_divide_factor)


# ----------------------------------------------------------------------------- atomic calls
def _untouched(module: nn.Module) -> None:
    assert not isinstance(module, FSDPModule)
    for name, p in module.named_parameters():
        assert not isinstance(p, DTensor), name


def _failing_calls_change_nothing():
    from tests.test_fsdp_ties import TieNet

    ws = dist.get_world_size()
    # a bad parameter after a valid int reshard: the post-forward groups are not created
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    m.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    groups_before = dict(_groups._GROUP_CACHE)
    with pytest.raises(ValueError, match="'scale' is 0-d"):
        fully_shard(m, reshard_after_forward=2)
    assert _groups._GROUP_CACHE == groups_before
    _untouched(m)
    # a tie that cannot move (another mesh), found after other parameters: none converted
    torch.manual_seed(0)
    net = TieNet()
    fully_shard(net.emb)
    hsdp = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("r", "s"))
    with pytest.raises(ValueError, match="different meshes"):
        fully_shard(net, mesh=hsdp)
    assert not isinstance(net, FSDPModule)
    assert not isinstance(net.a[0].weight, DTensor) and not isinstance(net.head.weight, DTensor)
    fully_shard(net)  # the same call on the right mesh then works
    assert net.head.weight is net.emb.weight and isinstance(net.a[0].weight, DTensor)


def test_a_failing_fully_shard_changes_nothing():
    run_on_ranks(4, _failing_calls_change_nothing)


# ----------------------------------------------------------------------------- stale reads
def _stale_read_in_check_mode(mapped: bool, how: str):
    wants = _host_memory.wants_mapping
    if mapped:  # the mapping path, where a stale read would otherwise see other data
        _host_memory.wants_mapping = lambda nbytes, device: torch.device(device).type == "cpu"
    if how == "environment":  # the override, for a run whose code cannot be edited
        os.environ["FSDP2_CHECK_FREED"] = "1"
    try:
        if how == "environment":
            model = _build(_cfg(), fully_shard)
        else:
            model = _build(_cfg(), fully_shard, check_freed=True)
            for word in ("0", "false", " Off "):  # the override wins over the argument ...
                os.environ["FSDP2_CHECK_FREED"] = word  # (was: any value but "0" meant on)
                off = _build(_cfg(), fully_shard, check_freed=True)
                off(torch.zeros(1, 2, dtype=torch.long))
                assert not off._fsdp.ctx.comm.check_freed, word
            os.environ["FSDP2_CHECK_FREED"] = "flase"  # a typo picks no side: it raises
            typo = _build(_cfg(), fully_shard, check_freed=True)
            with pytest.raises(ValueError, match="FSDP2_CHECK_FREED='flase': expected on"):
                typo(torch.zeros(1, 2, dtype=torch.long))
            del os.environ["FSDP2_CHECK_FREED"]  # ... and without it the argument decides
        with pytest.raises(TypeError, match="check_freed must be a bool"):
            fully_shard(nn.Linear(2, 2), check_freed="yes")
        kept = []
        qkv = model.blocks[0].attn.qkv
        handle = qkv.register_forward_hook(lambda m, i, o: kept.append(m.weight))
        x, y = _local(*_batches(dist.get_world_size(), steps=1)[0])
        gpt_loss(model, x, y).backward()
        handle.remove()
        assert model._fsdp.ctx.comm.check_freed
        assert not isinstance(kept[0], DTensor)  # the unsharded parameter, now freed
        with pytest.raises(RuntimeError, match="read after fully_shard freed it"):
            kept[0].sum()
        with pytest.raises(RuntimeError, match="read after fully_shard freed it"):
            torch.cat([kept[0], kept[0]])  # found inside a list argument too
    finally:
        os.environ.pop("FSDP2_CHECK_FREED", None)
        _host_memory.wants_mapping = wants


def _kept_weight_reads(mapped: bool, keep: str):
    """A weight kept from block 2's forward and read while block 2's next all-gather is in
    flight (after its memory was backed, before any peer's rows arrived) must hold zeros or
    block 2's own values, never another block's ([Note: kept unsharded parameters])."""
    wants, original = _host_memory.wants_mapping, C.gather_blocks
    if mapped:  # every buffer in a mapping: the page bank moves freed pages around
        _host_memory.wants_mapping = lambda nbytes, device: torch.device(device).type == "cpu"
    reads = []
    kept = []

    def gather_blocks(pieces, *args, **kw):
        if kept and any(blocks.data_ptr() == kept[0].data_ptr() for _, blocks, _ in pieces):
            reads.append(kept[0].detach().clone())  # the peers' rows have not been sent yet
        return original(pieces, *args, **kw)

    C.gather_blocks = gather_blocks
    try:
        model = _build(_cfg(n_layers=3), fully_shard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        qkv = model.blocks[2].attn.qkv
        hook = qkv.register_forward_hook(
            lambda m, i, o: kept.append(m.weight if keep == "param" else m.weight[:])
        )
        batches = _batches(dist.get_world_size(), steps=2)
        x, y = _local(*batches[0])
        gpt_loss(model, x, y).backward()
        hook.remove()
        old = [b.attn.qkv.weight.full_tensor() for b in model.blocks]
        # small parameters take whole pages, more than the group's bytes the bank budgets
        # for; a bank that can hold every freed page makes the moves certain
        model._fsdp.ctx.comm.pages.keep_bytes = 1 << 30
        opt.step()
        opt.zero_grad()
        new = [b.attn.qkv.weight.full_tensor() for b in model.blocks]
        x, y = _local(*batches[1])
        gpt_loss(model, x, y).backward()  # block 1's forward prefetches block 2's gather
    finally:
        C.gather_blocks = original
        _host_memory.wants_mapping = wants
    assert reads, "block 2's all-gather never ran while the weight was kept"
    if mapped:
        assert model._fsdp.ctx.comm.pages.moves > 0  # the bank did move pages elsewhere
    rows = 90  # qkv: (3 * 30, 30)
    for read in reads:
        for r in range(rows):
            row = read[r]
            mine = torch.equal(row, old[2][r]) or torch.equal(row, new[2][r])
            others = [
                b for b in (0, 1) if torch.equal(row, old[b][r]) or torch.equal(row, new[b][r])
            ]
            assert mine or (not others and not row.any()), (r, others)


class _TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return x + self.lin(x).sum(-1, keepdim=True)  # the local column block, summed


def _kept_tp_local_reads():
    """Under tensor parallelism the unsharded parameter is a DTensor; ``to_local()`` of a
    frozen one hands out its local tensor itself (no new reference to the parameter, no new
    tensor over the storage): kept, it must still read zeros or its own values."""
    from dtensor.parallel import ColwiseParallel, parallelize_module

    wants, original = _host_memory.wants_mapping, C.gather_blocks
    _host_memory.wants_mapping = lambda nbytes, device: torch.device(device).type == "cpu"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    kept, reads = [], []

    def gather_blocks(pieces, *args, **kw):
        ptr = kept[0].untyped_storage().data_ptr() if kept else None
        if any(blocks.untyped_storage().data_ptr() == ptr for _, blocks, _ in pieces):
            reads.append(kept[0].clone())
        return original(pieces, *args, **kw)

    C.gather_blocks = gather_blocks
    try:
        model = nn.Sequential(*[_TPBlock() for _ in range(3)])
        for i, block in enumerate(model):
            with torch.no_grad():
                block.lin.weight.fill_(float(i + 1))  # block i's weight is all i + 1
            block.lin.weight.requires_grad_(False)  # a frozen base
            parallelize_module(block, mesh["tp"], {"lin": ColwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        model[2].lin.register_forward_hook(  # inside block 2's forward: gathered
            lambda m, i, o: kept.append(m.weight.to_local()) if not kept else None
        )
        x = torch.randn(4, 16, requires_grad=True)
        model(x).sum().backward()
        model._fsdp.ctx.comm.pages.keep_bytes = 1 << 30  # moves certain (see above)
        for _ in range(2):
            model(x).sum().backward()
    finally:
        C.gather_blocks = original
        _host_memory.wants_mapping = wants
    assert reads
    for read in reads:
        assert set(read.unique().tolist()) <= {0.0, 3.0}, read.unique()


def test_a_kept_tensor_parallel_local_never_reads_another_parameter():
    run_on_ranks(4, _on_route, route="direct", target=_kept_tp_local_reads)


@pytest.mark.parametrize("keep", ["param", "view"])
@pytest.mark.parametrize("mapped", [False, True], ids=["resize", "mapped"])
def test_a_kept_weight_never_reads_another_parameter(mapped, keep):
    run_on_ranks(2, _on_route, route="direct", target=_kept_weight_reads, mapped=mapped, keep=keep)


@pytest.mark.parametrize("how", ["argument", "environment"])
@pytest.mark.parametrize("mapped", [False, True], ids=["resize", "mapped"])
def test_check_mode_makes_reads_of_freed_parameters_fail(mapped, how):
    run_on_ranks(
        2, _on_route, route="direct", target=_stale_read_in_check_mode, mapped=mapped, how=how
    )


# ----------------------------------------------------------------------------- host reads
def _flags_read_only_when_needed():
    from tests.test_fsdp_runtime import _Branchy

    reads = []
    original = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(tuple(self.shape))
        return original(self)

    model = _build(_cfg(), fully_shard)
    x, y = _local(*_batches(dist.get_world_size(), steps=1)[0])
    loss = gpt_loss(model, x, y)
    torch.Tensor.tolist = counting_tolist
    try:
        loss.backward()  # every parameter has a gradient on every rank
    finally:
        torch.Tensor.tolist = original
    assert reads == [], reads  # no device-to-host read of the reduced flags (a CUDA sync)
    torch.manual_seed(0)
    branchy = _Branchy()
    fully_shard(branchy.inner)
    fully_shard(branchy)
    out = branchy(torch.randn(2, 5), dist.get_rank() == 0)  # `extra` used on rank 0 only
    torch.Tensor.tolist = counting_tolist
    try:
        out.square().sum().backward()
    finally:
        torch.Tensor.tolist = original
    if dist.get_rank() == 0:  # it used `extra`: every flag is known locally
        assert reads == [], reads
    else:  # no local gradient for `extra`: the flags say whether another rank had one
        assert reads, "the rank without a gradient must read the reduced flags"
    assert branchy.extra.weight.grad is not None  # on every rank: some rank used it


def test_gradient_flags_are_read_on_the_host_only_when_needed():
    run_on_ranks(2, _on_route, route="staged", target=_flags_read_only_when_needed)
