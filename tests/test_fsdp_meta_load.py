"""Loading into a model sharded on the meta device ([Note: assigned parameters] in
fsdp2/_param.py): ``load_state_dict(sharded_sd, assign=True)`` - accelerate's
``cpu_ram_efficient_loading``, torchtitan's seed checkpoint - gives the model new sharded
parameters, which fully_shard adopts; a parameter still on meta at the first forward is an
error naming it. Checked against PyTorch's FSDP2 doing the same, and against a model sharded
the ordinary way, bit for bit, over three AdamW steps: uneven rows, tied embeddings, mixed
precision, CPU offload; accelerate's own ``fsdp2_load_full_state_dict`` with our names in place
of PyTorch's; ``to_empty()`` + ``reset_parameters()``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as torch_tensor_pkg
from torch import nn
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

import dtensor
from device_mesh import init_device_mesh
from dtensor import Shard, distribute_tensor
from examples.gpt import GPT, GPTConfig, gpt_loss
from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.harness import run_on_ranks

VOCAB, SEQ, STEPS = 61, 9, 3  # 61 rows and 9 positions: uneven over 2 ranks


def _cfg(tie: bool = False) -> GPTConfig:
    return GPTConfig(
        vocab_size=VOCAB, dim=30, n_layers=2, n_heads=3, max_seq_len=SEQ, tie_weights=tie
    )


def _policies(variant: str, ours: bool) -> dict:
    if variant == "bf16":
        cls = MixedPrecisionPolicy if ours else TorchMP
        return {"mp_policy": cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if variant == "offload":
        return {"offload_policy": CPUOffloadPolicy() if ours else TorchOffload(pin_memory=False)}
    return {}


def _shard(model, ours: bool, variant: str):
    shard = fully_shard if ours else torch_fully_shard
    make_mesh = init_device_mesh if ours else torch_init_device_mesh
    mesh = make_mesh("cpu", (dist.get_world_size(),))
    kw = _policies(variant, ours)
    for block in model.blocks:
        shard(block, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    return model


def _full_state(cfg) -> dict:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in GPT(cfg).state_dict().items()}


def _sharded_sd(model, full: dict, ours: bool) -> dict:
    """What accelerate builds: per key, the full tensor distributed like the parameter."""
    dist_fn = distribute_tensor if ours else torch_distribute_tensor
    return {k: dist_fn(full[k], p.device_mesh, p.placements) for k, p in model.state_dict().items()}


def _meta_loaded(cfg, ours: bool, variant: str):
    with torch.device("meta"):
        model = GPT(cfg)
    _shard(model, ours, variant)
    model.load_state_dict(_sharded_sd(model, _full_state(cfg), ours), assign=True)
    return model


def _eager(cfg, variant: str):
    torch.manual_seed(0)
    return _shard(GPT(cfg), True, variant)


def _train(model) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        batch = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        loss = gpt_loss(model, batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return losses, params


def _same(a, b, what: str) -> None:
    (la, pa), (lb, pb) = a, b
    assert la == lb, (what, la, lb)
    assert pa.keys() == pb.keys(), what
    for n in pa:
        assert torch.equal(pa[n], pb[n]), (what, n)


def _parity(variant: str, tie: bool) -> None:
    cfg = _cfg(tie)
    ours = _meta_loaded(cfg, True, variant)
    for n, p in ours.named_parameters():
        assert p.to_local().device.type == "cpu", n  # adopted, off meta
    if tie:
        assert ours.head.weight is ours.tok_emb.weight
    got = _train(ours)
    _same(got, _train(_eager(cfg, variant)), f"{variant}: meta+load vs eager")
    _same(got, _train(_meta_loaded(cfg, False, variant)), f"{variant}: ours vs PyTorch")


@pytest.mark.parametrize("variant,tie", [("plain", True), ("bf16", False), ("offload", True)])
def test_meta_load_assign_matches_pytorch_and_eager(variant, tie):
    run_on_ranks(2, _parity, variant=variant, tie=tie)


class _Accelerator:
    """The one attribute fsdp2_load_full_state_dict reads."""

    def __init__(self) -> None:
        self.is_main_process = dist.get_rank() == 0


def _accelerate_load(cpu_offload: bool) -> None:
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

    cfg = _cfg(tie=True)
    full = _full_state(cfg) if dist.get_rank() == 0 else {}  # accelerate: rank 0 only
    with torch.device("meta"):
        model = GPT(cfg)
    _shard(model, True, "offload" if cpu_offload else "plain")
    # its function imports DTensor and distribute_tensor from torch.distributed.tensor
    saved = torch_tensor_pkg.DTensor, torch_tensor_pkg.distribute_tensor
    torch_tensor_pkg.DTensor, torch_tensor_pkg.distribute_tensor = (
        dtensor.DTensor,
        dtensor.distribute_tensor,
    )
    try:
        fsdp2_load_full_state_dict(_Accelerator(), model, full, cpu_offload=cpu_offload)
    finally:
        torch_tensor_pkg.DTensor, torch_tensor_pkg.distribute_tensor = saved
    _same(_train(model), _train(_eager(cfg, "plain")), "accelerate's loader vs eager")


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_accelerate_fsdp2_load_full_state_dict(cpu_offload):
    run_on_ranks(2, _accelerate_load, cpu_offload=cpu_offload)


def _left_on_meta() -> None:
    cfg = _cfg()
    with torch.device("meta"):
        model = GPT(cfg)
    _shard(model, True, "plain")
    sd = _sharded_sd(model, _full_state(cfg), True)
    del sd["blocks.1.mlp.out.weight"]
    model.load_state_dict(sd, assign=True, strict=False)
    x = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(RuntimeError, match=r"1 parameter.*meta.*'blocks\.1\.mlp\.out\.weight'"):
        model(x)
    with pytest.raises(RuntimeError, match=r"to_empty\(device='cpu'\).*assign=True"):
        model(x)
    # PyTorch's FSDP2 refuses the same model at the same point
    with torch.device("meta"):
        theirs = GPT(cfg)
    _shard(theirs, False, "plain")
    sd = _sharded_sd(theirs, _full_state(cfg), False)
    del sd["blocks.1.mlp.out.weight"]
    theirs.load_state_dict(sd, assign=True, strict=False)
    with pytest.raises(RuntimeError, match="still on meta"):
        theirs(x)


def test_parameter_left_on_meta_fails_at_first_forward_naming_it():
    run_on_ranks(2, _left_on_meta)


def _to_empty_then_init() -> None:
    cfg = _cfg(tie=True)
    with torch.device("meta"):
        model = GPT(cfg)
    _shard(model, True, "plain")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    torch.manual_seed(0)
    eager = GPT(cfg)
    torch.manual_seed(0)
    eager.reset_parameters()
    _same(_train(model), _train(_shard(eager, True, "plain")), "to_empty + init vs eager")


def test_to_empty_then_reset_parameters():
    run_on_ranks(2, _to_empty_then_init)


def _assignments() -> None:
    cfg = _cfg()
    full = _full_state(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    _shard(model, True, "plain")
    stale_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = _sharded_sd(model, full, True)
    # a wrong layout or a plain tensor is refused, naming the parameter
    bad = dict(
        sd,
        **{
            "head.weight": distribute_tensor(
                full["head.weight"], sd["head.weight"].device_mesh, [Shard(1)]
            )
        },
    )
    with pytest.raises(ValueError, match=r"'head\.weight'.*placements.*distribute_tensor"):
        model.load_state_dict(bad, assign=True)
    with pytest.raises(TypeError, match=r"'head\.weight'.*Parameter.*must be a DTensor"):
        model.head.weight = nn.Parameter(full["head.weight"].clone())
        model(torch.randint(0, VOCAB, (2, SEQ)))
    # a user's assignment before the first forward is adopted at lazy init
    model.load_state_dict(sd, assign=True)
    new = full["head.weight"] * 2
    model.head.weight = nn.Parameter(
        distribute_tensor(new, sd["head.weight"].device_mesh, [Shard(0)])
    )
    gpt_loss(model, *torch.randint(0, VOCAB, (2, 2, SEQ))).backward()
    assert torch.equal(model.head.weight.full_tensor(), new)
    assert model.head.weight.grad is not None
    # an optimizer built on the meta parameters would train nothing: it raises
    with pytest.raises(RuntimeError, match="assign=True"):
        stale_opt.step()


def test_assigned_parameters_are_checked_and_adopted():
    run_on_ranks(2, _assignments)
