"""auto_parallelize and AutoPlan (fsdp2/auto/): a plan applied with the library's own calls
builds the structure it describes (groups of several blocks, the last group kept after
forward, one checkpointed block, bf16 compute), ``calls()`` replays it on a fresh model,
it round-trips through JSON, trains like one process, and the proofs catch a tampered plan:
the in-process shard check on every rank together, the dry run at 64 simulated ranks.

The GPT has awkward sizes (vocabulary 67, width 48, 3 blocks): on 2 ranks the embedding's
rows do not divide, so rank 1's shards are shorter than rank 0's, which is all the planner
predicts.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig, gpt_loss
from fsdp2.auto import AutoPlan, PlanMismatchError, auto_parallelize, compare_report, verify_plan
from fsdp2.auto._apply import is_checkpointed
from fsdp2.auto._render import module_expr
from fsdp2.tools.planner import CPU, PlanConfig, estimate, profile_model
from tests.harness import run_on_ranks

CFG = GPTConfig(vocab_size=67, dim=48, n_layers=3, n_heads=4, max_seq_len=16)
SEQ = 8
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build_meta_gpt() -> GPT:
    """The test GPT (importable by name: the dry run's fresh process builds it)."""
    return GPT(CFG)


def _plan(world_size: int = 2, **over) -> AutoPlan:
    """A hand-made plan: blocks 0-1 share one fully_shard call, the last group keeps its
    parameters after forward, block 0 is checkpointed, bf16 compute."""
    with torch.device("meta"):
        model = GPT(CFG)
    profile = profile_model(model, seq_len=SEQ)
    kw = dict(blocks_per_group=2, keep_last_groups=1, checkpointed_blocks=(0,), batch_size=2)
    cfg = PlanConfig(world_size=world_size, **{**kw, **BF16, **over})
    est = estimate(profile, cfg, CPU)
    return AutoPlan.from_estimate(est, profile, budget=1 << 30, margin=0.25, considered=[est])


def _structure(model) -> list[tuple]:
    """Every module: its FQN, whether it is an FSDPModule, which fully_shard call (by order
    of appearance), that call's reshard_after_forward, whether it is checkpointed."""
    from fsdp2 import FSDPModule

    calls: dict[int, int] = {}
    out = []
    for name, m in model.named_modules():
        state = m.__dict__.get("_fsdp_state")
        call = None if state is None else calls.setdefault(id(state), len(calls))
        raf = None if state is None or state.group is None else state.group.reshard_after_forward
        out.append((name, isinstance(m, FSDPModule), call, raf, is_checkpointed(m)))
    return out


# --------------------------------------------------------------------------- the plan object
def test_plan_reads_round_trips_and_renders_its_calls():
    plan = _plan()
    assert [(g.name, g.modules, g.reshard_after_forward) for g in plan.groups] == [
        ("root", ("",), None),
        ("blocks[0-1]", ("blocks.0", "blocks.1"), True),
        ("blocks[2]", ("blocks.2",), False),
    ]
    assert plan.checkpointed == ("blocks.0",)
    assert (plan.mesh_shape, plan.mesh_dim_names) == ((2,), ("dp_shard",))
    assert plan.global_batch == 4 and plan.batch_size == 2
    # rank 0 holds 34 of the 67 embedding rows, rank 1 33: the planner's numbers are rank 0's
    assert plan.shard_numel_for(0) == {g.name: g.shard_numel for g in plan.groups}
    assert plan.shard_numel_for(1)["root"] < plan.shard_numel_for(0)["root"]
    assert AutoPlan.from_json(plan.to_json()) == plan
    text = str(plan)
    for piece in ("blocks[0-1]", "blocks.0, blocks.1", "param bf16, reduce fp32", "budget"):
        assert piece in text, (piece, text)
    mp = "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    assert plan.calls()[-4:] == [
        "checkpoint(model.blocks[0])",
        "fully_shard([model.blocks[0], model.blocks[1]], "
        f'mesh=mesh["dp_shard"], reshard_after_forward=True, {mp})',
        f'fully_shard(model.blocks[2], mesh=mesh["dp_shard"], reshard_after_forward=False, {mp})',
        f'fully_shard(model, mesh=mesh["dp_shard"], {mp})',
    ]
    assert module_expr("model.layers.10") == "model.model.layers[10]"
    assert module_expr("h.0.attn-x") == "model.get_submodule('h.0.attn-x')"
    with pytest.raises(ValueError, match="format"):
        AutoPlan.from_json('{"format": "something else"}')
    with pytest.raises(ValueError, match="not JSON"):
        AutoPlan.from_json("{")


