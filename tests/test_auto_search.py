"""The layout search (``fsdp2.tools.search``): each knob is chosen when the budget needs it
and not before. Budgets are derived from the planner's own predictions, so each test pins
the decision, not a number of bytes."""

from dataclasses import replace

import pytest
import torch

from examples.gpt import GPT, GPTConfig, tp_plan
from fsdp2.tools.planner import CPU, H100, PlanConfig, estimate, peak_bytes, profile_model
from fsdp2.tools.search import NothingFitsError, host_bytes, search_layouts

MiB = 1 << 20
#: The CPU preset without the allocator's fixed overhead: with ``margin=0.0`` a budget equal
#: to a predicted peak then fits exactly, so each test pins a decision by the peaks alone.
CPU = replace(CPU, allocator_overhead=0)


@pytest.fixture(scope="module")
def gpt():
    """Activations dominate: 4 blocks of width 128 over 256 tokens, vocabulary 509."""
    cfg = GPTConfig(vocab_size=509, dim=128, n_layers=4, n_heads=4, max_seq_len=256,
                    fused_qkv=False)  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg)
    return profile_model(model, seq_len=256, tp_plan=tp_plan())


def _search(profile, world, budget, **kw):
    kw.setdefault("hardware", CPU)
    return search_layouts(profile, world, budget, global_batch=4, margin=0.0, **kw)


def test_checkpoints_only_as_many_blocks_as_the_budget_needs(gpt):
    one = PlanConfig(world_size=2, batch_size=2, checkpointed_blocks=(0,))
    budget = peak_bytes(gpt, one, CPU)
    assert budget < peak_bytes(gpt, replace(one, checkpointed_blocks=()), CPU)
    best = _search(gpt, 2, budget, tp_degrees=(1,)).best
    blocks = best.config.checkpointed(4)
    assert 1 <= len(blocks) < 4, best.config.describe()
    assert best.peak_bytes <= budget and best.config.param_dtype is None


def test_keeps_the_last_group_gathered_when_keeping_all_does_not_fit(gpt):
    base = PlanConfig(world_size=2, batch_size=2, checkpointed_blocks=())
    keep_last = peak_bytes(gpt, replace(base, keep_last_groups=1), CPU)
    keep_all = peak_bytes(gpt, replace(base, reshard_after_forward=False), CPU)
    assert keep_last < keep_all
    best = _search(gpt, 2, keep_last, tp_degrees=(1,)).best
    cfg = best.config
    assert (cfg.reshard_after_forward, cfg.keep_last_groups) == (True, 1), cfg.describe()
    assert not cfg.checkpointed(4)
    # keeping a group saves its backward all-gather: predicted faster than resharding all
    everything = estimate(gpt, replace(base, checkpointed_blocks=()), CPU)
    assert best.step_s < everything.step_s


def test_bf16_parameters_only_when_no_fp32_layout_fits(gpt):
    with pytest.raises(NothingFitsError) as fp32:
        _search(gpt, 4, 1, tp_degrees=(1,), param_dtypes=(None,))
    budget = fp32.value.smallest.peak_bytes - 1
    result = _search(gpt, 4, budget, tp_degrees=(1,))
    assert result.best.config.param_dtype == torch.bfloat16 and result.tier == "bf16"
    assert result.best.config.reduce_dtype == torch.float32
    roomy = _search(gpt, 4, 2 * budget, tp_degrees=(1,))
    assert roomy.best.config.param_dtype is None and roomy.tier == ""


def test_cpu_offload_is_the_last_resort_on_a_gpu(gpt):
    with pytest.raises(NothingFitsError) as on_device:
        _search(gpt, 2, 1, hardware=H100, tp_degrees=(1,), offload=False)
    smallest = on_device.value.smallest
    assert "CPU offload" in str(on_device.value) and "the host holds" in str(on_device.value)
    result = _search(gpt, 2, smallest.peak_bytes - 1, hardware=H100, tp_degrees=(1,))
    assert result.best.config.offload and result.tier == "offload"
    assert host_bytes(result.best) > 0
    # on a CPU there is nothing to offload to: the search says nothing fits instead
    with pytest.raises(NothingFitsError):
        _search(gpt, 2, 1, tp_degrees=(1,))


