"""LoRA with Hugging Face PEFT under fully_shard: frozen base weights and trainable fp32
adapters in the same group, on an fp32 base and on a bf16 base (one group then gathers two
dtypes; ``_collectives.RowLayout``).

PEFT puts LoRA adapters on the attention and MLP projections of a tiny Llama (``r=4``); each
decoder layer and the root are sharded at 2 ranks. Three AdamW steps on the adapters must
equal one process (same PEFT model, the whole batch) and PyTorch's FSDP2 on the same inputs
(two ranks: the same sums, so to the bit).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from device_mesh import init_device_mesh
from dtensor.debug import CommDebugMode
from fsdp2 import fully_shard
from tests import _train_loop as loop
from tests.harness import run_on_ranks
from tests.test_fsdp_parity import ROUTES, _on_route

VOCAB, SEQ, PER_RANK, STEPS = 37, 6, 2, 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_llama(base_dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=36,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(base_dtype)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
    torch.manual_seed(1)
    model = get_peft_model(base, lora)
    # PEFT initialises lora_B to zero; give it values so the adapters change the output
    # from the first step and the test sees their gradients flow through both factors.
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def _lm_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def _shard(model, shard, mesh):
    for layer in model.base_model.model.model.layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)


def _lora(base: str):
    base_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[base]
    ws = dist.get_world_size()
    batches = loop.batches(VOCAB, SEQ, PER_RANK, STEPS)
    ref = _lora_llama(base_dtype)
    dtypes = {("lora" if "lora_" in n else "base", p.dtype) for n, p in ref.named_parameters()}
    assert dtypes == {("lora", torch.float32), ("base", base_dtype)}, dtypes
    ref_losses = loop.train(ref, batches, _lm_loss)

    ours = _lora_llama(base_dtype)
    _shard(ours, fully_shard, init_device_mesh("cpu", (ws,)))
    layer = ours.base_model.model.model.layers[0]
    assert {p.dtype for p in layer.parameters()} == {base_dtype, torch.float32}
    opt = loop.adamw(ours)
    with CommDebugMode() as comm:
        losses = loop.train(ours, batches[:1], _lm_loss, per_rank=PER_RANK, opt=opt)
    # one all-gather per group in forward, one per layer in backward; one reduction per
    # layer (the root's embedding, norm and head are all frozen: nothing to reduce)
    assert comm.get_comm_counts() == {"all_gather": 5, "reduce_scatter": 2}, comm
    losses += loop.train(ours, batches[1:], _lm_loss, per_rank=PER_RANK, opt=opt)

    theirs = _lora_llama(base_dtype)
    _shard(theirs, torch_fully_shard, torch_init_device_mesh("cpu", (ws,)))
    their_losses = loop.train(theirs, batches, _lm_loss, per_rank=PER_RANK)

    # one process: the fp32 rounding of a split batch's gradient sum (measured: losses
    # within 5e-7, adapters within 3e-7, on either base)
    loop.compare(ours, ref, losses, ref_losses, rtol=1e-5, atol=2e-6)
    loop.compare(ours, theirs, losses, their_losses, rtol=0, atol=0)


@pytest.mark.parametrize("base,route", [("fp32", "staged"), ("bf16", "staged"), ("bf16", "direct")])
def test_peft_lora_trains_like_one_process_and_pytorch(base, route):
    run_on_ranks(2, _on_route, route=route, target=_lora, base=base)


class MixedNet(torch.nn.Module):
    """A frozen bf16 "base" and trainable fp32 and fp64 layers in each block (odd sizes).

    The base's output enters the loss (so its gathered values are checked through the
    trainable layers' gradients) but no gradient flows back through it: bf16 arithmetic on a
    split batch rounds differently from the whole batch's (0.2% here), which would hide
    what the test compares."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(7, 7).to(torch.bfloat16).requires_grad_(False)
        self.a = torch.nn.Linear(7, 5)
        self.b = torch.nn.Linear(5, 7).double()

    def forward(self, x):
        frozen = self.base(x.detach().to(torch.bfloat16)).float()
        h = frozen + self.a(x) @ self.b.weight.float().T[:5]
        return h + self.b(self.a(x).double()).float()


def _mixed(raf):
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(MixedNet(), MixedNet())
    torch.manual_seed(0)
    model = torch.nn.Sequential(MixedNet(), MixedNet())
    for block in model:
        fully_shard(block, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=raf)
    # SGD: a gradient off by any factor shows (AdamW would hide a constant scale)
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ref, model)]
    g = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        x = torch.randn(3 * ws, 7, generator=g)
        ref(x).square().mean().backward()
        model(x[3 * rank : 3 * rank + 3]).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == q.dtype, name
        torch.testing.assert_close(loop.full(p), q.detach(), rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("raf", [True, False, 2])
def test_groups_of_three_dtypes_train_like_one_process(raf, route):
    # reshard_after_forward=2 at 4 ranks keeps byte rows after forward and re-gathers them
    run_on_ranks(4 if raf == 2 else 3, _on_route, route=route, target=_mixed, raf=raf)


def _complex_and_real():
    """complex128 (16-byte items) beside float32 in one group: every byte slot starts where
    complex128 may be viewed; the gathered values are the originals."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.real = torch.nn.Parameter(torch.randn(5, 3))
    m.cplx = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.complex128))
    m.low = torch.nn.Parameter(torch.randn(7).to(torch.bfloat16))
    originals = {n: p.detach().clone() for n, p in m.named_parameters()}
    fully_shard(m)
    m.unshard()
    for name, value in originals.items():
        assert torch.equal(getattr(m, name).detach(), value), name


@pytest.mark.parametrize("route", ROUTES)
def test_complex_and_real_parameters_in_one_group(route):
    run_on_ranks(2, _on_route, route=route, target=_complex_and_real)