# --------------------------------------------------------------------------- apply, 2 ranks
def _apply_replay_and_train() -> None:
    from device_mesh import init_device_mesh

    plan = _plan()
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    fresh = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    plan.apply(model, mesh)
    assert model.auto_plan is plan
    got = {name: (fsdp, call, raf, ac) for name, fsdp, call, raf, ac in _structure(model)}
    # one call for blocks 0 and 1 (the same state), one for block 2, one for the root
    assert got[""][:2] == (True, 0)  # named_modules lists the root first
    assert got["blocks.0"][:3] == got["blocks.1"][:3] == (True, 1, True)
    assert got["blocks.2"][:3] == (True, 2, False)
    assert [n for n, v in got.items() if v[3]] == ["blocks.0"]
    assert [n for n, v in got.items() if v[0]] == ["", "blocks.0", "blocks.1", "blocks.2"]
    # the calls as source, executed on a fresh copy, build the same structure
    exec("\n".join(plan.calls()), {"model": fresh, "mesh": mesh})  # noqa: S102 - the test's point
    assert _structure(fresh) == _structure(model)
    # one step matches one process over the whole batch (bf16 compute: a loose bound)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, CFG.vocab_size, (plan.global_batch, SEQ), generator=g)
    y = torch.randint(0, CFG.vocab_size, (plan.global_batch, SEQ), generator=g)
    rows = slice(dist.get_rank() * plan.batch_size, (dist.get_rank() + 1) * plan.batch_size)
    losses = []
    for m, xs, ys in ((model, x[rows], y[rows]), (ref, x, y)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        loss = gpt_loss(m, xs, ys)
        loss.backward()
        opt.step()
        losses.append(loss.detach().float())
    dist.all_reduce(losses[0])
    torch.testing.assert_close(losses[0] / 2, losses[1], rtol=1e-2, atol=0)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=0, atol=2e-3, msg=n)


def test_apply_builds_the_plan_replays_and_trains_like_one_process():
    run_on_ranks(2, _apply_replay_and_train)


def _tampered_plan_raises_on_every_rank() -> None:
    from device_mesh import init_device_mesh

    plan = _plan()
    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    # rank 1 only: a rank-0 shard size one element off (rank 0 finds nothing wrong itself)
    if dist.get_rank() == 1:
        g = plan.groups[1]
        plan.groups[1] = dataclasses.replace(g, shard_numel=g.shard_numel + 1)
    torch.manual_seed(0)
    with pytest.raises(PlanMismatchError, match=r"rank\(s\) \[1\]") as info:
        plan.apply(GPT(CFG), mesh)
    if dist.get_rank() == 1:
        assert "blocks[0-1]" in info.value.mismatches[0]
    else:
        assert info.value.mismatches == []
    # a plan whose groups swapped blocks 1 and 2 (equal sizes): the parameters are not where
    # the plan says
    plan = _plan()
    g = plan.groups[2]
    plan.groups[2] = dataclasses.replace(g, modules=("blocks.1",))
    plan.groups[1] = dataclasses.replace(plan.groups[1], modules=("blocks.0", "blocks.2"))
    with pytest.raises(PlanMismatchError, match="differing: .'blocks.1.attn"):
        plan.apply(GPT(CFG), mesh)


def test_in_process_check_catches_a_tampered_plan_on_every_rank():
    run_on_ranks(2, _tampered_plan_raises_on_every_rank)


# --------------------------------------------------------------------------- dry run, 64 ranks
def test_verify_plan_at_64_simulated_ranks_and_a_tampered_count():
    plan = _plan(world_size=64, batch_size=1)
    check = verify_plan(plan, _build_meta_gpt, world_size=64)
    assert check.ok, check.summary()
    assert [r.rank for r in check.reports] == [0, 63]
    assert check.reports[0].shard_numel == plan.shard_numel_for(0)
    assert check.reports[1].shard_numel == plan.shard_numel_for(63)
    assert check.reports[1].shard_numel["root"] < check.reports[0].shard_numel["root"]
    # one all-gather too many in the plan: the same dry run no longer agrees
    key = ("all_gather", "dp_shard")
    count, nbytes = plan.collectives[key]
    tampered = dataclasses.replace(plan, collectives={**plan.collectives, key: (count + 1, nbytes)})
    mismatches = compare_report(tampered, check.reports[0])
    assert mismatches == [
        f"rank 0: all_gather on 'dp_shard': issued {count} call(s), {nbytes:,} bytes, "
        f"planned {count + 1} call(s), {nbytes:,} bytes"
    ]
    bad = verify_plan(tampered, "tests.test_auto_plan:_build_meta_gpt", ranks=[0])
    assert not bad.ok
    with pytest.raises(PlanMismatchError, match="all_gather"):
        bad.raise_if_failed()
    with pytest.raises(ValueError, match="laid out for 64 ranks"):
        verify_plan(plan, _build_meta_gpt, world_size=1024)


