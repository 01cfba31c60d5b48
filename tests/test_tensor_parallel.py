"""Tensor parallelism alone and under fully_shard (2-D FSDP+TP, 3-D HSDP+TP).

Every layout trains the same GPT (vocabulary 67: uneven over 2 and 4 ranks; width 24 and 4
heads so heads split evenly; sequence 4 so sequence parallelism splits it) for 3 AdamW steps
with gradient clipping that does clip (max norm 0.5), and is compared with

* one process on the whole batch (losses and final full parameters, rtol 1e-5 / atol 2e-6:
  the gradient sums run in another order, as in tests/test_fsdp_parity.py), and
* PyTorch's own ``parallelize_module`` + ``fully_shard`` running the same plan on the same
  batches (losses to the same tolerance; at-rest placements and local shapes equal).

Biases are off in the trained model: the key bias of attention has a zero true gradient, so
Adam would amplify rounding noise in it; the bias code paths are checked by gradients after
one backward instead (``test_tp_gradients_with_biases``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from device_mesh import init_device_mesh
from dtensor import DTensor, Replicate, Shard, distribute_tensor
from dtensor.debug import CommDebugMode
from dtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan
from fsdp2 import fully_shard
from tests.harness import run_on_ranks

VOCAB, SEQ, ROWS = 67, 4, 2
STEPS = 3
RTOL, ATOL = 1e-5, 2e-6
RTOL64, ATOL64 = 1e-10, 1e-12  # float64 runs (see _recipe_from_meta)

# name -> (mesh shape, dim names); the data-parallel dims are every dim but "tp"
LAYOUTS = {
    "tp2": ((2,), ("tp",)),
    "tp4": ((4,), ("tp",)),
    "fsdp2_tp2": ((2, 2), ("dp", "tp")),
    "hsdp2x1_tp2": ((2, 1, 2), ("dp_replicate", "dp_shard", "tp")),
    "hsdp2x2": ((2, 2), ("dp_replicate", "dp_shard")),
    "fsdp2": ((2,), ("dp",)),
}


def _cfg(**kw) -> GPTConfig:
    base = dict(
        vocab_size=VOCAB, dim=24, n_layers=2, n_heads=4, max_seq_len=8, bias=False, fused_qkv=False
    )
    base.update(kw)
    return GPTConfig(**base)


def _model(cfg) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def _batches(n_dp: int):
    g = torch.Generator().manual_seed(1)
    n = ROWS * n_dp
    return [
        (
            torch.randint(0, VOCAB, (n, SEQ), generator=g),
            torch.randint(0, VOCAB, (n, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _dp_index(mesh, names) -> tuple[int, int]:
    """(index of this rank among the data-parallel ranks, their count)."""
    dp = [n for n in names if n != "tp"]
    if not dp:
        return 0, 1
    coord = [mesh.get_local_rank(n) for n in dp]
    sizes = [mesh.size(names.index(n)) for n in dp]
    index = 0
    for c, s in zip(coord, sizes):
        index = index * s + c
    return index, int(torch.tensor(sizes).prod())


def _apply(model, mesh, names, *, parallelize, shard, plan):
    if "tp" in names:
        parallelize(model, mesh["tp"], plan)
    dp = tuple(n for n in names if n != "tp")
    if dp:
        dp_mesh = mesh[dp]
        for block in model.blocks:
            shard(block, mesh=dp_mesh)
        shard(model, mesh=dp_mesh)
    return model


def _train(model, batches, index: int, *, clip):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for x, y in batches:
        rows = slice(index * ROWS, (index + 1) * ROWS) if index is not None else slice(None)
        loss = gpt_loss(model, x[rows], y[rows])
        loss.backward()
        clip(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if index is not None:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def _full(p):
    return p.full_tensor() if isinstance(p, DTensor) or hasattr(p, "full_tensor") else p.detach()


def _layout_of(p) -> list:
    return [
        (type(q).__name__, getattr(q, "dim", None), getattr(q, "split_factor", None))
        for q in p.placements
    ]


# ------------------------------------------------------------------------- PyTorch's recipe
def _torch_style(style):
    import torch.distributed.tensor.parallel as ttp
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    def conv(p):
        if p is None:
            return None
        return TS(p.dim) if isinstance(p, Shard) else TR()

    name = type(style).__name__
    if name in ("ColwiseParallel", "RowwiseParallel"):
        return getattr(ttp, name)(
            input_layouts=conv(style.input_layouts),
            output_layouts=conv(style.output_layouts),
            use_local_output=style.use_local_output,
        )
    if name == "SequenceParallel":
        return ttp.SequenceParallel(
            sequence_dim=style.sequence_dim, use_local_output=style.use_local_output
        )
    return ttp.PrepareModuleInput(
        input_layouts=tuple(conv(p) for p in style.input_layouts),
        desired_input_layouts=tuple(conv(p) for p in style.desired_input_layouts),
        use_local_output=style.use_local_output,
    )


def _torch_run(cfg, layout, batches, index):
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    shape, names = LAYOUTS[layout]
    mesh = torch_mesh("cpu", shape, mesh_dim_names=names)
    plan = tp_plan(use_torch=True)
    model = _apply(
        _model(cfg), mesh, names, parallelize=torch_parallelize, shard=torch_fully_shard, plan=plan
    )
    layouts = {n: (_layout_of(p), tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    losses = _train(model, batches, index, clip=torch.nn.utils.clip_grad_norm_)
    return losses, layouts


# ------------------------------------------------------------------------- parity
def _parity(layout: str):
    shape, names = LAYOUTS[layout]
    cfg = _cfg()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    index, n_dp = _dp_index(mesh, names)
    batches = _batches(n_dp)
    model = _apply(
        _model(cfg), mesh, names, parallelize=parallelize_module, shard=fully_shard, plan=tp_plan()
    )
    if "tp" in names:
        w = model.blocks[0].attn.q.weight
        assert w.device_mesh.mesh_dim_names == names and len(w.placements) == len(names)
    ours_layout = {
        n: (_layout_of(p), tuple(p.to_local().shape)) for n, p in model.named_parameters()
    }
    losses = _train(
        model, batches, index if n_dp > 1 else None, clip=torch.nn.utils.clip_grad_norm_
    )

    ref = _model(cfg)
    ref_losses = _train(ref, batches, None, clip=torch.nn.utils.clip_grad_norm_)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(
            _full(p), ref_params[name].detach(), rtol=RTOL, atol=ATOL, msg=name
        )

    torch_losses, torch_layout = _torch_run(cfg, layout, batches, index if n_dp > 1 else None)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(torch_losses), rtol=RTOL, atol=ATOL
    )
    assert ours_layout == torch_layout


@pytest.mark.parametrize("layout", ["tp2", "fsdp2_tp2", "hsdp2x1_tp2", "hsdp2x2", "tp4"])
def test_layout_trains_like_one_process_and_like_pytorch(layout):
    shape, _ = LAYOUTS[layout]
    run_on_ranks(int(torch.tensor(shape).prod()), _parity, layout=layout)


def _hsdp_tp_2x2x2():
    LAYOUTS["hsdp2x2_tp2"] = ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    _parity("hsdp2x2_tp2")


@pytest.mark.slow
def test_hsdp_tp_2x2x2_world_size_8(request):
    """Eight processes: about 50 s on the 2-core CI machine, which the 10-minute budget of
    ``make test`` no longer has room for. Opt in with ``pytest --world-size-8``."""
    if not request.config.getoption("--world-size-8"):
        pytest.skip("8 processes: run with --world-size-8")
    run_on_ranks(8, _hsdp_tp_2x2x2, timeout_s=600)


# ------------------------------------------------------------------------- gradients
def _gradients_with_biases():
    cfg = _cfg(bias=True)
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    model = parallelize_module(_model(cfg), mesh["tp"], tp_plan())
    ref = _model(cfg)
    x, y = _batches(1)[0]
    loss = gpt_loss(model, x, y)
    loss.backward()
    ref_loss = gpt_loss(ref, x, y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(
            p.grad.full_tensor(), ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=name
        )


@pytest.mark.parametrize("ws", [2, 4])
def test_tp_gradients_with_biases(ws):
    run_on_ranks(ws, _gradients_with_biases)


# ------------------------------------------------------------------------- recipe from meta
def _in_runtime(filename: str) -> bool:
    """Whether ``filename`` is a source file of the library's runtime packages."""
    root = Path(__file__).resolve().parent.parent
    return any(Path(filename).resolve().is_relative_to(root / pkg) for pkg in _RUNTIME)


