"""The dry run at scale (fsdp2/tools/dry_run.py): the real library over PyTorch's fake
process group in this one process, checked against the planner's analytic layout and
collectives (fsdp2/tools/planner.py).

Each dry run initializes and destroys its own fake default group, so these tests need a
process where torch.distributed is not initialized (pytest's main process; the multi-rank
tests run in the harness's workers). The sweep over 64-1024 ranks and 7B-70B models is
opt-in: FSDP2_DRY_RUN_SWEEP=1.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig, tp_plan
from fsdp2 import MixedPrecisionPolicy
from fsdp2.tools.dry_run import dry_run, mesh_for
from fsdp2.tools.planner import PlanConfig, collectives, group_layouts, profile_model

# Llama-2 sized GPTs (examples/gpt.py; separate q/k/v for tensor parallelism)
LLAMA_7B = GPTConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, max_seq_len=2048,
                     fused_qkv=False)  # fmt: skip
LLAMA_70B = GPTConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, max_seq_len=2048,
                      fused_qkv=False)  # fmt: skip
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _check_against_planner(cfg: GPTConfig, plan: PlanConfig, *, rank: int = 0) -> None:
    mp = MixedPrecisionPolicy(plan.param_dtype, plan.reduce_dtype) if plan.param_dtype else None
    report = dry_run(
        lambda: GPT(cfg),
        world_size=plan.world_size,
        rank=rank,
        tp=plan.tp,
        dp_replicate=plan.dp_replicate,
        tp_plan=tp_plan(),
        activation_checkpointing=plan.activation_checkpointing,
        mp_policy=mp,
        reshard_after_forward=plan.reshard_after_forward,
        seq_len=16,
    )
    assert not dist.is_initialized()  # the dry run cleaned up its fake group
    with torch.device("meta"):
        model = GPT(cfg)
    profile = profile_model(model, seq_len=16, tp_plan=tp_plan())
    predicted = {g.name: g.shard_numel for g in group_layouts(profile, plan)}
    assert report.shard_numel == predicted
    expected = collectives(profile, plan)
    dims = {k[1] for k in expected} | ({"tp"} if plan.tp > 1 else set())
    seen = {k: (report.counts[k], report.bytes[k]) for k in report.counts if k[1] in dims}
    assert seen == expected
    return report


@pytest.mark.timeout(60)  # the bound for 1024 simulated ranks (about 5 s here)
def test_dry_run_1024_ranks_fsdp_7b_ac_bf16_matches_planner():
    plan = PlanConfig(
        world_size=1024,
        activation_checkpointing=True,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    report = _check_against_planner(LLAMA_7B, plan)
    # 32 blocks + the root: each block gathered in forward and again in backward
    assert report.counts == {("all_gather", "dp_shard"): 65, ("reduce_scatter", "dp_shard"): 33}
    assert report.mesh_shape == {"dp_shard": 1024}


@pytest.mark.timeout(60)
def test_dry_run_1024_ranks_hsdp_tp_matches_planner_and_ledger():
    """HSDP 4 x 32 over tensor parallelism of 8: shard sizes, FSDP's collectives and the
    tensor-parallel ones (the ledger's TransformerTP) all as predicted."""
    plan = PlanConfig(world_size=1024, tp=8, dp_replicate=4)
    # the last rank: its shards are the short ones where rows do not divide
    report = _check_against_planner(LLAMA_7B, plan, rank=1023)
    assert report.mesh_shape == {"dp_replicate": 4, "dp_shard": 32, "tp": 8}
    assert report.counts[("all_reduce", "dp_replicate")] == 33
    assert report.counts[("all_gather", "tp")] == 2 + 32 * 6 + 3


def test_dry_run_uneven_shards_on_the_last_rank():
    """Rows that do not divide by the shard size: the last rank's shards are smaller, and
    the planner's rank-0 sizes are not what it holds; the planner's row sizes still are."""
    cfg = GPTConfig(vocab_size=1000, dim=96, n_layers=2, n_heads=4, max_seq_len=32)
    first = dry_run(lambda: GPT(cfg), world_size=64, rank=0)
    last = dry_run(lambda: GPT(cfg), world_size=64, rank=63)
    assert last.shard_numel["root"] < first.shard_numel["root"]
    assert first.bytes == last.bytes  # every rank contributes a padded row


def test_dry_run_refuses_an_initialized_process():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            dry_run(lambda: GPT(GPTConfig()), world_size=8)
    finally:
        dist.destroy_process_group()


def test_mesh_for_names_the_dims_parallelize_transformer_takes():
    assert mesh_for(64) == ((64,), ("dp_shard",))
    assert mesh_for(1024, tp=8, dp_replicate=4) == ((4, 32, 8), ("dp_replicate", "dp_shard", "tp"))
    with pytest.raises(ValueError, match="not divisible"):
        mesh_for(100, tp=8)


def test_fake_world_gets_fake_subgroups():
    """A mesh over the fake default group builds fake subgroups (a gloo group cannot be
    built over the fake store), as PyTorch's DeviceMesh does with the default backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from device_mesh import init_device_mesh
    from device_mesh.groups import simulated_world

    assert not simulated_world()
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        assert simulated_world()
        mesh = init_device_mesh("cpu", (4, 4), mesh_dim_names=("dp", "tp"))
        assert mesh.get_coordinate() == (1, 1)
        for dim in ("dp", "tp"):
            group = mesh[dim].get_group()
            assert dist.get_backend(group) == "fake"
            assert dist.get_process_group_ranks(group) == mesh[dim].ranks_along(0)
    finally:
        dist.destroy_process_group()


def test_meta_parameters_gather_on_meta():
    """[Note: dry run on meta] a group still on meta at the first forward computes there:
    its unsharded parameters are meta tensors of the full shape."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from device_mesh import init_device_mesh
    from fsdp2 import fully_shard

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (8,))
        with torch.device("meta"):
            lin = torch.nn.Linear(16, 12)
        fully_shard(lin, mesh=mesh)
        assert lin.weight.to_local().shape == (2, 16)
        seen = []
        lin.register_forward_hook(lambda m, a, o: seen.append(m.weight))
        lin(torch.zeros(3, 16, device="meta")).sum().backward()
        assert seen[0].device.type == "meta" and seen[0].shape == (12, 16)
        assert lin.weight.grad.to_local().shape == (2, 16)
    finally:
        dist.destroy_process_group()


