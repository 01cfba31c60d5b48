"""auto_parallelize and AutoPlan (fsdp2/auto/): a plan applied with the library's own calls
builds the structure it describes (groups of several blocks, the last group kept after
forward, one checkpointed block, bf16 compute), ``calls()`` replays it on a fresh model,
it round-trips through JSON, trains like one process, and the proofs catch a tampered plan:
the in-process shard check on every rank together, the dry run at 64 simulated ranks and
at tensor parallelism 2 with an uneven vocabulary (counts compared at every rank, bytes
where they are rank 0's). ``auto_parallelize`` checks its input, fails on every rank
together (a rank whose budget fits nothing), and sends ``forward_fn`` to the dry run.

The GPT has awkward sizes (vocabulary 67, width 48, 3 blocks): on 2 ranks the embedding's
rows do not divide, so rank 1's shards are shorter than rank 0's, which is all the planner
predicts.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import sys

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig, gpt_loss
from fsdp2.auto import (
    AutoPlan,
    NothingFitsError,
    PlanCheck,
    PlanMismatchError,
    auto_parallelize,
    compare_report,
    verify_plan,
)
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


def _next_token_loss(model, idx):
    """A ``forward_fn`` the dry run's fresh process imports by name."""
    return gpt_loss(model, idx, idx)


class _TupleGPT(GPT):
    """A model whose output is a tuple: the dry run's default loss cannot read it."""

    def forward(self, idx):
        logits = super().forward(idx)
        return logits, logits.float().mean()


def _tuple_loss(model, idx):
    logits, aux = model(idx)
    return logits.float().sum() + aux


def _build_tuple_gpt() -> _TupleGPT:
    return _TupleGPT(CFG)


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
    assert module_expr("blocks.0.in") == "model.get_submodule('blocks.0.in')"  # a keyword
    # the data-parallel rows of each rank: without tensor parallelism, its own
    assert [plan.data_parallel_rank(r) for r in range(2)] == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="data_parallel_rank: rank must be an int in"):
        plan.data_parallel_rank(2)
    # notes round trip; a file of the earlier format names an alternative's label "describe"
    noted = dataclasses.replace(plan, notes=["the dry run compared no collectives"])
    assert AutoPlan.from_json(noted.to_json()) == noted and "note  " in str(noted)
    old = json.loads(plan.to_json())
    for a in old["alternatives"]:
        a["describe"] = a.pop("layout")
    assert AutoPlan.from_dict(old) == plan
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


#: vocabulary 65 at tp 2: 33 and 32 rows, sharded 17 + 16 and 16 + 16: the last rank's
#: padded collectives are smaller than rank 0's
CFG_TP = dataclasses.replace(CFG, vocab_size=65, n_layers=2, fused_qkv=False)


def _build_meta_gpt_tp() -> GPT:
    return GPT(CFG_TP)


