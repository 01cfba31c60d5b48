"""A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention) for
the GPU check and the benchmarks.

The same interface as ``examples.gpt``: ``model.blocks`` (one ``fully_shard`` group each),
``reset_parameters()`` (in-place, so it works on sharded parameters and after
``to_empty``), ``cfg.num_params()``, and ``gpt_loss`` for the loss. The rotary angles are
computed in ``forward`` from the positions (no buffers), so a model built on the meta
device needs nothing besides ``to_empty`` and ``reset_parameters``. Grouped-query attention
repeats the key/value heads before ``scaled_dot_product_attention`` (as torchtitan does),
so the fused attention kernels run on every PyTorch release and device. Each attention
computes its rotary angles itself, so a block's only input is the hidden state: PyTorch
2.11's and 2.12's FSDP2 do not cast a floating input made outside a checkpointed block when
they recompute it, and fail in backward (2.13 fixed that; ours casts).

Example:
    >>> from examples.llama import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    >>> Llama(cfg)(torch.randint(0, 256, (2, 16))).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 18
    n_heads: int = 16
    n_kv_heads: int = 8
    ffn_dim: int = 5632
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    checkpoint_blocks: bool = False  # torch.utils.checkpoint around every block

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: dim={self.dim} must divide by n_heads={self.n_heads}, and "
                f"n_heads by n_kv_heads={self.n_kv_heads}."
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        per_block = 2 * d * d + 2 * d * kv + 3 * d * self.ffn_dim + 2 * d
        return 2 * self.vocab_size * d + self.n_layers * per_block + d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per parameter of the matrix products (the token
        embedding is a lookup) plus attention's scores and weighted sum, counted over the
        whole sequence as torchtitan and PaLM's MFU do (causal masking not subtracted)."""
        dense = self.num_params() - self.vocab_size * self.dim
        return 6 * dense + 12 * self.n_layers * self.dim * seq_len


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on ``x`` (batch, heads, time, head_dim), the two halves as pairs."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).type_as(x)


def rotary_angles(cfg: LlamaConfig, t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the rotary angles, (t, head_dim / 2) in fp32."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv, bias=False)
        self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, hd = x.shape[0], x.shape[1], self.cfg.head_dim
        cos, sin = rotary_angles(self.cfg, t, x.device)
        q = self.wq(x).view(b, t, -1, hd).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, hd).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def init_std(self, name: str) -> float | None:
        """The standard deviation parameter ``name`` is drawn with (None: a norm, set to one).

        Example:
            >>> model.init_std("blocks.0.feed_forward.w2.weight")    # 0.02 / sqrt(2 n_layers)
        """
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("wo.weight", "w2.weight")):
            return 0.02 / math.sqrt(2 * self.cfg.n_layers)
        return 0.02

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, output projections scaled by depth, norms at one;
        in-place only, so it runs on sharded parameters too."""
        for name, p in self.named_parameters():
            std = self.init_std(name)
            if std is None:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for block in self.blocks:
            if self.cfg.checkpoint_blocks and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.output(self.norm(x))
