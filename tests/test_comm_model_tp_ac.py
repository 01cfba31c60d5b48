"""Tensor parallelism under activation checkpointing: the analytic model
(``fsdp2.tools.comm_model.TransformerTP``, and ``planner.transformer_tp`` that builds it)
against what the library issues.

The reference is the dry run (``fsdp2.tools.dry_run``: the real library on PyTorch's fake
process group, collectives recorded by ``CommDebugMode``), run in pytest's own process as
``tests/test_dry_run.py`` does (each dry run creates and destroys its own fake default
group, so the process must not have initialized torch.distributed). One case runs a real
2-rank gloo world in the harness's workers.

Checkpointing some blocks only: the model builder wraps them with
``torch.distributed._composable.checkpoint`` itself (what ``parallelize_transformer`` does
to every block), and the dry run is asked for no checkpointing of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from examples.gpt import GPT, GPTConfig, tp_plan
from fsdp2 import MixedPrecisionPolicy
from fsdp2.tools.comm_model import TransformerTP
from fsdp2.tools.dry_run import dry_run
from fsdp2.tools.planner import PlanConfig, collectives, profile_model, transformer_tp
from tests.harness import run_on_ranks

SEQ, BATCH = 16, 2


def _gpt_cfg(n_layers: int, *, n_heads: int = 4, bias: bool = True) -> GPTConfig:
    return GPTConfig(
        vocab_size=512, dim=64, n_layers=n_layers, n_heads=n_heads, max_seq_len=SEQ,
        fused_qkv=False, bias=bias,
    )  # fmt: skip


def _plan(regather: bool = True) -> dict:
    plan = tp_plan()
    for style in plan.values():
        if hasattr(style, "regather_in_backward"):
            style.regather_in_backward = regather
    return plan


def _builder(cfg: GPTConfig, checkpointed=()):
    def build():
        from torch.distributed._composable import checkpoint

        model = GPT(cfg)
        for i in checkpointed:
            checkpoint(model.blocks[i])
        return model

    return build


def _tp_seen(report, dim: str = "tp") -> dict:
    return {k: (report.counts[k], report.bytes[k]) for k in report.counts if k[1] == dim}


def _dry_tp(cfg, *, world_size=4, tp=2, checkpointed=(), ac=False, regather=True, **kw):
    report = dry_run(
        _builder(cfg, checkpointed),
        world_size=world_size,
        tp=tp,
        tp_plan=_plan(regather),
        activation_checkpointing=ac,
        batch_size=BATCH,
        seq_len=SEQ,
        **kw,
    )
    assert not dist.is_initialized()
    return _tp_seen(report)


def _model(cfg: GPTConfig, tp: int = 2, **kw) -> TransformerTP:
    return TransformerTP(
        n_layers=cfg.n_layers, batch=BATCH, seq=SEQ, dim=cfg.dim, vocab=cfg.vocab_size,
        tp_size=tp, bias=cfg.bias, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("n_layers", [2, 3])
def test_every_block_checkpointed_by_the_recipe_matches_the_model(n_layers):
    """``parallelize_transformer(activation_checkpointing=True)``: per block, the
    recomputation re-issues attention's input all-gather, its output reduce-scatter and the
    MLP's input all-gather (it stops before the MLP's output reduce-scatter)."""
    cfg = _gpt_cfg(n_layers)
    seen = _dry_tp(cfg, ac=True)
    assert seen == _model(cfg, activation_checkpointing=True).by_mesh_dim()
    plain = _model(cfg).by_mesh_dim()
    shard, full = BATCH * SEQ // 2 * cfg.dim * 4, BATCH * SEQ * cfg.dim * 4
    ag, rs, ar = (("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_reduce", "tp"))
    assert seen[ag] == (plain[ag][0] + 2 * n_layers, plain[ag][1] + 2 * n_layers * shard)
    assert seen[rs] == (plain[rs][0] + n_layers, plain[rs][1] + n_layers * full)
    assert seen[ar] == plain[ar]  # no gradient reduction runs twice


@pytest.mark.parametrize(
    "n_layers,checkpointed", [(2, (0,)), (3, (1,)), (3, (0, 2))], ids=["2:0", "3:1", "3:0,2"]
)
def test_some_blocks_checkpointed_match_the_model(n_layers, checkpointed):
    cfg = _gpt_cfg(n_layers)
    seen = _dry_tp(cfg, checkpointed=checkpointed)
    assert seen == _model(cfg, checkpointed_blocks=checkpointed).by_mesh_dim()
    # the per-block count alone decides; which blocks does not matter
    assert seen == _model(cfg, checkpointed_blocks=tuple(range(len(checkpointed)))).by_mesh_dim()


def test_checkpointing_in_the_builder_equals_the_recipes():
    """The harness of the per-block tests (checkpoint applied before tensor parallelism)
    issues what the recipe's (after it) does."""
    cfg = _gpt_cfg(2)
    assert _dry_tp(cfg, checkpointed=(0, 1)) == _dry_tp(cfg, ac=True)


