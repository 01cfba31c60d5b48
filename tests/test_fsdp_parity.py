"""fully_shard trains like one process, and like torch's own FSDP2 on the same inputs.

Every test trains three copies of one small GPT with awkward sizes (vocabulary 67 and
width 30, neither divisible by 2, 3 or 4; 3 position rows, fewer than 4 ranks) for 4 AdamW
steps: ours (fully_shard on each block and the root), a single-process reference that sees
the whole global batch, and, where the meaning is shared, torch.distributed.fsdp.fully_shard.

Tolerances. Against torch FSDP2 the results are compared exactly where both run the same
arithmetic (fp32 on one or two ranks: same chunking, and a sum of two is order-free); from
three ranks on the two libraries sum gradients in different orders, so the reference
tolerance below applies. Against one process
the gradient of a split batch is summed in another order; with AdamW that rounding reaches
about 1e-6 on weights of size ~0.1, and torch FSDP2 shows the same gap, so the reference
comparison is ``rtol=1e-5, atol=2e-6``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from device_mesh import init_device_mesh
from dtensor import DTensor, Shard
from examples.gpt import GPT, GPTConfig, gpt_loss
from fsdp2 import FSDPModule, MixedPrecisionPolicy, fully_shard
from fsdp2 import _collectives as C
from tests.harness import run_on_ranks

VOCAB, SEQ, PER_RANK = 67, 3, 2
STEPS = 4


# On gloo a group's collectives are point-to-point messages ("direct") when its parameters
# are large enough on average, else all-to-alls of staged rows ("staged"). These models are
# far below the threshold, so each test says which route it runs.
ROUTES = ["direct", "staged"]


def _on_route(route: str, target, **kw):
    """Run ``target`` with every fsdp2 group on one collective route (restored after)."""
    saved = C.DIRECT_MIN_BYTES_PER_PARAM
    C.DIRECT_MIN_BYTES_PER_PARAM = 0 if route == "direct" else 1 << 62
    try:
        return target(**kw)
    finally:
        C.DIRECT_MIN_BYTES_PER_PARAM = saved


def _cfg(**kw) -> GPTConfig:
    base = dict(vocab_size=VOCAB, dim=30, n_layers=2, n_heads=3, max_seq_len=SEQ, bias=False)
    base.update(kw)
    return GPTConfig(**base)


def _build(cfg: GPTConfig, shard=None, *, meta=False, **kw):
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
        torch.manual_seed(0)
        model.reset_parameters()  # the same draws the meta-device path makes after sharding
    if shard is not None:
        for block in model.blocks:
            shard(block, **kw)
        shard(model, **kw)
    if meta:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.reset_parameters()
    return model


def _batches(ws: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    n = PER_RANK * ws
    return [
        (
            torch.randint(0, VOCAB, (n, SEQ), generator=g),
            torch.randint(0, VOCAB, (n, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _train(model, batches, *, local: bool, accumulate: str | None = None, opt=None):
    """Train on every batch; ``local`` picks this rank's rows. Returns the global losses."""
    opt = _optimizer(model) if opt is None else opt
    rank, ws = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in batches:
        if local:
            x, y = (
                x[rank * PER_RANK : (rank + 1) * PER_RANK],
                y[rank * PER_RANK : (rank + 1) * PER_RANK],
            )
        if accumulate is None:
            loss = gpt_loss(model, x, y)
            loss.backward()
        else:  # two micro-batches, each half of the rows
            loss = 0.0
            for i, half in enumerate((slice(0, len(x) // 2), slice(len(x) // 2, len(x)))):
                if accumulate == "no_sync" and isinstance(model, FSDPModule):
                    model.set_requires_gradient_sync(i == 1)
                part = gpt_loss(model, x[half], y[half]) / 2
                part.backward()
                loss = loss + part.detach()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if local:
            dist.all_reduce(loss)
            loss /= ws
        losses.append(loss.item())
    return losses


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _compare(model, ref, losses, ref_losses, *, exact=False, rtol=1e-5, atol=2e-6):
    if exact:
        rtol = atol = 0.0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    ours = dict(model.named_parameters())
    theirs = dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        torch.testing.assert_close(_full(p), _full(theirs[name]), rtol=rtol, atol=atol, msg=name)


def _parity(cfg_kw=None, shard_kw=None, accumulate=None, meta=False, setup=None, oracle=True):
    """Ours vs one process (and vs torch FSDP2 when ``oracle``) on the same batches."""
    cfg = _cfg(**(cfg_kw or {}))
    shard_kw = shard_kw or {}
    ws = dist.get_world_size()
    batches = _batches(ws)
    ref = _build(cfg)
    ref_losses = _train(ref, batches, local=False, accumulate=accumulate)
    model = _build(cfg, fully_shard, meta=meta, **shard_kw)
    if setup is not None:
        setup(model)
    losses = _train(model, batches, local=True, accumulate=accumulate)
    _compare(model, ref, losses, ref_losses)
    if oracle:
        their_kw = dict(shard_kw)
        if "shard_placement_fn" in their_kw:
            their_kw["shard_placement_fn"] = _torch_shard_dim1
        theirs = _build(cfg, torch_fully_shard, **their_kw)
        their_losses = _train(theirs, batches, local=True, accumulate=accumulate)
        # two ranks: a + b is b + a, so both libraries agree to the bit; from three ranks on
        # the gradient sum runs in a different order (ours: rank order; torch: gloo's ring)
        _compare(model, theirs, losses, their_losses, exact=ws <= 2)


# ------------------------------------------------------------------------------- world sizes
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_default_matches_single_process_and_torch(ws, route):
    run_on_ranks(ws, _on_route, route=route, target=_parity)


# ------------------------------------------------------------------------------- reshard modes
def _no_prefetch(model):
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_modules_to_forward_prefetch([])
            m.set_modules_to_backward_prefetch([])


def _explicit_prefetch(model):
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch([blocks[0]])
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])
    model.set_modules_to_backward_prefetch([blocks[1]])
    blocks[1].set_modules_to_backward_prefetch([blocks[0]])


@pytest.mark.parametrize("prefetch", ["implicit", "none", "explicit"])
@pytest.mark.parametrize("mode", [True, False, None])
def test_reshard_after_forward_modes(mode, prefetch):
    setup = {"implicit": None, "none": _no_prefetch, "explicit": _explicit_prefetch}[prefetch]
    # every prefetch order on the direct route; the staged route with the implicit order
    for route in ROUTES if prefetch == "implicit" else ["direct"]:
        run_on_ranks(
            3,
            _on_route,
            route=route,
            target=_parity,
            shard_kw={"reshard_after_forward": mode},
            setup=setup,
        )


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("prefetch", [True, False])
def test_reshard_after_forward_int(prefetch, route):
    run_on_ranks(
        4,
        _on_route,
        route=route,
        target=_parity,
        shard_kw={"reshard_after_forward": 2},
        oracle=False,
        setup=None if prefetch else _no_prefetch,
    )


# ------------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("accumulate", ["sync", "no_sync"])
def test_gradient_accumulation_equals_one_big_batch(accumulate, route):
    run_on_ranks(2, _on_route, route=route, target=_parity, accumulate=accumulate, oracle=False)


# ------------------------------------------------------------------------------- life cycle
def test_meta_device_init_matches_eager_init():
    run_on_ranks(3, _on_route, route="direct", target=_parity, meta=True, oracle=False)


def test_activation_checkpointing():
    run_on_ranks(2, _on_route, route="direct", target=_parity, cfg_kw={"checkpoint_blocks": True})


def _frozen():
    def freeze(model):
        model.pos_emb.weight.requires_grad_(False)
        model.blocks[0].ln1.weight.requires_grad_(False)

    cfg = _cfg()
    ws = dist.get_world_size()
    batches = _batches(ws)
    ref = _build(cfg)
    freeze(ref)
    ref_losses = _train(ref, batches, local=False)
    model = _build(cfg)
    freeze(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    before = model.pos_emb.weight.full_tensor().clone()
    losses = _train(model, batches, local=True)
    _compare(model, ref, losses, ref_losses)
    assert model.pos_emb.weight.grad is None
    assert torch.equal(model.pos_emb.weight.full_tensor(), before)


@pytest.mark.parametrize("route", ROUTES)
def test_frozen_params(route):
    run_on_ranks(2, _on_route, route=route, target=_frozen)


def _tied_inner_group():
    # head is its own group; tok_emb is in the root group: the root takes the shared weight
    cfg = _cfg(tie_weights=True)
    ws = dist.get_world_size()
    batches = _batches(ws)
    ref = _build(cfg)
    ref_losses = _train(ref, batches, local=False)
    model = _build(cfg)
    fully_shard(model.head)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    assert model.head.weight is model.tok_emb.weight
    assert isinstance(model.head.weight, DTensor)
    losses = _train(model, batches, local=True)
    assert model.head.weight is model.tok_emb.weight
    _compare(model, ref, losses, ref_losses)


@pytest.mark.parametrize("ws", [2, 3])
def test_tied_weights_same_group(ws):
    kw = {"cfg_kw": {"tie_weights": True}, "oracle": False}
    run_on_ranks(ws, _on_route, route="direct", target=_parity, **kw)


@pytest.mark.parametrize("route", ROUTES)
def test_tied_weights_across_groups(route):
    run_on_ranks(3, _on_route, route=route, target=_tied_inner_group)


def _shard_dim1(p):
    return Shard(1) if p.ndim == 2 else None


def _torch_shard_dim1(p):
    from torch.distributed.tensor import Shard as TorchShard

    return TorchShard(1) if p.ndim == 2 else None


@pytest.mark.parametrize("route", ROUTES)
def test_shard_placement_fn_shard1(route):
    kw = {"shard_kw": {"shard_placement_fn": _shard_dim1}}
    run_on_ranks(3, _on_route, route=route, target=_parity, **kw)


# ------------------------------------------------------------------------------- mixed precision
def _bf16():
    cfg = _cfg()
    ws = dist.get_world_size()
    batches = _batches(ws)
    ours = _build(
        cfg,
        fully_shard,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    theirs = _build(
        cfg,
        torch_fully_shard,
        mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    losses = _train(ours, batches, local=True)
    their_losses = _train(theirs, batches, local=True)
    for p in ours.parameters():  # the optimizer only ever sees fp32
        assert p.dtype == torch.float32 and p.to_local().dtype == torch.float32
    _compare(ours, theirs, losses, their_losses, rtol=1.6e-2, atol=1e-3)
    ref = _build(cfg)
    ref_losses = _train(ref, batches, local=False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


@pytest.mark.parametrize("route", ROUTES)
def test_bf16_params_fp32_reduce_matches_torch(route):
    run_on_ranks(2, _on_route, route=route, target=_bf16)


# ------------------------------------------------------------------------------- layout at rest
def _layout():
    cfg = _cfg()
    ours = _build(cfg, fully_shard)
    theirs = _build(cfg, torch_fully_shard)
    ref = _build(cfg)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter), name
        assert [str(x) for x in p.placements] == [str(x) for x in q.placements], name
        assert p.to_local().shape == q.to_local().shape, name
        assert torch.equal(p.to_local(), q.to_local()), name
    assert isinstance(ours, GPT) and isinstance(ours, FSDPModule)
    for name, value in ours.state_dict().items():
        assert isinstance(value, DTensor), name


@pytest.mark.parametrize("ws", [2, 4])
def test_layout_matches_torch(ws):
    run_on_ranks(ws, _layout)


# ------------------------------------------------------------------------------- HSDP
def _hsdp():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    cfg = _cfg()
    batches = _batches(4)
    ref = _build(cfg)
    ref_losses = _train(ref, batches, local=False)
    model = _build(cfg, fully_shard, mesh=mesh)
    p = model.blocks[0].attn.qkv.weight
    assert [str(x) for x in p.placements] == ["R", "S(0)"]
    losses = _train(model, batches, local=True)
    _compare(model, ref, losses, ref_losses)


@pytest.mark.parametrize("route", ROUTES)
def test_hsdp_2d_mesh(route):
    run_on_ranks(4, _on_route, route=route, target=_hsdp)


# ------------------------------------------------------------------------------- zero elements
class _EmptyParams(torch.nn.Module):
    """Parameters with no elements: a Linear with no outputs, a (4, 0) matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(5, 6)
        self.none = torch.nn.Linear(6, 0)
        self.flat = torch.nn.Parameter(torch.zeros(4, 0))
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.inner(x))
        h = torch.cat([h, self.none(h)], -1)
        return self.out(h) + self.flat.sum()


def _zero_element_params(all_empty_group: bool):
    """Empty parameters in a group with others, or in a group of their own, against one
    process. (torch 2.13's FSDP2 cannot be the oracle: its reduce-scatter copy-in raises
    "_chunk_cat expects non-empty tensor" for any zero-element gradient, on either layout.)"""
    rank, ws = dist.get_rank(), dist.get_world_size()
    models = []
    for shard in (None, fully_shard):
        torch.manual_seed(0)
        m = _EmptyParams()
        if shard is not None:
            shard(m.inner)
            if all_empty_group:
                shard(m.none)
            shard(m)
        models.append((m, torch.optim.AdamW(m.parameters(), lr=1e-2)))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2 * ws, 5, generator=g)
        for i, (m, opt) in enumerate(models):
            xs = x if i == 0 else x[2 * rank : 2 * rank + 2]
            scale = 1.0 if i == 0 else 1.0 / ws
            (m(xs).square().sum() * scale).backward()
            opt.step()
            opt.zero_grad()
    ref, ours = models[0][0], models[1][0]
    for (name, p), r in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert p.shape == r.shape and isinstance(p, DTensor), name
        assert p.grad is None  # zero_grad() set them to None, as on one process
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("all_empty_group", [False, True], ids=["mixed-group", "empty-group"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("ws", [2, 3])
def test_zero_element_parameters_train(ws, route, all_empty_group):
    kw = {"all_empty_group": all_empty_group}
    run_on_ranks(ws, _on_route, route=route, target=_zero_element_params, **kw)
