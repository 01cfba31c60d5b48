"""auto_parallelize, end to end, on the cases its search exists for. Each budget is derived
from the planner's own predictions so that the decision is the case's; the plan is applied
on a real gloo world of 1, 2 and 4 ranks, trained with AdamW, and its measured peak must be
within the budget by the memory tracker (live tensor bytes) and by the resident set; then
the same case is planned at 64 and 1,024 ranks (and at 1-4) and a dry run of the plan on
the fake process group must agree with it (``verify_plan``).

The cases (the search's margin is given explicitly: ``MARGIN``, the CPU preset's 60%):

* ``ac``: a budget one byte below the smallest layout without checkpointing: some blocks
  checkpointed, not all (and one block fewer would not fit that layout);
* ``keep_last``: the budget of the smallest layout that keeps only the last group's
  parameters after forward, below every layout keeping all: ``reshard_after_forward=True``
  on all but the last group (2 and 4 ranks: on one nothing is gathered, so every reshard
  mode predicts the same peak and no budget tells them apart);
* ``bf16``: a budget one byte below every fp32 layout, checkpointing included: bf16
  parameters (at one rank with 8 sequences: there nothing is sharded, and bf16 compute adds
  a bf16 copy of the parameters to the fp32 ones, which only halving the activations of 8
  sequences outweighs; one sequence a rank elsewhere);
* ``tp``: half a sequence a rank (activations dominate), which FSDP alone cannot hold (no
  layout of FSDP alone divides the batch) and TP 2 splits over two ranks; the budget of the
  smallest TP 2 layout without checkpointing, exactly; where TP 4 also fits, it is predicted
  slower. (At one sequence a rank and 2 ranks, TP 2's smallest layout is smaller than FSDP
  alone's without checkpointing, but at its budget FSDP with checkpointing fits too and the
  CPU preset, which charges each tensor-parallel collective a latency, predicts it faster:
  TP 2 beats FSDP alone on this preset only where FSDP alone cannot split the batch.)
* ``tied_lora``: the GPT with its embedding tied to its head, LoRA adapters on a frozen base
  and a root with parameters of its own (the tied embedding, which trains, a frozen
  position embedding and the final norm), at the budget of the fastest layout (no slack);
  the frozen parameters must not move and every trained one must;
* ``llama``: a Hugging Face Llama from a config (grouped-query attention, its own
  tensor-parallel plan offered), at the budget of the fastest layout;
* ``offload``: the H100 preset (its own margins: 35%, 55% under offload), a budget one byte
  below every layout on the device. CPU offload on a CPU device is no saving (the
  parameters are on the host already; the CPU preset never offloads), so the memory of
  this case was measured on an H100 by the lead, not here: here the plan is proved by dry
  run at every world size, and (``TEST_ALL``) applied by ``auto_parallelize(...,
  hardware=H100)`` on the gloo world and trained, without a memory check.

Each real run trains the case twice in the same processes ([Note: two runs]): the first
measures the live tensor bytes - this test's ``MemoryTracker`` over the model and the
optimizer for one steady-state step (the third: optimizer state present, forward to
``zero_grad``), and with ``TEST_ALL`` the library's first-step check of the second - the
second, untracked, the resident set: its high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) over planning, materializing and three steps, minus the resident
set right before the model is built. Rank 0's numbers are printed (``pytest -s``); every
rank must fit.

The resident set grows more than the live bytes (glibc keeps the heap a step frees): the
CPU preset holds a layout to 1.6 times its live peak plus 8 MiB, fitted on these runs and on
``benchmarks/auto_plan_bench.py``'s (a LoRA GPT of 9.8 MiB live grew 19.1 MiB at one rank;
runs vary by up to 8 MiB). A run over it fails with ``ResidentSetOverBudget``.

``make test`` runs ``DEFAULT_REAL`` on real ranks and ``DEFAULT_DRY`` by dry run;
``TEST_ALL=1`` every case at every world size, the real runs with ``auto_parallelize``'s own
dry run in a fresh process.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.gpt import GPT, GPTConfig, gpt_loss
from fsdp2.auto import AutoPlan, auto_parallelize, verify_plan
from fsdp2.tools.planner import CPU, H100, peak_bytes, profile_model
from fsdp2.tools.search import NothingFitsError, default_margin, search_layouts
from tests.harness import run_on_ranks

FULL = os.environ.get("TEST_ALL") == "1"
MiB = 1 << 20
#: The margin every CPU case is held to, explicitly: the CPU preset's allowance for the
#: resident set over the live tensor bytes (``allocator_factor - 1``: 0.6, so a layout fits
#: when ``peak * 1.6 <= budget``).
MARGIN = default_margin(CPU)

# --------------------------------------------------------------------------------- models
#: Activations dominate: 4 blocks of width 128 over 256 tokens (separate q/k/v: the
#: tensor-parallel plan splits them by heads).
ACT = GPTConfig(vocab_size=509, dim=128, n_layers=4, n_heads=4, max_seq_len=256,
                fused_qkv=False)  # fmt: skip
#: Tied embedding and head, LoRA adapters of rank 8 on q, v and the MLP's first projection.
LORA = GPTConfig(vocab_size=509, dim=128, n_layers=3, n_heads=4, max_seq_len=256,
                 tie_weights=True, fused_qkv=False)  # fmt: skip
LORA_RANK = 8
LLAMA = dict(vocab_size=211, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
#: Parameters dominate (the offload case): 4 blocks of width 256 over 32 tokens.
WIDE = GPTConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=4, max_seq_len=32)


class LoRALinear(nn.Module):
    """A frozen ``base`` Linear plus a trained low-rank update ``x A^T B^T``."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def build_act_gpt() -> GPT:
    return GPT(ACT)