_RUNTIME = ("device_mesh", "dtensor", "fsdp2")


def _recipe_from_meta(layout, compile, checkpoint=False):
    """``parallelize_transformer`` on a meta-device model, then ``to_empty`` and
    ``reset_parameters``: the sharded init draws one process's values, and training matches.

    In float64, compared within ``RTOL64``/``ATOL64``: in float32 the ranks' partial sums
    round differently from one process's, and AdamW blows that up on elements whose
    gradient is near zero (one weight of 2304 was 7.5e-6 off after 3 steps on an Intel Xeon,
    within 2e-6 on an AMD EPYC), so a float32 comparison tight enough to mean anything
    depends on the CPU's kernels. In float64 every variant agrees to 1.2e-15 (measured), and
    an error of float32 size fails by three orders of magnitude."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _recipe_from_meta_float64(layout, compile, checkpoint)
    finally:
        torch.set_default_dtype(previous)


def _recipe_from_meta_float64(layout, compile, checkpoint):
    from fsdp2 import parallelize_transformer

    cfg = _cfg()
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = GPT(cfg)
    parallelize_transformer(
        model, mesh, tp_plan=tp_plan(), compile=compile, activation_checkpointing=checkpoint
    )
    model.to_empty(device="cpu")
    torch.manual_seed(5)
    model.reset_parameters()
    ref = GPT(cfg)
    torch.manual_seed(5)
    ref.reset_parameters()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.device_mesh.mesh_dim_names == names, name
        assert torch.equal(p.full_tensor(), ref_params[name].detach()), name
    from torch._dynamo.convert_frame import input_codes  # the frames dynamo was handed

    frames_before = len(input_codes.seen)
    index, n_dp = _dp_index(mesh, names)
    batches = _batches(n_dp)
    # every gradient is laid out like its parameter (replicated ones summed once), though
    # to_empty() put new Parameter objects in place after parallelizing
    x, y = batches[0]
    rows = slice(index * ROWS, (index + 1) * ROWS)
    gpt_loss(model, x[rows], y[rows]).backward()
    for name, p in model.named_parameters():
        assert p.grad.placements == p.placements, (name, p.grad.placements)
    model.zero_grad(set_to_none=True)
    losses = _train(model, batches, index, clip=torch.nn.utils.clip_grad_norm_)
    if compile:  # the blocks really ran compiled, and none of the runtime's frames did
        from torch._dynamo.utils import counters

        assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
        codes = [ref() for ref in input_codes.seen[frames_before:]]
        runtime = [c for c in codes if c is not None and _in_runtime(c.co_filename)]
        assert not runtime, [(c.co_name, c.co_filename, c.co_firstlineno) for c in runtime]
    ref_losses = _train(ref, batches, None, clip=torch.nn.utils.clip_grad_norm_)
    assert p.dtype == torch.float64
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL64, atol=ATOL64
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.full_tensor(), ref_params[name].detach(), rtol=RTOL64, atol=ATOL64, msg=name
        )


@pytest.mark.parametrize(
    "layout, checkpoint", [("tp2", False), ("fsdp2_tp2", False), ("tp2", True)]
)
def test_recipe_on_meta_device_initializes_and_trains_like_one_process(layout, checkpoint):
    """``checkpoint``: activation checkpointing around each block, whose recomputation in
    backward gathers the sequence again (and composes with [Note: regather in backward])."""
    shape, _ = LAYOUTS[layout]
    run_on_ranks(int(torch.tensor(shape).prod()), _recipe_from_meta, layout=layout,
                 compile=False, checkpoint=checkpoint)  # fmt: skip


@pytest.mark.parametrize(  # the 2-D case compiles for 6 s: make test-all runs it
    "layout", ["fsdp2", pytest.param("fsdp2_tp2", marks=pytest.mark.nightly)]
)
def test_recipe_compiles_blocks_under_fsdp(layout):
    """Per-block ``torch.compile`` in the recipe (backend ``aot_eager``; tests/test_compile.py
    runs inductor), FSDP at 2 and FSDP 2 x TP 2 (the planned linears run eagerly between
    compiled pieces): the same init and training as one process."""
    shape, _ = LAYOUTS[layout]
    run_on_ranks(int(torch.tensor(shape).prod()), _recipe_from_meta, layout=layout,
                 compile="aot_eager", timeout_s=300)  # fmt: skip


# ------------------------------------------------------------------------- src_data_rank
def _src_data_rank():
    ws = dist.get_world_size()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))

    def rank_model(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))

    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    for src in (0, 1):  # every rank ends up with rank src's values
        model = parallelize_module(rank_model(rank), mesh, plan, src_data_rank=src)
        want = rank_model(src)
        for (name, p), q in zip(model.named_parameters(), want.parameters()):
            assert torch.equal(p.full_tensor(), q.detach()), (src, name)
    # None: no communication; each rank keeps its own slice of its own values
    with CommDebugMode() as comm:
        model = parallelize_module(rank_model(rank), mesh, plan, src_data_rank=None)
    assert comm.get_total_counts() == 0
    mine = rank_model(rank)
    w0 = model[0].weight.to_local()
    assert torch.equal(w0, mine[0].weight.detach().chunk(ws, 0)[rank])
    assert torch.equal(model[1].bias.to_local(), mine[1].bias.detach())
    _raises(
        ValueError,
        r"src_data_rank must be in \[0, 2\) or None, got 2",
        lambda: parallelize_module(rank_model(0), mesh, plan, src_data_rank=2),
    )


def test_src_data_rank_picks_whose_values_are_distributed():
    run_on_ranks(2, _src_data_rank)


# ------------------------------------------------------------------------- loss_parallel
def _loss_parallel():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    n = 9
    full = torch.randn(n, VOCAB)
    target = torch.randint(0, VOCAB, (n,))
    target[2] = -100  # ignored
    for reduction in ("mean", "sum", "none"):
        ref_logits = full.clone().requires_grad_()
        ref = F.cross_entropy(ref_logits, target, reduction=reduction)
        ref.sum().backward()
        logits = distribute_tensor(full.clone(), mesh, [Shard(1)]).requires_grad_()
        with CommDebugMode() as comm, loss_parallel():
            loss = F.cross_entropy(logits, target, reduction=reduction)
            loss.sum().backward()
        torch.testing.assert_close(loss.full_tensor(), ref, rtol=1e-6, atol=1e-6)
        assert logits.grad.placements == (Shard(1),)
        torch.testing.assert_close(logits.grad.full_tensor(), ref_logits.grad, rtol=1e-6, atol=1e-7)
        # never gathers the vocabulary: only all-reduces of one number per row
        kinds = comm.get_comm_counts()
        assert set(kinds) == {"all_reduce"}, kinds
        assert max(r.bytes for r in comm.records) <= n * 4
    # the same through the model (3 ranks: an uneven sequence of 4 and vocabulary of 67):
    # logits stay sharded, same loss and gradients as gathering them
    cfg = _cfg(n_heads=4 if dist.get_world_size() != 3 else 3)
    uneven = SEQ % dist.get_world_size() != 0
    plan = tp_plan(loss_parallel=True, uneven_sequence=uneven)
    sharded = parallelize_module(_model(cfg), mesh["tp"], plan)
    gathered = parallelize_module(_model(cfg), mesh["tp"], tp_plan(uneven_sequence=uneven))
    x, y = _batches(1)[0]
    with loss_parallel():
        loss = gpt_loss(sharded, x, y)
        loss.backward()
    ref = gpt_loss(gathered, x, y)
    ref.backward()
    torch.testing.assert_close(loss.full_tensor(), ref, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(sharded.named_parameters(), gathered.parameters()):
        torch.testing.assert_close(
            p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-5, atol=1e-7, msg=name
        )


@pytest.mark.parametrize("ws", [2, 3])
def test_loss_parallel_matches_gathered_logits_without_gathering_them(ws):
    run_on_ranks(ws, _loss_parallel)


# ------------------------------------------------------------------------- styles vs PyTorch
class _NormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.mlp = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 12))

    def forward(self, x):
        return self.mlp(self.norm(x))


def _sequence_parallel_like_pytorch():
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    ws = dist.get_world_size()
    plan = {
        "norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
    }
    torch.manual_seed(0)
    x = torch.randn(3, 2 * ws, 12)
    grad_out = torch.randn(3, 2 * ws, 12)
    rank = dist.get_rank()
    local_x = x.chunk(ws, dim=1)[rank]
    local_g = grad_out.chunk(ws, dim=1)[rank]
    results = []
    for mesh, parallelize, styles in (
        (init_device_mesh("cpu", (ws,)), parallelize_module, plan),
        (
            torch_mesh("cpu", (ws,)),
            torch_parallelize,
            {k: _torch_style(v) for k, v in plan.items()},
        ),
    ):
        torch.manual_seed(0)
        model = parallelize(_NormMLP(), mesh, styles)
        inp = local_x.clone().requires_grad_()
        out = model(inp)
        out.backward(local_g)
        grads = {n: _full(p.grad) for n, p in model.named_parameters()}
        results.append((out.detach(), inp.grad, grads))
    (out, gin, grads), (t_out, t_gin, t_grads) = results
    assert not isinstance(out, DTensor)  # RowwiseParallel hands on the local tensor
    torch.testing.assert_close(out, t_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gin, t_gin, rtol=1e-6, atol=1e-6)
    assert grads.keys() == t_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], t_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_sequence_parallel_and_prepare_input_match_pytorch():
    run_on_ranks(2, _sequence_parallel_like_pytorch)


# ------------------------------------------------------------------------- regather in backward
class _Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 12)
        self.b = nn.Linear(8, 12)

    def forward(self, h):
        return F.gelu(self.a(h)) * self.b(h)


class _GatherSites(nn.Module):
    """A sequence-parallel norm, then two gather sites: a ``PrepareModuleInput`` whose input
    two column-parallel linears share, and a column-parallel head with ``Shard(1)`` input."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mix = _Mix()
        self.out = nn.Linear(12, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(x + self.out(self.mix(self.norm(x))))


def _gather_site_model(mesh, regather: bool):
    torch.manual_seed(0)
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
        regather_in_backward=regather,
    )  # fmt: skip
    return parallelize_module(_GatherSites(), mesh, {
        "norm": SequenceParallel(uneven_shards=True),  # 5 tokens (below)
        "mix": gather,
        "mix.a": ColwiseParallel(),
        "mix.b": ColwiseParallel(),
        "out": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(),
                                regather_in_backward=regather, uneven_shards=True),
    })  # fmt: skip