def test_verify_plan_with_uneven_tensor_parallel_shards_compares_counts_everywhere():
    from examples.gpt import tp_plan

    with torch.device("meta"):
        model = GPT(CFG_TP)
    profile = profile_model(model, seq_len=SEQ, tp_plan=tp_plan())
    est = estimate(profile, PlanConfig(world_size=4, tp=2, batch_size=1), CPU)
    plan = AutoPlan.from_estimate(est, profile)
    assert (plan.mesh_shape, plan.mesh_dim_names) == ((2, 2), ("dp_shard", "tp"))
    # a tp group feeds the same rows
    assert [plan.data_parallel_rank(r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    hook = sys.excepthook
    check = verify_plan(plan, _build_meta_gpt_tp)
    assert sys.excepthook is hook  # not wrapped by each simulated init_process_group
    assert check.ok, check.summary()
    first, last = check.reports
    assert last.rank == 3 and last.bytes != first.bytes and last.counts == first.counts
    assert "bytes compared at simulated rank(s) [0], counts only at [3]" in check.summary()
    # a count off: caught at the rank whose bytes are not compared too
    key = ("all_gather", "dp_shard")
    count, nbytes = plan.collectives[key]
    tampered = dataclasses.replace(plan, collectives={**plan.collectives, key: (count + 1, nbytes)})
    assert compare_report(tampered, last) == [
        f"rank 3: all_gather on 'dp_shard': issued {count} call(s), planned {count + 1} "
        "(counts only: this rank's bytes are not rank 0's)"
    ]


def test_the_dry_run_gets_forward_fn_or_says_what_it_did_not_compare(tmp_path):
    from fsdp2.auto.__main__ import main
    from fsdp2.auto._entry import _dry_run_loss
    from fsdp2.auto._proof import loss_payload

    with torch.device("meta"):
        model = _TupleGPT(CFG)
    profile = profile_model(model, seq_len=SEQ, forward_fn=_tuple_loss)
    plan = AutoPlan.from_estimate(estimate(profile, PlanConfig(world_size=2), CPU), profile)
    # importable by name; a partial of it pickles; a lambda does neither
    assert loss_payload(_tuple_loss) == {"loss_fn": "tests.test_auto_plan:_tuple_loss"}
    assert "loss_fn_bytes" in loss_payload(functools.partial(_tuple_loss))
    assert loss_payload(lambda m, idx: m(idx)[0].sum()) is None
    # a lambda: the default loss where the output has logits, else no collectives compared
    gpt = _dry_run_loss(GPT(CFG).to("meta"), lambda m, idx: m(idx).sum(), SEQ)
    assert gpt["collectives"] and "used the sum of the logits" in gpt["note"]
    tup = _dry_run_loss(model, lambda m, idx: m(idx)[0].sum(), SEQ)
    assert not tup["collectives"] and "compared no collectives" in tup["note"]
    # what the fresh process runs: the loss by name; or no step at all
    for extra, note in (({"loss_fn": "tests.test_auto_plan:_tuple_loss"}, "groups, 2 collective"),
                        ({"collectives": False}, "collectives not compared")):  # fmt: skip
        payload, out = tmp_path / "payload.pt", tmp_path / "verdict.json"
        torch.save({"plan": plan.to_json(), "build_model": "tests.test_auto_plan:_build_tuple_gpt",
                    **extra}, payload)  # fmt: skip
        assert main(["--payload", str(payload), "--json", str(out)]) == 0
        assert note in PlanCheck.from_dict(json.loads(out.read_text())).summary()
    with pytest.raises(SystemExit) as info:
        main(["--plan", str(tmp_path / "missing.json"), "--build-model", "examples.gpt:GPT"])
    assert info.value.code == 2


def test_dry_run_timeout_and_the_tools_do_not_import_auto(monkeypatch):
    import ast
    import importlib

    from fsdp2.auto._proof import dry_run_timeout

    dry_run = importlib.import_module("fsdp2.tools.dry_run")

    monkeypatch.delenv("FSDP2_DRY_RUN_TIMEOUT_S", raising=False)
    assert dry_run_timeout() == 240.0  # below NCCL's default process-group timeout (600 s)
    monkeypatch.setenv("FSDP2_DRY_RUN_TIMEOUT_S", "30")
    assert dry_run_timeout() == 30.0
    monkeypatch.setenv("FSDP2_DRY_RUN_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="FSDP2_DRY_RUN_TIMEOUT_S='soon'"):
        dry_run_timeout()
    with open(dry_run.__file__) as f:
        tree = ast.parse(f.read())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m and m.startswith("fsdp2.auto")], imported
    assert issubclass(NothingFitsError, ValueError)


def test_first_step_check_on_cuda_leaves_the_peak_counters_unless_a_peak_hides_the_step(
    monkeypatch,
):
    """Faked CUDA counters: the window's peak is read without a reset when it is the
    largest yet; when an earlier peak hides it, the next step is measured after a reset."""
    from fsdp2.auto._first_step import FirstStepCheck

    counter = {"peak": 5000, "resets": 0}

    def reset():
        counter["resets"] += 1
        counter["peak"] = 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: counter["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    for earlier, expect_resets in ((5000, 0), (10**9, 1)):
        counter.update(peak=earlier, resets=0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plan = dataclasses.replace(_plan(), predicted_peak=7000)
        check = FirstStepCheck(plan, model, "cuda")
        for step in range(4):
            model(torch.ones(2, 4)).sum().backward()
            # the step's own peak: the first has no optimizer state yet
            counter["peak"] = max(counter["peak"], 6000 if step == 0 else 7000)
            opt.step()
            opt.zero_grad()
        assert (check.state, plan.measured_peak, counter["resets"]) == ("done", 7000, expect_resets)


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
    # forward_fn importable by name: the dry run's fresh process steps with it
    plan = auto_parallelize(model, 2, memory_budget=float(1 << 30), batch=4, seq_len=SEQ,
                            tp_plan={}, dry_run=dry_run, forward_fn=_next_token_loss)  # fmt: skip
    assert model.auto_plan is plan and plan.world_size == 2 and plan.global_batch == 4
    assert plan.budget == 1 << 30 and plan.predicted_peak * (1 + plan.margin) <= plan.budget
    assert plan.alternatives and plan.alternatives[0].layout and plan.notes == []
    assert tuple(plan.mesh.shape) == plan.mesh_shape  # the mesh it built, for the user
    assert plan.data_parallel_rank() == (dist.get_rank(), 2)
    assert check_layout(plan, model, plan.mesh) == []
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
    assert plan.first_step_check.state == "done"


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
    replicas = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    with pytest.raises(ValueError, match="replicates over 2 ranks but shards over 1"):
        auto_parallelize(GPT(CFG), replicas, memory_budget="1GiB", batch=2, seq_len=SEQ)
    # one rank fails (its budget fits nothing; its argument is bad): every rank raises,
    # before any group is created, the others naming it
    rank = dist.get_rank()
    kw = dict(batch=2, seq_len=SEQ, tp_plan={}, dry_run=False, check_first_step=False)
    with torch.device("meta"):
        model = GPT(CFG)
    for budget, err in (("1KiB", NothingFitsError), ("lots", ValueError)):
        expect = err if rank == 1 else PlanMismatchError
        with pytest.raises(expect) as info:
            auto_parallelize(model, 2, memory_budget=budget if rank == 1 else "1GiB", **kw)
        if rank == 0:
            assert "rank(s) [1] failed" in str(info.value) and err.__name__ in str(info.value)


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
        (dict(memory_budget=1.5), ValueError, "not a whole number of bytes"),
        (dict(seq_len=CFG.max_seq_len + 1), ValueError, "longer than the model's max_seq_len"),
        (dict(param_dtypes="bf16"), TypeError, "param_dtypes must be a list"),
        (dict(param_dtypes=[torch.int8]), ValueError, "param_dtypes entry torch.int8"),
        (dict(offload="yes"), ValueError, "offload must be True, False or 'last-resort'"),
        (dict(blocks=[torch.nn.Linear(2, 2)]), ValueError, r"blocks\[0\] \(Linear\) is not a"),
        (dict(blocks=model.blocks[0]), TypeError, "blocks must be a list of modules"),
        # valid (a float budget of whole bytes, blocks as a generator): the world is next
        (dict(memory_budget=1e9, blocks=iter(model.blocks)), ValueError, "process group"),
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
