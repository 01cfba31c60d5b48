"""The models ``python -m fsdp2.plan`` sizes, built on the meta device."""

from __future__ import annotations

import math

import torch
from torch import nn

# Llama-2/3 widths and depths; a requested size picks the nearest width, then the depth.
_WIDTHS = [(768, 12), (1024, 24), (2048, 22), (2560, 32), (4096, 32), (5120, 40),
           (6656, 60), (8192, 80), (12288, 96), (16384, 126)]  # fmt: skip
_VOCAB = 32000


def _gpt_size(dim: int, layers: int, vocab: int, seq: int) -> int:
    return vocab * dim * 2 + seq * dim + layers * (12 * dim * dim + 13 * dim) + 2 * dim


def _llama_size(dim: int, layers: int, vocab: int, ffn: int) -> int:
    return vocab * dim * 2 + layers * (4 * dim * dim + 3 * dim * ffn + 2 * dim) + dim


def _llama_ffn(dim: int) -> int:
    return 256 * math.ceil(int(8 * dim / 3) / 256)


def _pick(params: float, size_of) -> tuple[int, int]:
    if not params > 0:
        raise ValueError(f"fsdp2.plan: --params must be positive, got {params!r}.")
    dim = min(_WIDTHS, key=lambda w: abs(math.log(size_of(*w) / params)))[0]
    one = size_of(dim, 1) - size_of(dim, 0)
    layers = max(1, round((params - size_of(dim, 0)) / one))
    return dim, layers


def gpt_config_for(params: float, *, seq_len: int = 2048):
    """``examples.gpt.GPTConfig`` of about ``params`` parameters: a Llama-2 width (heads of
    128), as many blocks as it takes, vocabulary 32000, separate q/k/v (so its
    ``tp_plan`` applies). GPT-2 style blocks: LayerNorm, a GELU MLP of ``4 * dim``, biases.

    Raises:
        ImportError: ``examples`` is not importable (run from the repository root).

    Example:
        >>> cfg = gpt_config_for(7e9)
        >>> cfg.dim, cfg.n_layers
        (4096, 33)
    """
    from examples.gpt import GPTConfig

    dim, layers = _pick(params, lambda d, n: _gpt_size(d, n, _VOCAB, seq_len))
    return GPTConfig(vocab_size=_VOCAB, dim=dim, n_layers=layers, n_heads=dim // 128,
                     max_seq_len=seq_len, fused_qkv=False)  # fmt: skip


def llama_config_for(params: float, *, seq_len: int = 4096):
    """A ``transformers.LlamaConfig`` of about ``params`` parameters (Llama-2 shapes:
    heads of 128, SwiGLU of ``8/3 * dim`` rounded to 256, vocabulary 32000, untied).

    Example:
        >>> cfg = llama_config_for(7e9)
        >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
        (4096, 33, 11008)
    """
    from transformers import LlamaConfig

    dim, layers = _pick(params, lambda d, n: _llama_size(d, n, _VOCAB, _llama_ffn(d)))
    return LlamaConfig(vocab_size=_VOCAB, hidden_size=dim, intermediate_size=_llama_ffn(dim),
                       num_hidden_layers=layers, num_attention_heads=dim // 128,
                       num_key_value_heads=dim // 128, max_position_embeddings=seq_len)  # fmt: skip


def tp_plan_for(model: nn.Module) -> dict | None:
    """A Megatron-style tensor-parallel plan for ``model``: ``examples.gpt.tp_plan()`` for
    its GPT; for Hugging Face decoders, by module names (q/k/v/gate/up projections
    column-parallel, o/down row-parallel, the embedding row-parallel and the head
    column-parallel); None when neither applies.

    Example:
        >>> sorted(tp_plan_for(model))[:2]
        ['lm_head', 'model.embed_tokens']
    """
    from dtensor.parallel import ColwiseParallel, RowwiseParallel

    if type(model).__name__ == "GPT" and hasattr(model, "blocks"):
        if getattr(getattr(model, "cfg", None), "fused_qkv", False):
            return None  # a column split of the fused q/k/v projection cuts across q, k, v
        from examples.gpt import tp_plan

        return tp_plan()
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    col = [n for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") if n in names]
    row = [n for n in ("o_proj", "down_proj") if n in names]
    if not col or not row:
        return None
    plan = {}
    for name, _m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in col:
            plan[name] = ColwiseParallel()
        elif leaf in row:
            plan[name] = RowwiseParallel()
        elif leaf == "embed_tokens":
            plan[name] = RowwiseParallel()
        elif leaf == "lm_head":
            plan[name] = ColwiseParallel()
    return plan


def build_model(
    kind: str,
    *,
    params: float | None = None,
    hf_config: str | None = None,
    seq_len: int = 2048,
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, dict | None, str]:
    """``(model on meta, tp plan, label)`` for ``--model gpt|llama --params N`` or
    ``--hf-config PATH`` (a Hugging Face ``config.json`` or its folder, built with
    ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``).

    The parameters are in ``dtype``, the master dtype the weights (and so their gradients
    and optimizer state) are kept in between steps: fp32 by default, as with a
    ``MixedPrecisionPolicy`` that computes in bf16. A config's ``torch_dtype`` (bf16 in
    published checkpoints) is the dtype its weights were saved in, not the training one,
    and is ignored.

    Raises:
        ValueError: an unknown kind, neither a size nor a config, or a non-float dtype.

    Example:
        >>> model, plan, label = build_model("llama", params=7e9)
        >>> label.startswith("Llama"), next(model.parameters()).dtype
        (True, torch.float32)
        >>> model, _, _ = build_model("gpt", params=1e8, dtype=torch.bfloat16)
        >>> next(model.parameters()).dtype
        torch.bfloat16
    """
    if not dtype.is_floating_point:
        raise ValueError(f"fsdp2.plan: the master dtype must be a float dtype, got {dtype}.")
    if hf_config is not None:
        model, label = _from_hf_config(hf_config, dtype)
    elif params is None:
        raise ValueError("fsdp2.plan: give --params N (with --model) or --hf-config PATH.")
    elif kind == "gpt":
        model, label = _gpt(params, seq_len, dtype)
    elif kind == "llama":
        model, label = _llama(params, seq_len, dtype)
    else:
        raise ValueError(f"fsdp2.plan: --model must be 'gpt' or 'llama', got {kind!r}.")
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return model, tp_plan_for(model), f"{label}: {n / 1e9:.2f}B parameters"


def _from_hf_config(path: str, dtype: torch.dtype) -> tuple[nn.Module, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model, f"{type(model).__name__} from {path}"


def _gpt(params: float, seq_len: int, dtype: torch.dtype) -> tuple[nn.Module, str]:
    from examples.gpt import GPT

    cfg = gpt_config_for(params, seq_len=seq_len)
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    label = (
        f"GPT (examples/gpt.py) dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
        f"vocab {cfg.vocab_size}"
    )
    return model, label


def _llama(params: float, seq_len: int, dtype: torch.dtype) -> tuple[nn.Module, str]:
    from transformers import AutoModelForCausalLM

    cfg = llama_config_for(params, seq_len=max(seq_len, 4096))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    label = (
        f"Llama (transformers) dim {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
        f"ffn {cfg.intermediate_size}"
    )
    return model, label