def _regather_matches_keeping_the_gathered_input():
    import weakref

    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(1)
    x = torch.randn(2, 5, 8)  # 5 tokens: uneven over 2 and 3 ranks
    g = torch.randn(2, 5, 10)
    local_x = x.chunk(ws, dim=1)[dist.get_rank()]
    runs = {}
    for regather in (False, True):
        model = _gather_site_model(mesh, regather)
        kept = []
        model.mix.a.register_forward_pre_hook(
            lambda _, args, kept=kept: kept.append(weakref.ref(args[0]._local_tensor))
        )
        inp = local_x.clone().requires_grad_()
        out = model(inp)
        alive_after_forward = kept[0]() is not None
        with CommDebugMode() as comm:
            out.backward(g, retain_graph=True)
        first = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        out.backward(g)  # a second pass over the same graph: the gradients double
        second = {n: p.grad.to_local() for n, p in model.named_parameters()}
        gathers = comm.get_comm_counts().get("all_gather", 0)
        runs[regather] = (out.detach(), inp.grad, first, second, gathers, alive_after_forward)
    (out, gin, first, second, gathers, alive), (r_out, r_gin, r_first, r_second, r_gathers,
                                                r_alive) = runs[False], runs[True]  # fmt: skip
    # the same values, bit for bit: the same shards gathered by the same collective
    assert torch.equal(out, r_out) and torch.equal(gin, r_gin)
    for n in first:
        assert torch.equal(first[n], r_first[n]), n
        assert torch.equal(second[n], r_second[n]), n
        torch.testing.assert_close(second[n], 2 * first[n], rtol=1e-6, atol=1e-6, msg=n)
    # the graph kept the gathered input without regather, and only its shard with it
    assert alive and not r_alive
    # one more all-gather per gather site in backward (the shared input gathered once)
    assert r_gathers == gathers + 2, (gathers, r_gathers)