def test_tensor_parallel_when_a_rank_cannot_hold_a_whole_sequence():
    """Tensor parallelism (sequence parallel between blocks) gives each rank the same
    tokens' worth of activations as FSDP does at the same global batch; what it adds is
    splitting one sequence over ranks. With 2 long sequences a step on 4 ranks, FSDP alone
    would need half a sequence a rank: TP 2 x FSDP 2 holds it without checkpointing."""
    cfg = GPTConfig(vocab_size=509, dim=128, n_layers=4, n_heads=4, max_seq_len=512,
                    fused_qkv=False)  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg)
    profile = profile_model(model, seq_len=512, tp_plan=tp_plan())
    tp2 = PlanConfig(world_size=4, tp=2, batch_size=1, checkpointed_blocks=())
    budget = peak_bytes(profile, tp2, CPU)
    result = search_layouts(profile, 4, budget, hardware=CPU, global_batch=2, margin=0.0)
    best = result.best.config
    assert best.tp == 2 and not best.checkpointed(4), best.describe()
    assert {e.config.tp for e in result.considered} == {2, 4}  # no FSDP-alone layout
    # at one sequence a rank (global batch 4), TP saves no activation memory over FSDP
    fsdp = estimate(profile, PlanConfig(world_size=4, batch_size=1), CPU)
    tp = estimate(profile, PlanConfig(world_size=4, tp=2, batch_size=2), CPU)
    assert tp.categories["activations"] >= 0.9 * fsdp.categories["activations"]


def test_equally_fast_layouts_prefer_less_memory(gpt):
    result = _search(gpt, 2, 1 << 40, tp_degrees=(1,))
    for a, b in zip(result.fits, result.fits[1:]):
        if f"{a.step_s:.4g}" == f"{b.step_s:.4g}":
            assert a.peak_bytes <= b.peak_bytes


def test_nothing_fits_names_the_smallest_and_what_would_fit(gpt):
    with pytest.raises(NothingFitsError) as err:
        _search(gpt, 2, 4 * MiB, tp_degrees=(1,))
    e = err.value
    assert e.smallest.config.checkpointed(4) == frozenset(range(4))
    assert "smallest predicted peak" in str(e) and e.smallest.config.describe() in str(e)
    assert "activation checkpointing is already on in this layout" in e.advice


def test_frozen_tied_model_with_root_parameters():
    cfg = GPTConfig(vocab_size=67, dim=48, n_layers=3, n_heads=4, max_seq_len=64,
                    tie_weights=True, fused_qkv=False)  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg)
    for name, p in model.named_parameters():  # LoRA-style: only the norms train
        p.requires_grad_(".ln" in name or name.startswith("ln_f"))
    profile = profile_model(model, seq_len=64)
    names = [p.fqn for p in profile.params]
    # the tied embedding and head counted once, the root's own parameters in the root
    assert "tok_emb.weight" in names and "head.weight" not in names
    assert {p.fqn for p in profile.params if p.block is None} >= {"tok_emb.weight", "ln_f.bias"}
    best = search_layouts(profile, 3, 1 << 40, hardware=CPU, global_batch=3).best
    frozen = estimate(profile, best.config, CPU)
    trainable = sum(math_prod(p.shape) for p in profile.params if p.requires_grad)
    # AdamW state only for what trains: two fp32 tensors per trained element, sharded
    assert frozen.categories["optimizer_state"] < 4 * 2 * trainable


def math_prod(shape):
    out = 1
    for s in shape:
        out *= s
    return out


def test_hugging_face_llama_from_a_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=211, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    from fsdp2.plan._models import tp_plan_for

    profile = profile_model(model, seq_len=128, tp_plan=tp_plan_for(model))
    result = _search(profile, 4, 1 << 40)
    assert profile.n_blocks == 3 and result.best.config.world_size == 4
    # 4 heads but 2 key/value heads: tensor parallelism of 4 would split a key/value head
    assert {e.config.tp for e in result.considered} == {1, 2}


def test_cli_apply_check_dry_runs_the_chosen_plan():
    """``python -m fsdp2.plan --apply-check``: the search's plan, its calls, and a dry run at
    64 simulated ranks beside it (a fresh process: the dry run needs one without a group)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    argv = ["--model", "gpt", "--params", "1e8", "--world-size", "64", "--gpu-memory", "3GiB",
            "--seq-len", "1024", "--apply-check"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "fsdp2.plan", *argv],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "AutoPlan:" in out.stdout and "fully_shard(model" in out.stdout
    assert "plan vs dry run at 64 simulated ranks" in out.stdout
    assert "plan holds at simulated ranks [0, 63] of 64" in out.stdout
    assert " NO " not in out.stdout
