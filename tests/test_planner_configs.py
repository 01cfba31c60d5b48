"""The memory planner on published model configs (Llama-3-8B, Llama-2-70B, Mistral-7B-v0.1),
built from their ``config.json`` values on the meta device: parameter counts, sharded state
and per-block activations against hand counts; attention traced as the fused kernels save
it (grouped-query and masked calls included, never a ``seq x seq`` tensor); and what the
command line says about dtypes, the budget and layouts that do not fit.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from fsdp2.plan._models import build_model  # noqa: E402
from fsdp2.tools._meta_attention import fused_attention_on_meta  # noqa: E402
from fsdp2.tools.advice import nothing_fits_advice, offload_host_memory  # noqa: E402
from fsdp2.tools.planner import H100, PlanConfig, estimate, profile_model  # noqa: E402

# The published config.json values (the fields that size the model).
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16")  # fmt: skip
LLAMA2_70B = dict(model_type="llama", vocab_size=32000, hidden_size=8192,
                  intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, torch_dtype="float16")  # fmt: skip
MISTRAL_7B = dict(model_type="mistral", vocab_size=32000, hidden_size=4096,
                  intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  torch_dtype="bfloat16")  # fmt: skip


def _write(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _model(tmp_path, config: dict, dtype=torch.float32):
    model, _plan, _label = build_model("llama", hf_config=_write(tmp_path, config), dtype=dtype)
    return model


def _hand_params(c: dict) -> int:
    """Embedding and head (untied), and per layer q/o (h x h), k/v (kv_heads * head_dim x h),
    gate/up/down (f x h) and two RMSNorm weights; the final norm."""
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    layer = 2 * h * h + 2 * kv * h + 3 * f * h + 2 * h
    return 2 * v * h + c["num_hidden_layers"] * layer + h


# --------------------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    "config,count",
    [(LLAMA3_8B, 8_030_261_248), (LLAMA2_70B, 68_976_648_192), (MISTRAL_7B, 7_241_732_096)],
    ids=["llama3-8b", "llama2-70b", "mistral-7b"],
)
def test_parameter_count_of_published_configs(tmp_path, config, count):
    model = _model(tmp_path, config)
    assert _hand_params(config) == count
    assert sum(p.numel() for p in model.parameters()) == count
    # fp32 master weights whatever the config's torch_dtype says; bf16 when asked
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    bf16 = _model(tmp_path, config, torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}


# --------------------------------------------------------------------------- sharded state
def _state(est) -> int:
    """Sharded parameters, gradients and optimizer state at the optimizer step."""
    at = est.phases["optimizer"]
    return at["sharded_params"] + at["sharded_grads"] + at["optimizer_state"]


def test_sharded_state_of_llama3_8b_is_16_bytes_a_parameter_over_dp(tmp_path):
    profile = profile_model(_model(tmp_path, LLAMA3_8B), seq_len=64)
    n, tensors = 8_030_261_248, 32 * 9 + 3  # 9 tensors a layer; embedding, final norm, head
    cfg = PlanConfig(world_size=64, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    est = estimate(profile, cfg, H100)
    # every dim 0 (128256, 14336, 4096, 1024) divides by 64: fp32 params 4 B + fp32 grads
    # 4 B + AdamW exp_avg / exp_avg_sq 8 B per parameter, and a 4-byte step per tensor
    assert _state(est) == 16 * n // 64 + 4 * tensors
    host = offload_host_memory(est, hardware=H100)
    assert (host.params, host.grads, host.optimizer_state) == (
        4 * n // 64,
        4 * n // 64,
        8 * n // 64,
    )
    assert host.per_node == 8 * 16 * n // 64


def test_sharded_state_of_llama2_70b_on_uneven_shards(tmp_path):
    profile = profile_model(_model(tmp_path, LLAMA2_70B), seq_len=32)
    c, dp = LLAMA2_70B, 48
    h, f, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], 80
    kv = 8 * h // 64

    def rank0(rows: int, cols: int = 1) -> int:  # torch.chunk: the first chunk is the largest
        return math.ceil(rows / dp) * cols

    per_layer = 2 * rank0(h, h) + 2 * rank0(kv, h) + 2 * rank0(f, h) + rank0(h, f) + 2 * rank0(h)
    elements = 2 * rank0(v, h) + layers * per_layer + rank0(h)
    est = estimate(profile, PlanConfig(world_size=dp, param_dtype=torch.bfloat16), H100)
    assert _state(est) == 16 * elements + 4 * (layers * 9 + 3)
    assert elements > _hand_params(c) / dp  # rank 0 holds the rounded-up rows


# --------------------------------------------------------------------------- activations
def _per_block(profile) -> list[int]:
    out = [0] * profile.n_blocks
    for s in profile.saved_for(torch.bfloat16):
        if s.region is not None:
            out[s.region] += s.nbytes
    return out


def _hand_block(c: dict, s: int, kv_heads_saved: int) -> int:
    """Bytes one HF Llama/Mistral decoder layer saves for backward at batch 1, bf16."""
    h, f, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    d = h // heads
    rms = (
        4 * s * h  # the fp32 copy of the input (pow and the multiply by rsqrt save it)
        + 4 * s  # rsqrt of the mean square, fp32, one a token
        + 2 * s * h  # the normalized input cast back to bf16 (the weight's multiply saves it)
    )
    return (
        rms  # input_layernorm
        + 2 * s * h  # q/k/v_proj's input: the norm's output, one storage for the three
        # RoPE: q * cos + rotate_half(q) * sin saves only cos and sin (q's grad needs them);
        # they are built once before the blocks and counted in block 0 (see the caller)
        + 2 * s * h  # attention's query (after RoPE: heads * head_dim = h)
        + 2 * 2 * s * kv_heads_saved * d  # its key and value, as passed (grouped or repeated)
        + 2 * s * h  # its output, also o_proj's input (the kernel's (b, s, heads, d) layout)
        + 4 * heads * s  # its log-sum-exp, fp32 (batch, heads, seq)
        + rms  # post_attention_layernorm
        + 2 * s * h  # gate/up_proj's input: the norm's output
        + 2 * s * f  # gate_proj's output (SiLU saves its input)
        + 2 * s * f  # SiLU's output (the product saves both factors)
        + 2 * s * f  # up_proj's output
        + 2 * s * f  # the product, down_proj's input
    )


def _cos_sin(c: dict, s: int) -> int:
    return 2 * 2 * s * (c["hidden_size"] // c["num_attention_heads"])  # bf16 (1, s, d) each


def test_llama3_8b_block_activations_equal_the_hand_count(tmp_path):
    """Grouped-query attention (transformers calls sdpa with enable_gqa=True, no mask,
    is_causal): keys and values stay at 8 heads."""
    s = 256
    per_block = _per_block(profile_model(_model(tmp_path, LLAMA3_8B), seq_len=s))
    hand = _hand_block(LLAMA3_8B, s, kv_heads_saved=8)
    assert per_block[1:] == [hand] * 31
    assert per_block[0] == hand + _cos_sin(LLAMA3_8B, s)


def test_mistral_7b_block_activations_past_the_sliding_window(tmp_path):
    """Past its sliding window transformers passes a boolean mask, so it repeats keys and
    values to every head first (repeat_kv) and sdpa saves those copies; never the mask
    or the attention matrix."""
    s = 4096 + 512
    per_block = _per_block(profile_model(_model(tmp_path, MISTRAL_7B), seq_len=s))
    hand = _hand_block(MISTRAL_7B, s, kv_heads_saved=32)
    assert per_block[1:] == [hand] * 31
    assert per_block[0] == hand + _cos_sin(MISTRAL_7B, s)
    short = _per_block(profile_model(_model(tmp_path, MISTRAL_7B), seq_len=256))
    assert short[1] == _hand_block(MISTRAL_7B, 256, kv_heads_saved=8)  # no mask: grouped


@pytest.mark.parametrize("config,seq", [(LLAMA3_8B, 512), (MISTRAL_7B, 4096 + 256)])
def test_no_saved_tensor_is_seq_by_seq(tmp_path, config, seq):
    model = _model(tmp_path, {**config, "num_hidden_layers": 2}, torch.bfloat16)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    idx = torch.zeros((1, seq), dtype=torch.long, device="meta")
    with fused_attention_on_meta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx).logits.float().sum()
    assert shapes and not [s for s in shapes if s[-2:] == (seq, seq)]


def test_meta_attention_saves_what_the_fused_kernels_save():
    """Any call on meta (grouped, masked, causal, dropout) saves query, key, value, the
    output and an fp32 log-sum-exp; real tensors run PyTorch's function unchanged."""
    q = torch.empty(2, 8, 128, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.empty(2, 2, 128, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(1, 1, 128, 128, dtype=torch.bool, device="meta")
    for kwargs in ({"enable_gqa": True, "is_causal": True},
                   {"enable_gqa": True, "attn_mask": mask, "dropout_p": 0.1}):  # fmt: skip
        saved = []

        def pack(t, saved=saved):
            saved.append((tuple(t.shape), t.dtype))
            return t

        with fused_attention_on_meta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = F.scaled_dot_product_attention(q, kv, kv, **kwargs)
        assert out.shape == (2, 8, 128, 64)
        assert saved == [((2, 8, 128, 64), torch.bfloat16), ((2, 2, 128, 64), torch.bfloat16),
                         ((2, 2, 128, 64), torch.bfloat16), ((2, 8, 128, 64), torch.bfloat16),
                         ((2, 8, 128), torch.float32)]  # fmt: skip
        # the output's storage is (batch, seq, heads, dim): the caller's transpose is free
        assert out.transpose(1, 2).is_contiguous()
    torch.manual_seed(0)
    x = torch.randn(1, 4, 16, 8)
    with fused_attention_on_meta():
        inside = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    assert torch.equal(inside, F.scaled_dot_product_attention(x, x, x, is_causal=True))
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


# --------------------------------------------------------------------------- command line
TINY_GQA = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=1024, torch_dtype="bfloat16")  # fmt: skip


def test_cli_prints_the_master_dtype_and_the_budget_in_gib(tmp_path, capsys):
    from fsdp2.plan.__main__ import main

    path = _write(tmp_path, TINY_GQA)
    rc = main(["--hf-config", path, "--world-size", "8", "--gpu-memory", "80GB",
               "--seq-len", "256", "--tp", "1"])  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert rc == 0, out
    assert "weights and AdamW state fp32 (master), compute bf16, reduce fp32" in out
    assert "budget 74.5 GiB a rank (80GB read as 80e9 bytes" in out
    assert "an '80GB' H100 has 79.6 GiB: --gpu-memory 79.6GiB" in out
    assert "live tensor bytes" in out and "1.11-1.34" in out
    rc = main(["--hf-config", path, "--world-size", "8", "--gpu-memory", "79.6GiB",
               "--seq-len", "256", "--tp", "1", "--master-dtype", "bf16"])  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0, out
    assert "weights and AdamW state bf16 (master), compute bf16, reduce fp32" in out
    assert "budget 79.6 GiB a rank" in out and "read as" not in out


def test_cli_advice_when_nothing_fits_names_offload_and_its_host_memory(tmp_path, capsys):
    from fsdp2.plan.__main__ import main

    rc = main(["--hf-config", _write(tmp_path, TINY_GQA), "--world-size", "8",
               "--gpu-memory", "1MiB", "--seq-len", "256", "--tp", "1", "--ac"])  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 1
    advice = out[out.index("nothing fits") :]
    assert "activation checkpointing is already on" in advice and "--ac" not in advice
    assert "CPU offload (--offload)" in advice and "the host holds" in advice
    assert "a node of 8 ranks" in advice


def test_advice_finds_the_world_size_that_fits(tmp_path):
    profile = profile_model(_model(tmp_path, TINY_GQA), seq_len=256)
    cfg = PlanConfig(world_size=2, activation_checkpointing=True, param_dtype=torch.bfloat16)
    small = estimate(profile, cfg, H100)
    budget = estimate(profile, replace(cfg, world_size=7), H100).peak_bytes
    lines = nothing_fits_advice(profile, small, budget, H100)
    assert not any("--ac" in line for line in lines)
    more = [line for line in lines if line.startswith("more ranks")]
    # the peak shrinks with the shards: 7 ranks fit (exactly), 6 do not
    assert (
        estimate(profile, PlanConfig(**{**cfg.__dict__, "world_size": 6}), H100).peak_bytes > budget
    )
    assert more and more[0].startswith("more ranks: 7 ranks fit"), lines