def test_gathered_inputs_are_saved_as_shards_and_gathered_again_in_backward():
    for ws in (2, 3):
        run_on_ranks(ws, _regather_matches_keeping_the_gathered_input)


def _regather_sees_in_place_changes():
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    lin = parallelize_module(
        nn.Linear(6, 4), mesh, ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate())
    )
    shard = torch.randn(3, 6)
    out = lin(shard)
    shard.add_(1.0)  # the shard the backward would gather again
    _raises(RuntimeError, "modified in place before backward", lambda: out.sum().backward())


def test_regather_refuses_a_shard_changed_after_forward():
    run_on_ranks(2, _regather_sees_in_place_changes)


# ------------------------------------------------------------------------- uneven shards
def _norm_then_linear(mesh, uneven: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    ref = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4))
    ref.load_state_dict(model.state_dict())
    plan = {"0": SequenceParallel(uneven_shards=uneven), "1": ColwiseParallel()}
    return parallelize_module(model, mesh, plan), ref


def _uneven_shards():
    import os

    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,))
    odd, even = torch.randn(2, 5, 8), torch.randn(2, 6, 8)  # 5 tokens: 3 and 2
    # even shards are sized without communicating: the sequence gather is the only collective
    model, ref = _norm_then_linear(mesh, uneven=False)
    with CommDebugMode() as comm:
        y = model(even.chunk(ws, 1)[rank])
    assert comm.get_comm_counts() == {"all_gather": 1}, comm
    torch.testing.assert_close(y, ref(even).chunk(ws, -1)[rank], rtol=1e-6, atol=1e-6)
    # opted in, a sequence of any length: its sizes exchanged (a second, 8-byte all-gather)
    model, ref = _norm_then_linear(mesh, uneven=True)
    with CommDebugMode() as comm:
        y = model(odd.chunk(ws, 1)[rank])
    assert sorted(r.bytes for r in comm.records)[0] == 8 and len(comm.records) == 2, comm
    torch.testing.assert_close(y, ref(odd).chunk(ws, -1)[rank], rtol=1e-6, atol=1e-6)
    # the check mode exchanges the sizes of inputs taken as even and names the fix on every
    # rank before any data moves (without it the ranks' collectives no longer match)
    os.environ["DTENSOR_CHECK_SHARDS"] = "1"
    try:
        model, _ = _norm_then_linear(mesh, uneven=False)
        with CommDebugMode() as comm:
            _raises(
                ValueError,
                r"ranks hold \[3, 2\] entries of dim 1 .* taken as even Shard\(1\) pieces\. "
                r"Pass uneven_shards=True",
                lambda: model(odd.chunk(ws, 1)[rank]),
            )
        assert [r.bytes for r in comm.records] == [8], comm
        model(even.chunk(ws, 1)[rank])  # even shards pass it
    finally:
        del os.environ["DTENSOR_CHECK_SHARDS"]