SWEEP = [
    (cfg, PlanConfig(world_size=ws, tp=tp, dp_replicate=rep, activation_checkpointing=ac))
    for cfg in (LLAMA_7B, LLAMA_70B)
    for ws in (64, 256, 1024)
    for tp, rep, ac in ((1, 1, False), (8, 1, True), (8, 2, False))
]


@pytest.mark.skipif(
    not os.environ.get("FSDP2_DRY_RUN_SWEEP"), reason="opt-in: FSDP2_DRY_RUN_SWEEP=1"
)
@pytest.mark.parametrize("cfg,plan", SWEEP, ids=[f"{c.dim}-{p.describe()}" for c, p in SWEEP])
def test_dry_run_sweep(cfg, plan):
    _check_against_planner(cfg, plan)


def test_gathered_inputs_regathered_on_meta_as_in_a_real_run():
    """[Note: regather in backward] on meta tensors: the gathered inputs are saved as their
    shards and gathered again in backward, as on real ones (every meta address is 0, so
    they are told apart by storage), and the counts equal the ledger's TransformerTP."""
    from fsdp2.tools.comm_model import TransformerTP

    cfg = GPTConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, max_seq_len=16, fused_qkv=False)
    report = dry_run(lambda: GPT(cfg), world_size=8, tp=2, tp_plan=tp_plan(), seq_len=16)
    expected = TransformerTP(n_layers=2, batch=1, seq=16, dim=64, vocab=512, tp_size=2)
    tp = {k: (report.counts[k], report.bytes[k]) for k in report.counts if k[1] == "tp"}
    assert tp == expected.by_mesh_dim()
    assert tp[("all_gather", "tp")][0] == 17  # 5 of them the backward's re-gathers
