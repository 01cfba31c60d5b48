"""A small GPT (decoder-only transformer) shared by the examples, tests and benchmarks.

Sizes are free, so tests can pick awkward ones (a vocabulary not divisible by the world size,
fewer position rows than ranks). No dropout: replicas stay bit-identical.

Example:
    >>> from examples.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32))
    >>> logits = model(torch.randint(0, 256, (2, 16)))     # (2, 16, 256)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 256
    tie_weights: bool = False
    bias: bool = True  # biases in every Linear
    checkpoint_blocks: bool = False  # torch.utils.checkpoint around every block
    fused_qkv: bool = True  # one q/k/v projection; False for tensor parallelism (tp_plan)

    def num_params(self) -> int:
        d, v = self.dim, self.vocab_size
        per_block = 12 * d * d + (13 * d if self.bias else 4 * d)
        head = 0 if self.tie_weights else v * d
        return v * d + self.max_seq_len * d + self.n_layers * per_block + 2 * d + head


class Attention(nn.Module):
    """Causal self-attention. Heads are counted from the local width (``-1``), so a
    tensor-parallel plan can split the projections by whole heads; that needs separate
    q/k/v projections (``GPTConfig(fused_qkv=False)``): a column split of the fused one would
    cut across q, k and v."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.bias)
        else:
            self.q = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
            self.k = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
            self.v = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).view(b, t, 3, -1, self.head_dim).transpose(1, 3).unbind(2)
        else:
            q, k, v = (
                proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                for proj in (self.q, self.k, self.v)
            )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim, bias=cfg.bias)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init; works on sharded parameters too (only in-place ops)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            elif name.endswith("proj.weight") or name.endswith("out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            if self.cfg.checkpoint_blocks and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue ``idx`` (batch, time) by ``max_new_tokens`` tokens.

        ``temperature=0`` is greedy; otherwise each token is sampled from the softmax of the
        logits divided by ``temperature``, among the ``top_k`` most likely when given. Pass the
        same seeded ``generator`` on every rank of a sharded model so all ranks pick alike.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.max_seq_len :])[:, -1].float()  # (B, vocab)
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.size(-1):
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def tp_plan(
    *, loss_parallel: bool = False, use_torch: bool = False, uneven_sequence: bool = False
) -> dict:
    """The tensor-parallel plan for ``GPT`` (Megatron-style with sequence parallelism).

    Attention splits by heads (q/k/v column-parallel, the output projection row-parallel),
    the MLP by hidden units; between blocks the activations are sharded along the sequence
    (dim 1), so the norms run on ``1/tp`` of the tokens. With ``loss_parallel`` the logits
    stay sharded over the vocabulary for ``dtensor.parallel.loss_parallel``. ``use_torch``
    builds the same plan from PyTorch's own classes.

    The sequence must divide by the tensor-parallel size, as in PyTorch, unless
    ``uneven_sequence``: then the norms take their shards as ``torch.chunk`` pieces of any
    length, and exchange their lengths on every forward (a small all-gather and a host sync
    each; docs/parallel.md).

    Example:
        >>> parallelize_module(model, mesh["tp"], tp_plan())
    """
    if use_torch:  # the same plan in PyTorch's classes (tests and benchmarks compare)
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )
    else:
        from dtensor import Replicate, Shard
        from dtensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

    if uneven_sequence and use_torch:
        raise ValueError("tp_plan: PyTorch's styles take sequence shards as even pieces.")
    seq = {"uneven_shards": True} if uneven_sequence else {}
    gather_seq = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "blocks.*.ln1": SequenceParallel(**seq),
        "blocks.*.attn": gather_seq,
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln2": SequenceParallel(**seq),
        "blocks.*.mlp": gather_seq,
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.out": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(**seq),
        "head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