def test_uneven_shards_are_opted_into_and_checked_on_request():
    run_on_ranks(2, _uneven_shards)


# ------------------------------------------------------------------------- errors
def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _errors():
    from fsdp2 import parallelize_transformer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model(_cfg())
    before = {n: p for n, p in model.named_parameters()}
    # a key that matches nothing names the closest real path, and nothing changed
    plan = {"blocks.*.attn.q": ColwiseParallel(), "blocks.*.atn.proj": RowwiseParallel()}
    _raises(
        ValueError,
        r"'blocks\.\*\.atn\.proj' matches no module.*'blocks\.0\.attn\.proj'",
        lambda: parallelize_module(model, mesh["tp"], plan),
    )
    assert all(p is before[n] for n, p in model.named_parameters())
    # a style on a module type it does not support
    _raises(
        TypeError,
        r"ColwiseParallel applies to Linear or Embedding, but 'ln_f' is a LayerNorm",
        lambda: parallelize_module(model, mesh["tp"], {"ln_f": ColwiseParallel()}),
    )
    _raises(
        ValueError,
        r"must be 1-D.*mesh\[\"tp\"\]",
        lambda: parallelize_module(model, mesh, tp_plan()),
    )
    # heads / width not divisible by the tensor-parallel size
    _raises(
        ValueError,
        r"n_heads=3 .* not divisible by the tensor-parallel size 2",
        lambda: parallelize_transformer(_model(_cfg(n_heads=3)), mesh, tp_plan=tp_plan()),
    )
    _raises(
        ValueError,
        r"dim=27 .* not divisible by the tensor-parallel size 2",
        lambda: parallelize_transformer(_model(_cfg(dim=27, n_heads=3)), mesh, tp_plan=tp_plan()),
    )
    # a 2-D mesh without dim names
    unnamed = init_device_mesh("cpu", (2, 2))
    _raises(
        ValueError,
        r"2-D mesh .* needs mesh_dim_names",
        lambda: fully_shard(_model(_cfg()), mesh=unnamed),
    )
    # a tensor-parallel mesh that is not part of the FSDP mesh's root
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "tp"))
    tp_model = parallelize_module(_model(_cfg()), other["tp"], tp_plan())
    _raises(
        ValueError,
        r"not another dim of the FSDP mesh",
        lambda: fully_shard(tp_model.blocks[0], mesh=mesh["dp"]),
    )
    # the tp dim itself as the FSDP mesh: overlapping dims
    _raises(
        ValueError,
        r"not another dim of the FSDP mesh",
        lambda: fully_shard(tp_model.blocks[0], mesh=other["tp"]),
    )
    assert all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 for p in tp_model.parameters())