# --------------------------------------------------------------------------- auto_parallelize
class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _auto_end_to_end(dry_run: bool) -> None:
    from fsdp2.auto import check_layout

    with torch.device("meta"):
        model = GPT(CFG)
    plan = auto_parallelize(
        model, 2, memory_budget="1GiB", batch=4, seq_len=SEQ, tp_plan={}, dry_run=dry_run
    )
    assert model.auto_plan is plan and plan.world_size == 2 and plan.global_batch == 4
    assert plan.budget == 1 << 30 and plan.predicted_peak * (1 + plan.margin) <= plan.budget
    assert plan.alternatives and plan.alternatives[0].describe
    from device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    assert check_layout(plan, model, mesh) == []
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handler = _Warnings()
    log = logging.getLogger("fsdp2.auto")
    log.addHandler(handler)
    plan.predicted_peak = 1  # far below anything real: the check must warn, once
    try:
        g = torch.Generator().manual_seed(dist.get_rank())
        for step in range(4):
            x = torch.randint(0, CFG.vocab_size, (plan.batch_size, SEQ), generator=g)
            gpt_loss(model, x, x).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                assert plan.measured_peak is None  # the first step has no optimizer state
    finally:
        log.removeHandler(handler)
    assert plan.measured_peak and plan.measured_peak > 100_000, plan.measured_peak
    assert len(handler.messages) == 1 and "predicted" in handler.messages[0], handler.messages


def _auto_on_a_mesh_named_dp() -> None:
    from device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = GPT(CFG)  # on the CPU: its values are sharded as they are
    plan = auto_parallelize(model, mesh, memory_budget=1 << 30, batch=2, seq_len=SEQ,
                            tp_plan={}, dry_run=False, check_first_step=False)  # fmt: skip
    assert plan.mesh_dim_names == ("dp",) and plan.batch_size == 1
    assert {dim for _, dim in plan.collectives} == {"dp"}
    assert all('mesh=mesh["dp"]' in line for line in plan.calls() if "fully_shard(" in line)
    with pytest.raises(ValueError, match="not divisible by the mesh's 2 data-parallel ranks"):
        auto_parallelize(GPT(CFG), mesh, memory_budget="1GiB", batch=3, seq_len=SEQ)


def test_auto_parallelize_applies_proves_and_checks_the_first_step():
    run_on_ranks(2, _auto_end_to_end, dry_run=True)
    run_on_ranks(2, _auto_on_a_mesh_named_dp)


def test_auto_parallelize_rejects_bad_input_before_any_collective():
    with torch.device("meta"):
        model = GPT(CFG)
    kw = dict(memory_budget="1GiB", batch=4, seq_len=SEQ)
    cases = [
        (dict(memory_budget=True), TypeError, "memory_budget"),
        (dict(memory_budget="lots"), ValueError, "lots"),
        (dict(batch=0), ValueError, "batch must be a positive int"),
        (dict(seq_len=2.5), ValueError, "seq_len"),
        (dict(margin=-0.1), ValueError, "margin"),
        (dict(optimizer="adam"), ValueError, "optimizer"),
        (dict(hardware="H100"), TypeError, "hardware"),
        (dict(dry_run="yes"), TypeError, "dry_run"),
        (dict(build_model=lambda: GPT(CFG)), ValueError, "cannot be imported by name"),
    ]
    for over, err, match in cases:
        with pytest.raises(err, match=match):
            auto_parallelize(model, 2, **{**kw, **over})
    with pytest.raises(TypeError, match="mesh_or_world"):
        auto_parallelize(model, "2", **kw)
    with pytest.raises(ValueError, match="default process group initialized"):
        auto_parallelize(model, 2, **kw)
    assert not dist.is_initialized()


def test_a_model_defined_in_main_needs_a_builder():
    from fsdp2.auto._proof import model_payload

    class Local(torch.nn.Linear):
        pass

    Local.__module__ = "__main__"
    with torch.device("meta"):
        model = torch.nn.Sequential(Local(4, 4))
    with pytest.raises(ValueError, match=r"build_model='package.module:function'"):
        model_payload(model)
    with torch.device("meta"):
        assert len(model_payload(GPT(CFG))) < 1 << 20  # a meta copy: no data
