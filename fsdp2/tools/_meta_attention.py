"""Scaled dot-product attention on the meta device, saving for backward what the fused GPU
kernels save.

The memory planner (``fsdp2/tools/planner.py``) counts activations by tracing one forward
of a meta model under ``saved_tensors_hooks``. On meta, ``F.scaled_dot_product_attention``
runs PyTorch's composite (math) attention whenever the call has an ``attn_mask`` or
``enable_gqa=True``, and that path saves the ``(batch, heads, seq, seq)`` attention
probabilities (and, with grouped-query attention, keys and values expanded to every query
head). A training run on a GPU takes a fused kernel (flash, memory-efficient or cuDNN)
that keeps none of that. ``fused_attention_on_meta()`` makes the trace see the fused
kernels' bookkeeping instead, for every call on meta, whatever its mask, causality,
dropout or grouping:

* ``query``, ``key`` and ``value`` as the caller passed them (grouped keys and values keep
  their ``kv_heads``; a caller that expands them first, as Hugging Face's ``repeat_kv``
  does, passes, and the kernel saves, the expanded copies);
* the output, laid out ``(batch, seq, heads, dim)`` and viewed as ``(batch, heads, seq,
  dim)`` as the kernels return it (a caller's ``out.transpose(1, 2).contiguous()`` is then
  free and the next projection saves the same storage, as on a GPU);
* the log-sum-exp of every query row in fp32, ``(batch, heads, seq)``.

Never a ``seq x seq`` tensor. What is not counted: the kernels' random-number state (16
bytes a call), and, for a call with a mask, the copy of the mask the kernel keeps as an
additive bias (a boolean ``(1, 1, seq, seq)`` mask becomes one in the compute dtype per
call: seen on an H100 with Hugging Face's Mistral past its sliding window, 2 * seq**2
bytes a layer in bf16; the flash kernel, which takes no mask, keeps none). Apart from
those two, this trace matched what an H100 saved per decoder layer of a Hugging Face Llama
(grouped-query) and Mistral (masked) model byte for byte.

Tensors on any other device go to the original function untouched.

Example:
    >>> with fused_attention_on_meta():
    ...     loss = forward(meta_model, idx)      # attention saves q, k, v, out and lse
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = ["FusedAttentionOnMeta", "meta_attention", "fused_attention_on_meta"]


class FusedAttentionOnMeta(torch.autograd.Function):
    """Attention of meta tensors that saves ``query``, ``key``, ``value``, the output and an
    fp32 log-sum-exp for backward, as the fused GPU kernels do; its backward returns
    gradients of the inputs' shapes (meta tensors have no values to compute).

    ``apply(query, key, value)``: ``query`` is ``(..., L, E)``, ``key`` ``(..., S, E)``,
    ``value`` ``(..., S, Ev)``; the output is ``(..., L, Ev)`` in ``query``'s dtype.

    Example:
        >>> q = torch.empty(1, 8, 128, 64, device="meta", requires_grad=True)
        >>> kv = torch.empty(1, 2, 128, 64, device="meta", requires_grad=True)
        >>> FusedAttentionOnMeta.apply(q, kv, kv).shape
        torch.Size([1, 8, 128, 64])
    """

    @staticmethod
    def forward(ctx, query, key, value):
        *lead, length, _ = query.shape
        out_shape = (*lead, length, value.shape[-1])
        if query.dim() == 4:  # (batch, seq, heads, dim) storage, as the kernels allocate it
            b, h, n, d = out_shape
            out = query.new_empty((b, n, h, d)).transpose(1, 2)
        else:
            out = query.new_empty(out_shape)
        lse = torch.empty((*lead, length), dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _out, _lse = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _shapes_agree(query, key, value, enable_gqa: bool) -> bool:
    """Whether the fused kernels would take these shapes (else the original function runs,
    to raise its own error)."""
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        return False
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        return False
    if query.dim() >= 3:
        hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if hk != hv:
            return False
        if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
            return False
    return True


def meta_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` for meta tensors, with the fused kernels' saved
    tensors (:class:`FusedAttentionOnMeta`). The mask, causality, dropout and scale change
    no shape and are not saved; shapes no kernel takes go to PyTorch's function.

    Example:
        >>> q = torch.empty(2, 32, 4096, 128, device="meta", dtype=torch.bfloat16)
        >>> kv = torch.empty(2, 8, 4096, 128, device="meta", dtype=torch.bfloat16)
        >>> meta_attention(q, kv, kv, is_causal=True, enable_gqa=True).shape
        torch.Size([2, 32, 4096, 128])
    """
    if not _shapes_agree(query, key, value, enable_gqa):
        logger.debug(
            "meta_attention: shapes %s, %s, %s go to PyTorch's attention",
            tuple(query.shape),
            tuple(key.shape),
            tuple(value.shape),
        )
        return torch._C._nn.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return FusedAttentionOnMeta.apply(query, key, value)


@contextlib.contextmanager
def fused_attention_on_meta():
    """Within the block, ``F.scaled_dot_product_attention`` of meta tensors runs
    :func:`meta_attention` (what the fused kernels save); any other call runs PyTorch's
    function unchanged. Restores the function on exit.

    Example:
        >>> with fused_attention_on_meta(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        ...     loss = forward(meta_model, idx)
    """
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, *args, **kwargs):  # PyTorch's signature, passed through
        if query.device.type != "meta":
            return original(query, key, value, *args, **kwargs)
        return meta_attention(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