def build_wide_gpt() -> GPT:
    return GPT(WIDE)


def build_lora_gpt() -> GPT:
    """The LoRA GPT: every block's weights frozen but the adapters; at the root the tied
    embedding (and so the head) and the final norm train, the position embedding does not."""
    model = GPT(LORA)
    for block in model.blocks:
        block.attn.q = LoRALinear(block.attn.q, LORA_RANK)
        block.attn.v = LoRALinear(block.attn.v, LORA_RANK)
        block.mlp.fc = LoRALinear(block.mlp.fc, LORA_RANK)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or name.startswith(("tok_emb", "ln_f")))
    return model


def build_llama() -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    return AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA))


def _init_llama(model: nn.Module) -> None:
    """Values for a Llama materialized with ``to_empty`` (sharded parameters included):
    norms one, weights N(0, 0.02), and the rotary frequencies recomputed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        for m in model.modules():
            if hasattr(m, "compute_default_rope_parameters") and hasattr(m, "inv_freq"):
                inv_freq, _ = m.compute_default_rope_parameters(m.config)
                m.inv_freq.copy_(inv_freq)
                m.original_inv_freq.copy_(inv_freq)


# --------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One case: the model (a builder of this module, importable by the dry run's fresh
    process), its vocabulary, tokens per sequence, whether the tensor-parallel plan is
    offered (``tp_plan_for(model)``, else none), the real world sizes and the hardware
    preset (``"cpu"`` or ``"h100"``)."""

    name: str
    builder: str
    vocab: int
    seq_len: int
    tp: bool
    worlds: tuple[int, ...]
    hardware: str = "cpu"

    def global_batch(self, world: int) -> int:
        """Sequences a step over all ranks: one a rank, but for ``tp`` half a sequence a
        rank, and for ``bf16`` at one rank 8 (the module docstring)."""
        if self.name == "tp":
            return max(world // 2, 1)
        if self.name == "bf16" and world == 1:
            return 8
        return world

    @property
    def build(self):
        return globals()[self.builder]

    @property
    def build_model(self) -> str:
        return f"{__name__}:{self.builder}"

    @property
    def hw(self):
        return H100 if self.hardware == "h100" else CPU

    def margin(self, world: int) -> float | None:
        """``MARGIN`` on the CPU. The offload case keeps the H100 preset's own (None) up to
        4 ranks; at 64 ranks and more no budget forces offload at those margins (the host
        takes 1/64 or less of the parameters' state, so the offloaded layout's peak times
        1.55 exceeds the device layout's times 1.35), so there it is planned with none."""
        if self.hardware != "h100":
            return MARGIN
        return None if world < 64 else 0.0


CASES = {
    c.name: c
    for c in (
        Case("ac", "build_act_gpt", ACT.vocab_size, 256, False, (1, 2, 4)),
        Case("keep_last", "build_act_gpt", ACT.vocab_size, 256, False, (2, 4)),
        Case("bf16", "build_act_gpt", ACT.vocab_size, 256, False, (1, 2, 4)),
        Case("tp", "build_act_gpt", ACT.vocab_size, 256, True, (2, 4)),
        Case("tied_lora", "build_lora_gpt", LORA.vocab_size, 256, False, (1, 2, 4)),
        Case("llama", "build_llama", LLAMA["vocab_size"], 256, True, (1, 2, 4)),
        Case("offload", "build_wide_gpt", WIDE.vocab_size, 32, False, (1, 2, 4), "h100"),
    )
}
#: ``make test``: these on real ranks, and these by dry run (TEST_ALL: everything).
DEFAULT_REAL = (("ac", 2), ("keep_last", 2), ("bf16", 2), ("tp", 2), ("tied_lora", 2),
                ("llama", 2))  # fmt: skip
DEFAULT_DRY = (("ac", 64), ("ac", 1024), ("tp", 64), ("tp", 1024), ("offload", 2))


class ResidentSetOverBudget(AssertionError):
    """The resident set grew past the budget (the other checks held)."""


@cache
def _profile(name: str):
    case = CASES[name]
    with torch.device("meta"):
        model = case.build()
    tp_plan = None
    if case.tp:
        from fsdp2.plan import tp_plan_for

        tp_plan = tp_plan_for(model)
    return profile_model(model, seq_len=case.seq_len, tp_plan=tp_plan)


def _search(case: Case, world: int, budget: int, **kw):
    return search_layouts(
        _profile(case.name),
        world,
        budget,
        hardware=case.hw,
        global_batch=case.global_batch(world),
        margin=case.margin(world),
        **kw,
    )


def _need(peak: float, margin: float, hw=CPU) -> int:
    """The smallest budget a layout of predicted ``peak`` fits: ``peak * (1 + margin)`` and
    the hardware's allocator overhead ([Note: fitting with a margin])."""
    return math.ceil(peak * (1 + margin) + hw.allocator_overhead)


def budget_for(name: str, world: int) -> int:
    """The per-rank budget that makes the decision at ``world`` ranks the case's, from the
    planner's predictions (the search's own estimates, at the same margin)."""
    case = CASES[name]
    roomy = _search(case, world, 1 << 50)  # every layout, none checkpointed
    m = roomy.margin
    if name == "ac":  # one byte below the smallest layout without checkpointing
        return _need(min(e.peak_bytes for e in roomy.considered), m, case.hw) - 1
    if name == "keep_last":  # the smallest layout keeping the last group, exactly
        keep = [e for e in roomy.considered if e.config.keep_last_groups == 1]
        return _need(min(e.peak_bytes for e in keep), m, case.hw)
    if name == "bf16":  # one byte below every fp32 layout, checkpointing included
        with pytest.raises(NothingFitsError) as fp32:
            _search(case, world, 1, param_dtypes=(None,))
        return _need(fp32.value.smallest.peak_bytes, m, case.hw) - 1
    if name == "tp":  # the smallest layout of TP 2 without checkpointing, exactly
        tp2 = [e for e in roomy.considered if e.config.tp == 2]
        return _need(min(e.peak_bytes for e in tp2), m, case.hw)
    if name == "offload":  # one byte below every layout on the device
        with pytest.raises(NothingFitsError) as device:
            _search(case, world, 1, offload=False)
        return _need(device.value.smallest.peak_bytes, device.value.margin, case.hw) - 1
    return _need(roomy.best.peak_bytes, m, case.hw)  # the fastest layout, with no slack


def plan_at(name: str, world: int) -> AutoPlan:
    """The plan ``auto_parallelize`` chooses for the case at ``world`` ranks."""
    budget = budget_for(name, world)
    result = _search(CASES[name], world, budget)
    return AutoPlan.from_estimate(
        result.best,
        _profile(name),
        budget=budget,
        margin=result.margin,
        considered=result.considered,
    )


def check_decision(name: str, plan: AutoPlan) -> None:
    """The plan has the property its case is about."""
    cfg, n = plan.config, len(plan.blocks)
    what = cfg.describe()
    if name == "ac":
        assert 1 <= len(plan.checkpointed) < n, what
    elif name == "keep_last":
        raf = [g.reshard_after_forward for g in plan.groups if not g.is_root]
        assert (cfg.reshard_after_forward, cfg.keep_last_groups) == (True, 1), what
        assert len(raf) > 1 and raf == [True] * (len(raf) - 1) + [False], (what, raf)
        assert not plan.checkpointed, what
    elif name == "bf16":
        assert cfg.param_dtype == torch.bfloat16 and cfg.reduce_dtype == torch.float32, what
    elif name == "tp":
        assert plan.tp == 2 and not plan.checkpointed, what
    elif name == "offload":
        assert cfg.offload and cfg.param_dtype == torch.bfloat16, what


def _decision_is_the_cases(name: str, world: int) -> AutoPlan:
    """``plan_at``, with the budget checked to sit where the case says."""
    case = CASES[name]
    plan = plan_at(name, world)
    check_decision(name, plan)
    budget, m = plan.budget, plan.margin
    assert _need(plan.predicted_peak, m, case.hw) <= budget
    if name == "ac":  # one block fewer checkpointed does not fit this layout
        fewer = replace(plan.config, checkpointed_blocks=plan.config.checkpointed_blocks[:-1])
        assert _need(peak_bytes(_profile(name), fewer, case.hw), m, case.hw) > budget
    if name == "tp":  # FSDP alone cannot split the batch; TP 4, where it fits, is slower
        result = _search(case, world, budget)
        assert all(e.config.tp > 1 for e in result.considered), world
        assert all(plan.step_s < e.step_s for e in result.fits if e.config.tp == 4)
    return plan


# --------------------------------------------------------------------------------- real ranks
def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _baseline() -> int:
    """The resident set right now, with freed heap memory handed back to the kernel, and
    the high-water mark reset to it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _rss_kib("VmRSS") * 1024


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _fingerprint(p: torch.Tensor) -> tuple[float, float]:
    """This rank's shard of ``p``, summarized (a copy would count in the resident set)."""
    t = _local(p).detach().double()
    return float(t.sum()), float(t.square().sum())


def _loss(name: str, model, x):
    if name == "llama":
        return model(input_ids=x, labels=x).loss
    return gpt_loss(model, x[:, :-1], x[:, 1:])


def _laid_out(name: str, world: int, budget: int, *, check_first_step: bool, dry_run: bool):
    """The case's model, planned and laid out by ``auto_parallelize``, and initialized."""
    case = CASES[name]
    with torch.device("meta"):
        model = case.build()
    plan = auto_parallelize(
        model,
        world,
        memory_budget=budget,
        batch=case.global_batch(world),
        seq_len=case.seq_len,
        tp_plan=None if case.tp else {},
        hardware=case.hw,
        margin=case.margin(world),
        dry_run=dry_run,
        check_first_step=check_first_step,
        build_model=case.build_model,
    )
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    if name == "llama":
        _init_llama(model)
    else:
        model.reset_parameters()
    return model, plan


def _steps(name: str, model, plan, steps: int, tracked: int | None = None):
    """``steps`` AdamW steps on one fixed batch per data-parallel rank (the ranks of a
    tensor-parallel group feed the same one); the losses, and a tracker of step ``tracked``
    (forward to ``zero_grad``)."""
    from fsdp2.tools import MemoryTracker

    case = CASES[name]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(dist.get_rank() // plan.tp)
    x = torch.randint(0, case.vocab, (plan.batch_size, case.seq_len + (name != "llama")),
                      generator=g)  # fmt: skip
    losses, tracker = [], MemoryTracker(model, opt)
    for step in range(steps):
        if step == tracked:
            tracker.__enter__()
        loss = _loss(name, model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == tracked:
            tracker.__exit__(None, None, None)
        losses.append(loss.detach().float())
    return losses, tracker


def _train_case(name: str, world: int, budget: int, expect: str, first_step: bool,
                dry_run: bool, out: str) -> None:  # fmt: skip
    """On every rank: plan, lay out and train the case twice ([Note: two runs]).

    [Note: two runs] The first run measures the live tensor bytes (the trackers) and warms
    the process up: what it loads or builds once (code pages, the kernels' caches and
    scratch space for these shapes, lazily built tables) is not the training state's. The
    second, untracked, measures the resident set from right before its model is built,
    after a collection and ``malloc_trim``: the budget is for the training state
    (parameters, gradients, optimizer state, activations, communication buffers), and the
    growth is everything this run adds at its peak - those, the batch, the autograd graph,
    the planning, and the heap the allocator keeps.
    """
    rank = dist.get_rank()
    gc.collect()  # an earlier test's model in a reference cycle: its workspaces would count
    model, plan = _laid_out(name, world, budget, check_first_step=first_step, dry_run=dry_run)
    assert plan.config.describe() == expect, (plan.config.describe(), expect)
    check_decision(name, plan)
    # step 1: the library's first-step check (when on); step 2: this test's tracker
    _, tracker = _steps(name, model, plan, 3, tracked=2)
    first_peak = plan.measured_peak
    del model, plan
    tracked = tracker.peak, {k: v for k, v in tracker.by_category("peak").items() if v}
    del tracker  # it refers to the first run's model
    rss0 = _baseline()
    model, plan = _laid_out(name, world, budget, check_first_step=False, dry_run=False)
    params = dict(model.named_parameters())
    before = {n: _fingerprint(p) for n, p in params.items()}
    losses, _ = _steps(name, model, plan, 3)
    rss_growth = _rss_kib("VmHWM") * 1024 - rss0
    mean = torch.stack(losses)
    dist.all_reduce(mean)
    changed = {n: _fingerprint(p) != before[n] for n, p in params.items()}
    result = dict(
        case=name, world=world, rank=rank, budget=budget, plan=plan.config.describe(),
        predicted=plan.predicted_peak, tracker=tracked[0], tracker_by=tracked[1],
        first_step=first_peak, rss_growth=rss_growth, losses=(mean / world).tolist(),
        changed=sorted(n for n, c in changed.items() if c),
        unchanged=sorted(n for n, c in changed.items() if not c),
        requires_grad=sorted(n for n, p in params.items() if p.requires_grad),
    )  # fmt: skip
    Path(out, f"{name}-{world}-{rank}.json").write_text(json.dumps(result))


def _judge(name: str, world: int, out: Path) -> None:
    rows = [json.loads(out.joinpath(f"{name}-{world}-{r}.json").read_text()) for r in range(world)]
    _report(rows[0])
    over = []
    for r in rows:
        losses = r["losses"]
        assert all(math.isfinite(v) for v in losses) and losses[0] > losses[1] > losses[2], r
        if name == "tied_lora":
            assert r["changed"] == r["requires_grad"], r  # every trained one moved, no other
            assert {"tok_emb.weight", "ln_f.weight"} <= set(r["changed"]), r
            assert "pos_emb.weight" in r["unchanged"], r
            assert any(n.endswith(".base.weight") for n in r["unchanged"]), r
        if CASES[name].hardware != "cpu":
            continue  # a GPU's budget: on the CPU offloading saves nothing (module docstring)
        tag = f"{name} at {world} rank(s), rank {r['rank']} ({r['plan']}): " + ", ".join(
            f"{k} {r[k]:,}" for k in ("budget", "predicted", "tracker", "first_step", "rss_growth")
            if r[k] is not None
        )  # fmt: skip
        assert r["tracker"] <= r["budget"], tag
        if r["first_step"] is not None:  # the library's check of step 1, where it was on
            assert r["first_step"] <= r["budget"], tag
        if r["rss_growth"] > r["budget"]:
            over.append(tag)
    if over:
        raise ResidentSetOverBudget("resident set over the budget:\n" + "\n".join(over))


def _report(r: dict) -> None:
    """One line of the case's numbers on rank 0 (``pytest -s`` shows them)."""
    mib = {k: (r[k] or 0) / MiB for k in ("budget", "predicted", "tracker", "first_step",
                                          "rss_growth")}  # fmt: skip
    print(
        f"\nCASE {r['case']:>9} x{r['world']}: {r['plan']:<25} budget {mib['budget']:6.2f} MiB,"
        f" predicted {mib['predicted']:6.2f}, tracker {mib['tracker']:6.2f}, first step "
        f"{mib['first_step']:6.2f}, RSS growth {mib['rss_growth']:6.2f}; loss "
        f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}\n      tracker at its peak (MiB): "
        + ", ".join(f"{k} {v / MiB:.2f}" for k, v in r["tracker_by"].items())
    )


def _real_runs():
    out = []
    for name, case in CASES.items():
        for world in case.worlds:
            if not (FULL or (name, world) in DEFAULT_REAL):
                continue
            out.append(pytest.param(name, world, id=f"{name}-{world}"))
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
@pytest.mark.parametrize("name,world", _real_runs())
def test_plan_fits_when_trained_on_real_ranks(name, world, tmp_path):
    if name == "llama":
        pytest.importorskip("transformers")
    plan = _decision_is_the_cases(name, world)
    run_on_ranks(
        world,
        _train_case,
        name=name,
        world=world,
        budget=plan.budget,
        expect=plan.config.describe(),
        first_step=FULL,
        dry_run=FULL,
        out=str(tmp_path),
    )
    _judge(name, world, tmp_path)


# --------------------------------------------------------------------------------- dry runs
def _dry_runs():
    out = []
    for name, case in CASES.items():
        for world in (*case.worlds, 64, 1024):
            if not (FULL or (name, world) in DEFAULT_DRY):
                continue
            out.append(pytest.param(name, world, id=f"{name}-{world}"))
    return out


@pytest.mark.parametrize("name,world", _dry_runs())
def test_dry_run_agrees_with_the_plan(name, world):
    if name == "llama":
        pytest.importorskip("transformers")
    plan = _decision_is_the_cases(name, world)
    check = verify_plan(plan, CASES[name].build_model, world_size=world)
    assert [r.rank for r in check.reports] == sorted({0, world - 1})
    check.raise_if_failed()