def test_errors_name_the_problem():
    run_on_ranks(4, _errors)


# ------------------------------------------------------------------------- subclasses
class _LoRALinear(nn.Linear):
    """A Linear with a low-rank adapter of rank 3 (uneven over 2 ranks): its own forward."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.lora_a = nn.Parameter(torch.randn(3, n_in) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(n_out, 3) * 0.3)

    def forward(self, x):
        return super().forward(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class _ScaledLinear(nn.Linear):
    """A quantized-style Linear: the weight's columns scaled by a buffer before the matmul."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, n_in))

    def forward(self, x):
        return F.linear(x, self.weight * self.scale, self.bias)


class _ScaledEmbedding(nn.Embedding):
    def __init__(self, n, d):
        super().__init__(n, d)
        self.gain = nn.Parameter(torch.linspace(0.5, 2.0, d).unsqueeze(0))  # PyTorch shards it

    def forward(self, ids):
        return super().forward(ids) * self.gain


class _ConfigLinear(nn.Linear):
    """Keeps nn.Linear's forward (like torchtitan's config Linear): gets the local forward."""


class _Adapted(nn.Module):
    def __init__(self, up=_LoRALinear, down=_ScaledLinear):
        super().__init__()
        self.emb = _ScaledEmbedding(29, 12)
        self.up = up(12, 18)  # even over 2 and 3: PyTorch's styles take activations as even
        self.down = down(18, 12)
        self.head = nn.Linear(12, 29)

    def forward(self, ids):
        return self.head(self.down(F.gelu(self.up(self.emb(ids)))))


