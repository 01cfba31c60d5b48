"""The communication ledger and the analytic expectation of a step's collectives.

* Pure maths (no process group): padded sizes with awkward shapes, the per-group rules of
  ``fully_shard`` (reshard after forward True / False / int, mixed precision, frozen and
  trivial groups, HSDP, gradient accumulation), the tensor-parallel table's shape, errors.
* On ranks: for FSDP (2 ranks; a vocabulary of 67 and 3 position rows, so dim 0 does not
  divide by the world size; reshard after forward None / True / False / 2, bf16,
  accumulation, clipping), HSDP (2x2) and FSDP + TP (2x2, with and without loss_parallel),
  the ledger's counts and bytes per (kind, mesh dim) equal ``CommDebugMode``'s and the
  expectation exactly, step after step; a deliberately wrong expectation is flagged and
  logged; PyTorch's FSDP2 on the same model issues the same number of collectives of each
  kind under PyTorch's own ``CommDebugMode`` (which counts ops, not bytes or mesh dims).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

from device_mesh import init_device_mesh
from dtensor.debug import CollectiveRecord, CommDebugMode
from dtensor.parallel import loss_parallel
from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan
from fsdp2 import MixedPrecisionPolicy, fully_shard, parallelize_transformer
from fsdp2.tools import (
    CommLedger,
    GroupSpec,
    ParamSpec,
    TransformerTP,
    expected_step_comms,
    format_ledger,
    groups_of,
)
from fsdp2.tools.comm_model import fsdp_group_comms, summarize
from fsdp2.tools.ledger import compare
from tests.harness import run_on_ranks

VOCAB, BATCH, SEQ = 67, 2, 4
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# ------------------------------------------------------------------------------ pure maths
def test_padded_numel_follows_torch_chunk_with_padding():
    assert ParamSpec((7, 3)).padded_numel(2) == 4 * 3  # chunks 4 + 3, padded to 4 rows
    assert ParamSpec((3, 5)).padded_numel(4) == 1 * 5  # one rank gets no rows
    assert ParamSpec((1,)).padded_numel(2) == 1  # a 1-element bias
    assert ParamSpec((0, 4)).padded_numel(2) == 0
    assert ParamSpec((4, 7), shard_dim=1).padded_numel(2) == 4 * 4  # 7 columns -> 4 per rank


def _kinds(records):
    return [(r.kind, r.mesh_dim, r.group_size, r.bytes, r.phase) for r in records]


def test_fully_shard_group_rules():
    params = [ParamSpec((7, 3)), ParamSpec((7,))]  # padded row: 4*3 + 4 = 16 elements
    g = GroupSpec(params, shard_size=2, mesh_dim="dp")
    ag, rs = ("all_gather", "dp", 2, 16 * 4), ("reduce_scatter", "dp", 2, 2 * (16 + 2) * 4)
    assert _kinds(fsdp_group_comms(g)) == [(*ag, "forward"), (*ag, "backward"), (*rs, "backward")]
    kept = GroupSpec(params, shard_size=2, mesh_dim="dp", reshard_after_forward=False)
    assert _kinds(fsdp_group_comms(kept)) == [(*ag, "forward"), (*rs, "backward")]
    # an int k: backward gathers the kept rows (4 / 2 = 2 of them) within groups of 2
    g4 = GroupSpec(params, shard_size=4, mesh_dim="dp", reshard_after_forward=2)
    row4 = (2 * 3 + 2) * 4
    assert _kinds(fsdp_group_comms(g4))[:2] == [
        ("all_gather", "dp", 4, row4, "forward"),
        ("all_gather", "dp", 2, 2 * row4, "backward"),
    ]
    # bf16 gathers half the bytes; the reduction runs in reduce_dtype (fp32)
    mp = GroupSpec(params, shard_size=2, mesh_dim="dp", param_dtype=torch.bfloat16)
    assert [r.bytes for r in fsdp_group_comms(mp)] == [32, 32, 2 * 18 * 2]
    mp32 = GroupSpec(params, 2, "dp", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert [r.bytes for r in fsdp_group_comms(mp32)] == [32, 32, 2 * 18 * 4]
    # a frozen parameter adds to the gather, not to the reduction
    frozen = GroupSpec([ParamSpec((7, 3)), ParamSpec((7,), requires_grad=False)], 2, "dp")
    assert fsdp_group_comms(frozen)[-1].bytes == 2 * (12 + 1) * 4
    all_frozen = GroupSpec([ParamSpec((7,), requires_grad=False)], 2, "dp")
    assert [r.kind for r in fsdp_group_comms(all_frozen)] == ["all_gather", "all_gather"]
    # one rank, no cast: nothing moves; with a cast the gather still runs
    assert fsdp_group_comms(GroupSpec(params, shard_size=1)) == []
    assert len(fsdp_group_comms(GroupSpec(params, 1, param_dtype=torch.bfloat16))) == 3
    # HSDP: the reduced row is all-reduced over the replicate dim
    hsdp = GroupSpec(params, 2, "shard", replicate_size=3, replicate_mesh_dim="rep")
    assert _kinds(fsdp_group_comms(hsdp))[-1] == ("all_reduce", "rep", 3, 18 * 4, "backward")
    # accumulation: gathers per micro-batch, one reduction unless told to sync each time
    three = fsdp_group_comms(g, micro_batches=3)
    assert [r.kind for r in three].count("all_gather") == 6
    assert [r.kind for r in three].count("reduce_scatter") == 1
    each = fsdp_group_comms(g, micro_batches=3, sync_every_micro_batch=True)
    assert [r.kind for r in each].count("reduce_scatter") == 3


def test_mixed_dtype_group_aligns_slots_on_the_staged_route():
    g = GroupSpec([ParamSpec((6,), torch.bfloat16), ParamSpec((4,))], shard_size=2)
    # bf16 3 elements = 6 bytes -> 8; fp32 2 elements = 8 bytes
    assert g.gather_row_bytes() == 16
    big = GroupSpec([ParamSpec((1 << 20,), torch.bfloat16), ParamSpec((1 << 19,))], 2)
    assert big.gather_row_bytes() == (1 << 19) * 2 + (1 << 18) * 4  # direct: unaligned


def test_tensor_parallel_table_shape():
    base = dict(n_layers=3, batch=2, seq=8, dim=16, vocab=50, tp_size=4)
    tp = TransformerTP(**base).by_mesh_dim()
    # forward: 2 embeddings + 2 per block; backward: head + 2 per block
    assert tp[("reduce_scatter", "tp")][0] == 2 + 2 * 3 + 1 + 2 * 3
    lp = TransformerTP(**base, loss_parallel=True).by_mesh_dim()
    assert lp[("all_gather", "tp")][0] == tp[("all_gather", "tp")][0] - 1  # no logits gather
    assert lp[("all_reduce", "tp")][0] == tp[("all_reduce", "tp")][0] + 4
    plain = TransformerTP(**base, regather_in_backward=False).by_mesh_dim()
    assert plain[("all_gather", "tp")][0] == tp[("all_gather", "tp")][0] - (2 * 3 + 1)
    assert TransformerTP(**{**base, "tp_size": 1}).comms() == []


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="expected_step_comms: micro_batches"):
        expected_step_comms([], micro_batches=0)
    with pytest.raises(TypeError, match="CommLedger: expected must be"):
        CommLedger(expected=5)
    with pytest.raises(ValueError, match="groups_of: model has no fully_shard"):
        groups_of(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="TransformerTP: tp_size"):
        TransformerTP(n_layers=1, batch=1, seq=1, dim=1, vocab=1, tp_size=0)


def test_compare_flags_every_differing_row():
    exp = expected_step_comms([GroupSpec([ParamSpec((4,))], shard_size=2, mesh_dim="dp")])
    ran = [CollectiveRecord("all_gather", "dp", 2, 8), CollectiveRecord("all_reduce", "x", 2, 4)]
    entry = compare(ran, exp)
    assert entry.ok is False
    bad = {(r.kind, r.count, r.expected_count) for r in entry.mismatches}
    assert bad == {("all_gather", 1, 2), ("all_reduce", 1, 0), ("reduce_scatter", 0, 1)}
    assert compare(ran, None).ok is None
    assert "NO" in format_ledger(entry)


# ------------------------------------------------------------------------------ on ranks
def _cfg(**kw) -> GPTConfig:
    # vocab 67 and 3 position rows do not divide by 2 or 4; dim 30 gives odd head widths
    base = dict(vocab_size=VOCAB, dim=30, n_layers=2, n_heads=3, max_seq_len=SEQ - 1)
    base.update(kw)
    return GPTConfig(**base)


def _batch(step: int, seq: int = SEQ - 1):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return tuple(torch.randint(0, VOCAB, (BATCH, seq), generator=g) for _ in range(2))


def _check_steps(model, ledger: CommLedger, step_fn, steps: int = 2) -> None:
    """Run ``steps`` steps inside the ledger and an outer CommDebugMode; every step's
    ledger rows must equal the mode's and the expectation's, counts and bytes."""
    for step in range(steps):
        with CommDebugMode() as mode, ledger.step():
            step_fn(step)
        entry = ledger.last
        assert entry.ok is True, format_ledger(entry)
        seen = summarize(mode.records)
        assert entry.counts() == seen, (entry.counts(), seen)
        expected = ledger._expectation().by_mesh_dim()
        assert seen == expected, (seen, expected)
        assert all(r.kind in ("all_gather", "reduce_scatter", "all_reduce") for r in mode.records)


def _fsdp(reshard_after_forward, mp: bool, clip: bool, micro: int) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = GPT(_cfg())
    policy = BF16 if mp else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ledger = CommLedger(
        lambda: expected_step_comms(model, micro_batches=micro, clip_grad_norm=clip)
    )

    def step(i):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            x, y = _batch(10 * i + m)
            gpt_loss(model, x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    _check_steps(model, ledger, step)
    # the root keeps its parameters after forward unless told otherwise (as PyTorch's)
    flags = [g.reshard_after_forward for g in groups_of(model)]
    want = reshard_after_forward is not False
    assert flags == [reshard_after_forward is True, want, want], flags


@pytest.mark.parametrize(
    "reshard_after_forward,mp,clip,micro",
    [
        (None, False, False, 1),
        (True, False, True, 1),
        (False, True, False, 1),
        (None, True, True, 2),
    ],
    ids=["default", "reshard-clip", "keep-bf16", "bf16-clip-accumulate2"],
)
def test_fsdp_ledger_matches_comm_debug_mode_and_expectation(
    reshard_after_forward, mp, clip, micro
):
    run_on_ranks(
        2, _fsdp, reshard_after_forward=reshard_after_forward, mp=mp, clip=clip, micro=micro
    )


def _wrong_expectation_flagged() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = GPT(_cfg())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # claim the blocks keep their parameters: two all-gathers too few, same reductions
    wrong = [dataclasses.replace(g, reshard_after_forward=False) for g in groups_of(model)]
    ledger = CommLedger(expected_step_comms(wrong))
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("fsdp2.tools.ledger")
    logger.addHandler(handler)
    try:
        with ledger.step():
            x, y = _batch(0)
            gpt_loss(model, x, y).backward()
    finally:
        logger.removeHandler(handler)
    entry = ledger.last
    assert entry.ok is False
    (bad,) = entry.mismatches
    assert (bad.kind, bad.mesh_dim, bad.count, bad.expected_count) == ("all_gather", "dp", 5, 3)
    assert [r.levelno for r in seen] == [logging.WARNING]
    assert "all_gather over 'dp': 5" in seen[0].getMessage()


def test_wrong_expectation_is_flagged_and_logged():
    run_on_ranks(2, _wrong_expectation_flagged)


def _fsdp_int_reshard() -> None:
    model = GPT(_cfg())
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(model)
    ledger = CommLedger(model)  # mesh dims unnamed: recorded under index 0

    def step(i):
        x, y = _batch(i)
        gpt_loss(model, x, y).backward()

    _check_steps(model, ledger, step)
    sizes = sorted(r.group_size for r in ledger.last.records if r.kind == "all_gather")
    assert sizes == [2, 2, 4, 4, 4], sizes


def _layout_ledger(names, shape, loss_par: bool = False, mp: bool = False) -> None:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    tp_size = dict(zip(names, shape)).get("tp", 1)
    cfg = _cfg(dim=32, n_heads=4, max_seq_len=8, fused_qkv=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = {"tp_plan": tp_plan(loss_parallel=loss_par)} if tp_size > 1 else {}
    parallelize_transformer(model, mesh, mp_policy=BF16 if mp else None, **plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq = 6
    tp = None
    if tp_size > 1:
        tp = TransformerTP(
            n_layers=cfg.n_layers,
            batch=BATCH,
            seq=seq,
            dim=cfg.dim,
            vocab=cfg.vocab_size,
            tp_size=tp_size,
            dtype=torch.bfloat16 if mp else torch.float32,
            loss_parallel=loss_par,
        )
    ledger = CommLedger(expected_step_comms(model, tp=tp, clip_grad_norm=True))

    def step(i):
        x, y = _batch(i, seq)
        logits = model(x)
        if loss_par:
            with loss_parallel():
                F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        else:
            F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    _check_steps(model, ledger, step)


@pytest.mark.parametrize(
    "case",
    ["hsdp", "fsdp+tp", "fsdp+tp-loss-parallel", "fsdp+tp-bf16", "fsdp-reshard-int"],
)
def test_layouts_at_four_ranks(case):
    if case == "fsdp-reshard-int":
        run_on_ranks(4, _fsdp_int_reshard)
    elif case == "hsdp":
        run_on_ranks(4, _layout_ledger, names=("dp_replicate", "dp_shard"), shape=(2, 2))
    else:
        run_on_ranks(
            4,
            _layout_ledger,
            names=("dp", "tp"),
            shape=(2, 2),
            loss_par="loss-parallel" in case,
            mp="bf16" in case,
        )


# ------------------------------------------------------------------------------ PyTorch's view
_TORCH_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
}


def _torch_counts(mode: TorchCommDebugMode) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split("op='")[-1].rstrip("')").split(".")[-1]
        kind = _TORCH_KINDS[name]
        out[kind] = out.get(kind, 0) + n
    return out


def _against_torch(shape, reshard_after_forward) -> None:
    names = ("replicate", "shard")[-len(shape) :]
    x, y = _batch(0)
    counts = []
    for shard, mesh in (
        (fully_shard, init_device_mesh("cpu", shape, mesh_dim_names=names)),
        (torch_fully_shard, torch_init_device_mesh("cpu", shape, mesh_dim_names=names)),
    ):
        torch.manual_seed(0)
        model = GPT(_cfg())
        for block in model.blocks:
            shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        gpt_loss(model, x, y).backward()  # first step: lazy init
        if shard is fully_shard:
            expected = expected_step_comms(model).get_comm_counts()
            with CommDebugMode() as ours:
                gpt_loss(model, x, y).backward()
            counts.append(ours.get_comm_counts())
        else:
            with TorchCommDebugMode() as theirs:
                gpt_loss(model, x, y).backward()
            counts.append(_torch_counts(theirs))
    assert counts[0] == counts[1] == expected, (counts, expected)


@pytest.mark.parametrize(
    "shape,reshard_after_forward",
    [((2,), None), ((2,), True), ((2,), False), ((2, 2), None)],
    ids=["fsdp-default", "fsdp-reshard", "fsdp-keep", "hsdp"],
)
def test_counts_equal_pytorch_fsdp2_under_its_comm_debug_mode(shape, reshard_after_forward):
    ws = 4 if len(shape) == 2 else 2
    run_on_ranks(ws, _against_torch, shape=shape, reshard_after_forward=reshard_after_forward)
