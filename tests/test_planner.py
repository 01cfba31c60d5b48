"""The memory planner (fsdp2/tools/planner.py) and its command line (python -m fsdp2.plan).

The predictions are checked against the memory tracker on real gloo runs (the 10% bound
of issue 27 on two cheap configurations; benchmarks/plan_validation.py has the full
table), the activation trace against the tensors a real CPU forward saves, and the shard
sizes and collectives against the library itself in tests/test_dry_run.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan
from fsdp2.tools.planner import (
    CATEGORIES,
    CPU,
    H100,
    PlanConfig,
    estimate,
    group_layouts,
    parse_bytes,
    profile_model,
    rank_configs,
)
from tests.harness import run_on_ranks

SMALL = GPTConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=128)


def _meta_gpt(cfg: GPTConfig = SMALL) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


# --------------------------------------------------------------------------- validation
def _within_ten_percent(name: str) -> None:
    from benchmarks.plan_validation import CONFIGS, _comms_match, measure, predict

    spec = CONFIGS[name]
    got = measure(spec, small="medium", global_batch=4, seq=64)
    if dist.get_rank() != 0:
        return
    est = predict(spec, small="medium", global_batch=4, seq=64)
    err = (est.peak_bytes - got["peak"]) / got["peak"]
    assert abs(err) <= 0.10, (name, est.peak_bytes, got, est.categories)
    # and the step's collectives under CommDebugMode are the planner's (the ledger's model)
    assert _comms_match(est, got["comms"]).startswith("equal"), (est.collectives, got["comms"])


@pytest.mark.parametrize("name,ranks", [("ws1-plain", 1), ("ws2-fsdp", 2)])
def test_predicted_peak_within_ten_percent_of_the_tracker_and_collectives_equal(name, ranks):
    run_on_ranks(ranks, _within_ten_percent, name=name)


def test_activation_trace_on_meta_equals_a_real_cpu_forward():
    """What the meta trace counts (attention as the fused kernels save it) is what a real
    CPU forward saves, byte for byte."""
    profile = profile_model(_meta_gpt(), seq_len=128)
    traced = sum(s.nbytes for s in profile.saved_for(torch.float32))
    torch.manual_seed(0)
    model = GPT(SMALL)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    idx = torch.zeros((1, 128), dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gpt_loss(model, idx, idx)
    assert traced == sum(seen.values())


# --------------------------------------------------------------------------- the model
def test_shards_of_uneven_rows_follow_torch_chunk():
    cfg = GPTConfig(vocab_size=1000, dim=96, n_layers=2, n_heads=4, max_seq_len=32)
    profile = profile_model(_meta_gpt(cfg), seq_len=32)
    root = group_layouts(profile, PlanConfig(world_size=64))[0]
    # tok_emb (1000 rows: 16 on rank 0), pos_emb (32 rows: 1), ln_f (96: 2 + 2), head (16)
    assert root.name == "root"
    assert root.shard_numel == 16 * 96 + 1 * 96 + 2 + 2 + 16 * 96
    assert root.row_numel == root.shard_numel


def test_more_ranks_less_state_and_bf16_halves_the_gathers():
    profile = profile_model(_meta_gpt(), seq_len=128)
    e2, e4 = (estimate(profile, PlanConfig(world_size=w), CPU) for w in (2, 4))
    assert e4.categories["optimizer_state"] < e2.categories["optimizer_state"]
    fp32 = estimate(profile, PlanConfig(world_size=8), H100)
    bf16 = estimate(profile, PlanConfig(world_size=8, param_dtype=torch.bfloat16), H100)
    gather = ("all_gather", "dp_shard")
    assert bf16.collectives[gather][0] == fp32.collectives[gather][0]
    assert 2 * bf16.collectives[gather][1] == fp32.collectives[gather][1]
    assert set(fp32.categories) == set(CATEGORIES)


def test_checkpointing_trades_activations_for_compute():
    profile = profile_model(_meta_gpt(GPTConfig(dim=256, n_layers=8, n_heads=4)), seq_len=256)
    base = PlanConfig(world_size=8, batch_size=8)
    plain = estimate(profile, base)
    ac = estimate(profile, PlanConfig(world_size=8, batch_size=8, activation_checkpointing=True))
    assert ac.phases["forward"]["activations"] < plain.phases["forward"]["activations"] / 4
    assert ac.compute_s > plain.compute_s


def test_tensor_parallel_layout_needs_a_plan():
    cfg = GPTConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, max_seq_len=64, fused_qkv=False)
    with pytest.raises(ValueError, match="tp_plan"):
        estimate(profile_model(_meta_gpt(cfg), seq_len=64), PlanConfig(world_size=4, tp=2))
    profile = profile_model(_meta_gpt(cfg), seq_len=64, tp_plan=tp_plan())
    one, two = (
        estimate(profile, PlanConfig(world_size=4, tp=t, batch_size=2), CPU) for t in (1, 2)
    )
    assert two.config.dp_shard == 2
    # fewer activations per rank with tp, but the inputs of q/k/v and fc stay whole
    assert one.phases["forward"]["activations"] / 2 < two.phases["forward"]["activations"]
    assert two.phases["forward"]["activations"] < one.phases["forward"]["activations"]


def test_rank_configs_orders_what_fits_by_step_time():
    profile = profile_model(_meta_gpt(GPTConfig(dim=256, n_layers=4, n_heads=4)), seq_len=256)
    every, none_too_big = rank_configs(profile, 8, None, tp_degrees=(1,), hardware=H100)
    assert not none_too_big  # no budget: everything fits
    budget = sorted(e.peak_bytes for e in every)[len(every) // 2]  # the median layout
    fits, too_big = rank_configs(profile, 8, budget, tp_degrees=(1,), hardware=H100)
    assert fits and too_big
    assert all(e.peak_bytes <= budget for e in fits)
    assert all(e.peak_bytes > budget for e in too_big)
    assert [e.step_s for e in fits] == sorted(e.step_s for e in fits)
    assert all(e.config.batch_size * e.config.dp == 8 for e in fits + too_big)


def test_plan_config_and_sizes_reject_bad_input():
    with pytest.raises(ValueError, match="not divisible"):
        PlanConfig(world_size=6, tp=4)
    with pytest.raises(ValueError, match="optimizer"):
        PlanConfig(world_size=2, optimizer="lion")
    with pytest.raises(ValueError, match="world_size"):
        PlanConfig(world_size=0)
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("24GiB") == 24 << 30
    assert parse_bytes("1.5 TB") == 15 * 10**11
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("eighty")
    with pytest.raises(ValueError, match="blocks"):
        profile_model(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- command line
def test_cli_ranks_layouts_for_a_gpt(capsys):
    from fsdp2.plan.__main__ import main

    rc = main(["--model", "gpt", "--params", "1e8", "--world-size", "8", "--gpu-memory", "80GB",
               "--seq-len", "512", "--tp", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "layouts that fit" in out and "fsdp 8" in out and "all_gather" in out


def test_cli_reads_a_hugging_face_config(tmp_path, capsys):
    from fsdp2.plan.__main__ import main

    config = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=688,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=512)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc = main(["--hf-config", str(tmp_path / "config.json"), "--world-size", "4",
               "--gpu-memory", "1GiB", "--seq-len", "256", "--tp", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "LlamaForCausalLM" in out and "tp2" in out  # the plan from the module names


def test_cli_says_when_nothing_fits(capsys):
    from fsdp2.plan.__main__ import main

    rc = main(["--model", "gpt", "--params", "1e8", "--world-size", "2", "--gpu-memory", "1MB",
               "--seq-len", "256", "--tp", "1"])  # fmt: skip
    assert rc == 1
    assert "nothing fits" in capsys.readouterr().out