# plan name -> plan. PyTorch's own run of "rowwise_embedding" fails in backward (an
# AssertionError in _MaskPartial's reduce-scatter, for the embedding scaled by its gain), so
# that plan is compared with one process only.
_SUBCLASS_PLANS = {
    "rowwise_embedding": lambda: {
        "emb": RowwiseParallel(input_layouts=Replicate()),  # PyTorch's default is Shard(-1)
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "head": ColwiseParallel(use_local_output=False),
    },
    "colwise_embedding": lambda: {
        "emb": ColwiseParallel(output_layouts=Replicate()),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "head": ColwiseParallel(use_local_output=False),
    },
    "lora_rowwise": lambda: {
        "down": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(use_local_output=False),
    },
}


def _subclasses_keep_their_forward(plan: str):
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    ws = dist.get_world_size()
    kinds = dict(up=_LoRALinear, down=_LoRALinear) if plan == "lora_rowwise" else {}
    ids = torch.randint(0, 29, (3, 5), generator=torch.Generator().manual_seed(2))
    g = torch.randn(3, 5, 29, generator=torch.Generator().manual_seed(3))

    def run(parallelize, mesh, styles):
        torch.manual_seed(0)
        model = _Adapted(**kinds)
        if parallelize is not None:
            parallelize(model, mesh, styles)
        out = model(ids)
        out = _full(out) if parallelize is not None else out
        out.backward(g)
        params = {n: p for n, p in model.named_parameters()}
        grads = {n: None if p.grad is None else _full(p.grad) for n, p in params.items()}
        return model, out.detach(), grads, params

    _, ref_out, ref_grads, _ = run(None, None, None)
    ours = _SUBCLASS_PLANS[plan]()
    model, out, grads, params = run(parallelize_module, init_device_mesh("cpu", (ws,)), ours)
    # the subclasses' own terms are in: one process agrees
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    # a plain Linear runs the local forward; a subclass with its own forward keeps it (no
    # forward set on the instance), and its adapter's parameters are replicated
    assert "forward" in vars(model.head) and "forward" not in vars(model.down)
    for n in (
        ("down.lora_a", "down.lora_b") if plan == "lora_rowwise" else ("up.lora_a", "emb.gain")
    ):
        assert params[n].placements == (Replicate(),), (n, params[n])
    if plan != "rowwise_embedding":
        theirs = {k: _torch_style(v) for k, v in ours.items()}
        _, t_out, t_grads, t_params = run(torch_parallelize, torch_mesh("cpu", (ws,)), theirs)
        torch.testing.assert_close(out, t_out, rtol=1e-5, atol=1e-6)
        for n in grads:
            torch.testing.assert_close(grads[n], t_grads[n], rtol=1e-5, atol=1e-6, msg=n)
            if n.endswith(("weight", "bias")) and isinstance(params[n], DTensor):
                # laid out as PyTorch lays them out (placements compare across libraries)
                assert params[n].placements == t_params[n].placements, (n, t_params[n])
    # a subclass that keeps Linear's forward (torchtitan's config Linear) gets the local one
    model = parallelize_module(
        _Adapted(up=_ConfigLinear), init_device_mesh("cpu", (ws,)), {"up": ColwiseParallel()}
    )
    assert "forward" in vars(model.up)


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("plan", sorted(_SUBCLASS_PLANS))
def test_linear_and_embedding_subclasses_keep_their_forward(plan, ws):
    run_on_ranks(ws, _subclasses_keep_their_forward, plan=plan)
