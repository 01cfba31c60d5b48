"""Activation checkpointing in the forms real code uses, under fully_shard.

A recomputation in backward reads the module's parameters again. Each form below must train
like one process (same form, no sharding) and like PyTorch's FSDP2 on the same inputs:

* ``body``: ``checkpoint(self._body, x)`` inside a sharded block's forward (the recomputed
  function is not the FSDP module's forward, so FSDP's hooks do not run around it);
* ``body_reentrant``: the same with ``use_reentrant=True``;
* ``selective``: ``checkpoint(self.mlp, h)`` on a submodule of a sharded block;
* ``wrapper``: PyTorch's ``checkpoint_wrapper(block)``, then ``fully_shard(wrapper)``;
* ``whole``: ``checkpoint(block, x)`` around the sharded block itself (its hooks run again);
* Hugging Face's ``model.gradient_checkpointing_enable()`` on a tiny Llama (transformers 5
  checkpoints each layer's ``forward``, keeping FSDP's hooks outside the checkpoint).

Awkward sizes: width 9 and vocabulary 37 (odd), layer norms of 9 rows at 2 ranks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.checkpoint import checkpoint

from device_mesh import init_device_mesh
from fsdp2 import MixedPrecisionPolicy, fully_shard
from tests import _torch_compat as compat
from tests import _train_loop as loop
from tests.harness import run_on_ranks

DIM, VOCAB, SEQ, PER_RANK, STEPS = 9, 37, 5, 2, 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 3 * DIM)
        self.fc2 = nn.Linear(3 * DIM, DIM)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.ln = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def _body(self, x):
        return x + self.mlp(self.ln(x))

    def forward(self, x):
        if self.form == "body":
            return checkpoint(self._body, x, use_reentrant=False)
        if self.form == "body_reentrant":
            return checkpoint(self._body, x, use_reentrant=True)
        if self.form == "selective":
            return x + checkpoint(self.mlp, self.ln(x), use_reentrant=False)
        return self._body(x)


class Net(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(VOCAB, DIM)
        blocks = [Block(form) for _ in range(3)]
        if form == "wrapper":
            blocks = [checkpoint_wrapper(b) for b in blocks]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.form == "whole" else block(h)
        return self.head(h)


def _loss(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _logits_loss(model, x, y):
    return _loss(model(x), y)


def _three_ways(build, blocks_of, loss_of=_logits_loss):
    """Train ``build()`` in one process, under ours and under PyTorch's FSDP2; compare."""
    batches = loop.batches(VOCAB, SEQ, PER_RANK, STEPS)
    ws = dist.get_world_size()
    ref = build()
    ref_losses = loop.train(ref, batches, loss_of)
    runs = []
    for shard, mesh in (
        (fully_shard, init_device_mesh("cpu", (ws,))),
        (torch_fully_shard, torch_init_device_mesh("cpu", (ws,))),
    ):
        model = build()
        for block in blocks_of(model):
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        runs.append((model, loop.train(model, batches, loss_of, per_rank=PER_RANK)))
    (ours, losses), (theirs, their_losses) = runs
    loop.compare(ours, ref, losses, ref_losses)
    loop.compare(ours, theirs, losses, their_losses, rtol=0, atol=0)  # two ranks: same sums


def _net(form: str) -> Net:
    torch.manual_seed(0)
    return Net(form)


def _forms(form: str):
    _three_ways(functools.partial(_net, form), lambda m: m.blocks)


@pytest.mark.parametrize("form", ["body", "body_reentrant", "selective", "wrapper", "whole"])
def test_activation_checkpointing_forms_train_like_one_process_and_pytorch(form):
    run_on_ranks(2, _forms, form=form)


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=36,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _hf_gradient_checkpointing():
    _three_ways(
        _hf_llama,
        lambda m: m.model.layers,
        loss_of=lambda m, x, y: m(x, labels=y).loss,
    )


def test_hugging_face_gradient_checkpointing_enable_trains():
    run_on_ranks(2, _hf_gradient_checkpointing)


class RotaryNet(Net):
    """``whole``-form checkpointing of blocks that take a second input computed in fp32
    outside them (as a Llama's rotary ``cos`` / ``sin``): under a bf16 ``mp_policy`` the
    recomputation must see the inputs cast as the forward did."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__("plain")
        self.checkpointed = checkpointed
        for block in self.blocks:
            block.forward = functools.partial(self._block_forward, block)

    @staticmethod
    def _block_forward(block, x, scale):
        return block._body(x * scale)

    def forward(self, tokens):
        h = self.emb(tokens)
        scale = torch.linspace(0.5, 1.5, DIM)  # fp32, made outside the sharded blocks
        for block in self.blocks:
            if self.checkpointed:
                h = checkpoint(block, h, scale, use_reentrant=False)
            else:
                h = block(h, scale)
        return self.head(h)


def _mixed_precision_recompute():
    batches = loop.batches(VOCAB, SEQ, PER_RANK, STEPS)
    ws = dist.get_world_size()
    runs = []
    arms = [
        (fully_shard, init_device_mesh("cpu", (ws,)), MixedPrecisionPolicy, True),
        (fully_shard, init_device_mesh("cpu", (ws,)), MixedPrecisionPolicy, False),
    ]
    if compat.FSDP2_RECOMPUTE_CASTS_INPUTS:  # PyTorch 2.11's FSDP2 fails here itself
        arms.append(
            (torch_fully_shard, torch_init_device_mesh("cpu", (ws,)), TorchMixedPrecision, True)
        )
    for shard, mesh, policy, checkpointed in arms:
        torch.manual_seed(0)
        model = RotaryNet(checkpointed)
        mp = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            shard(block, mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        runs.append((model, loop.train(model, batches, _logits_loss, per_rank=PER_RANK)))
    (ours, losses), (plain, plain_losses) = runs[:2]
    loop.compare(ours, plain, losses, plain_losses, rtol=0, atol=0)  # recomputed = computed
    for theirs, their_losses in runs[2:]:
        loop.compare(ours, theirs, losses, their_losses, rtol=0, atol=0)


def test_recomputation_casts_inputs_like_forward_under_bf16():
    """Was: ``CheckpointError: Recomputed values ... have different metadata`` (the
    recomputation skipped the input cast, so fp32 ``scale`` met bf16 saved tensors)."""
    run_on_ranks(2, _mixed_precision_recompute)