@pytest.mark.parametrize("bias", [True, False])
def test_without_regather_the_mlp_input_is_gathered_again(bias):
    """PyTorch's styles' behaviour (``regather_in_backward=False``): the recomputation
    re-issues what it does with the regather hooks (which hand checkpointing what they do
    not keep as shards): up to the output linear's input, the MLP's input all-gather
    included (its reduce-scatter is not)."""
    cfg = _gpt_cfg(3, bias=bias)
    seen = _dry_tp(cfg, checkpointed=(0, 2), regather=False)
    model = _model(cfg, checkpointed_blocks=(0, 2), regather_in_backward=False)
    assert seen == model.by_mesh_dim()
    plain = _model(cfg, regather_in_backward=False).by_mesh_dim()
    assert seen[("all_gather", "tp")][0] == plain[("all_gather", "tp")][0] + 2 * 2
    assert seen[("reduce_scatter", "tp")][0] == plain[("reduce_scatter", "tp")][0] + 2


def test_early_stop_off_recomputes_the_whole_block():
    cfg = _gpt_cfg(2)
    with torch_checkpoint.set_checkpoint_early_stop(False):
        seen = _dry_tp(cfg, checkpointed=(1,))
    assert seen == _model(cfg, checkpointed_blocks=(1,), checkpoint_early_stop=False).by_mesh_dim()
    plain = _model(cfg).by_mesh_dim()
    assert seen[("all_gather", "tp")][0] == plain[("all_gather", "tp")][0] + 2
    assert seen[("reduce_scatter", "tp")][0] == plain[("reduce_scatter", "tp")][0] + 2


@dataclass(frozen=True)
class _PerBlockPlan(PlanConfig):
    """``PlanConfig`` with the per-block field ``transformer_tp`` reads when it is there."""

    checkpointed_blocks: tuple[int, ...] | None = None


def test_planner_at_64_ranks_tp8_bf16_matches_the_dry_run():
    """64 simulated ranks, FSDP 8 x TP 8, bf16 compute, every block checkpointed: the
    planner's tensor-parallel rows (``transformer_tp``) are what the library issued; naming
    two of the three blocks gives the per-block count."""
    cfg = _gpt_cfg(3, n_heads=8)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen_all = _dry_tp(cfg, world_size=64, tp=8, ac=True, mp_policy=bf16)
    seen_two = _dry_tp(cfg, world_size=64, tp=8, checkpointed=(0, 2), mp_policy=bf16)
    with torch.device("meta"):
        model = GPT(cfg)
    profile = profile_model(model, seq_len=SEQ, tp_plan=tp_plan())
    plan = PlanConfig(
        world_size=64, tp=8, activation_checkpointing=True, param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32, batch_size=BATCH,
    )  # fmt: skip
    assert transformer_tp(profile, plan).checkpointed == {0, 1, 2}
    predicted = {k: v for k, v in collectives(profile, plan).items() if k[1] == "tp"}
    assert predicted == seen_all
    per_block = _PerBlockPlan(**{**plan.__dict__, "checkpointed_blocks": (0, 2)})
    assert transformer_tp(profile, per_block).by_mesh_dim() == seen_two
    off = _PerBlockPlan(**{**plan.__dict__, "checkpointed_blocks": ()})  # overrides the flag
    assert transformer_tp(profile, off).by_mesh_dim() == _dry_tp(
        cfg, world_size=64, tp=8, mp_policy=bf16
    )


def _real_tp_counts(n_layers: int, checkpointed, regather: bool) -> None:
    """On each rank of a real gloo world: the tensor-parallel collectives of one forward
    and backward equal the model's."""
    from torch.distributed._composable import checkpoint

    from device_mesh import init_device_mesh
    from dtensor.debug import CommDebugMode
    from dtensor.parallel import parallelize_module

    cfg = _gpt_cfg(n_layers)
    torch.manual_seed(0)
    model = GPT(cfg)
    parallelize_module(
        model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), _plan(regather)
    )
    for i in checkpointed:
        checkpoint(model.blocks[i])
    idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    with CommDebugMode() as comm:
        model(idx).float().sum().backward()
    seen: dict = {}
    for r in comm.records:
        count, nbytes = seen.get((r.kind, r.mesh_dim), (0, 0))
        seen[(r.kind, r.mesh_dim)] = (count + 1, nbytes + r.bytes)
    expected = _model(cfg, checkpointed_blocks=checkpointed, regather_in_backward=regather)
    assert seen == expected.by_mesh_dim()


def test_real_two_rank_world_matches_the_model():
    run_on_ranks(2, _real_tp_counts, n_layers=3, checkpointed=(1,), regather=True)
    run_on_ranks(2, _real_tp_counts, n_layers=2, checkpointed=(0, 1), regather=False)


def test_model_arguments():
    cfg = _gpt_cfg(3)
    assert _model(cfg).checkpointed == frozenset()
    assert _model(cfg, activation_checkpointing=True).checkpointed == {0, 1, 2}
    some = _model(cfg, activation_checkpointing=True, checkpointed_blocks=[2, 0, 2])
    assert some.checkpointed_blocks == (0, 2) and some.checkpointed == {0, 2}
    hash(some)  # a list given is kept as a tuple: the model stays hashable
    for bad in ((3,), (-1,), (True,), (0.0,)):
        with pytest.raises(ValueError, match="TransformerTP: checkpointed_blocks must be"):
            _model(cfg, checkpointed_blocks=bad)
    assert _model(cfg, tp=1, activation_checkpointing=True).comms() == []
