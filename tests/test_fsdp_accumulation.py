"""Gradient accumulation equals one big batch, whatever the micro-batches' sync flags.

* HSDP (2 replicas x 2 shards): three micro-batches, the first two with every combination
  of ``set_requires_gradient_sync`` and ``set_requires_all_reduce``, the last with both on.
  The accumulated gradients must equal the single-process gradients of the whole batch.
* bf16 compute with fp32 reduction and no-sync micro-batches: gradients accumulate in fp32,
  as PyTorch's FSDP2 does, and match it under the same policy.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from device_mesh import init_device_mesh
from examples.gpt import gpt_loss
from fsdp2 import MixedPrecisionPolicy, fully_shard
from tests.harness import run_on_ranks
from tests.test_fsdp_parity import ROUTES, VOCAB, _build, _cfg, _full, _on_route

SEQ = 3
FLAGS = [(True, True), (True, False), (False, True), (False, False)]


def _set_flags(model, sync: bool, all_reduce: bool) -> None:
    model.set_requires_gradient_sync(sync)
    model.set_requires_all_reduce(all_reduce)


def _batch(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, VOCAB, (rows, SEQ), generator=g),
        torch.randint(0, VOCAB, (rows, SEQ), generator=g),
    )


def _hsdp_accumulation():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = _cfg()
    micro = 3
    ref_grads, ref_params = _one_big_batch(cfg, micro * ws)  # the same for every combination
    for first, second in itertools.product(FLAGS, FLAGS):
        model = _build(cfg, fully_shard, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            x, y = _batch(micro * ws, seed=step)
            mine = slice(rank * micro, (rank + 1) * micro)
            xs, ys = x[mine], y[mine]
            for i, flags in enumerate((first, second, (True, True))):
                _set_flags(model, *flags)
                (gpt_loss(model, xs[i : i + 1], ys[i : i + 1]) / micro).backward()
            for (name, p), q in zip(model.named_parameters(), ref_grads[step], strict=True):
                assert p.grad is not None, (first, second, name)
                torch.testing.assert_close(
                    p.grad.full_tensor(),
                    q,
                    rtol=1e-5,
                    atol=2e-6,
                    msg=f"{first} {second} {name}",
                )
            opt.step()
            opt.zero_grad()
        for p, q in zip(model.parameters(), ref_params, strict=True):
            torch.testing.assert_close(_full(p), q, rtol=1e-5, atol=2e-6)


def _one_big_batch(cfg, rows: int):
    """The single-process reference: each step's gradients, and the parameters after two
    AdamW steps on the whole batch."""
    ref = _build(cfg)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    grads = []
    for step in range(2):
        x, y = _batch(rows, seed=step)
        gpt_loss(ref, x, y).backward()
        grads.append([q.grad.clone() for q in ref.parameters()])
        opt_ref.step()
        opt_ref.zero_grad()
    return grads, [q.detach().clone() for q in ref.parameters()]


# the staged route's 16 combinations run in make test-all (the flags do not depend on the
# route; its reductions are checked in this file's other tests and in test_fsdp_parity)
@pytest.mark.parametrize(
    "route", [r if r == "direct" else pytest.param(r, marks=pytest.mark.nightly) for r in ROUTES]
)
def test_hsdp_accumulation_equals_one_big_batch_for_every_flag_combination(route):
    run_on_ranks(4, _on_route, route=route, target=_hsdp_accumulation)


def _bf16_no_sync():
    rank = dist.get_rank()
    cfg = _cfg()
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
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step in range(3):
        x, y = _batch(8, seed=10 + step)
        xs, ys = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
        for model in (ours, theirs):
            for i in range(4):  # three micro-batches without sync, one with
                model.set_requires_gradient_sync(i == 3)
                (gpt_loss(model, xs[i : i + 1], ys[i : i + 1]) / 4).backward()
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert p.grad.dtype == torch.float32, name
            torch.testing.assert_close(
                p.grad.to_local(), q.grad.to_local(), rtol=0, atol=0, msg=f"{step} {name}"
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=0, atol=0)


@pytest.mark.parametrize("route", ROUTES)
def test_bf16_no_sync_accumulates_in_fp32_like_torch(route):
    run_on_ranks(2, _on_route, route=route, target=_bf16_no_sync)
