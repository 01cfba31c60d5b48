"""Tensor parallelism's share of the analytic expectation (``fsdp2.tools.comm_model``):
the collectives of a transformer under the Megatron-style plan with sequence parallelism.

Example:
    >>> from fsdp2.tools.comm_model import TransformerTP
    >>> TransformerTP(n_layers=2, batch=2, seq=6, dim=32, vocab=67, tp_size=2).comms()[0].kind
    'reduce_scatter'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp2.tools._records import ExpectedCollective, _ceil_div, summarize


@dataclass(frozen=True)
class TransformerTP:
    """The tensor-parallel collectives of one step of a transformer laid out by the
    Megatron-style plan with sequence parallelism (``examples.gpt.tp_plan``, torchtitan's
    plan) over a ``tp`` mesh dim of ``tp_size`` ranks.

    Derived from ``dtensor/parallel/style.py`` and ``_compute.py`` ([Note: tensor
    parallelism per block]). With ``B`` = ``batch`` (the sequences one tensor-parallel group
    computes), ``T`` = ``seq``, ``D`` = ``dim``, ``V`` = ``vocab``, ``k`` = ``tp_size``, an
    activation shard is ``S = B * ceil(T/k) * D`` elements and a full activation
    ``F = B * T * D``, both in ``dtype`` (the compute dtype: ``param_dtype`` under mixed
    precision):

    ==========================  ==========================================  ===================
    module (style)              forward                                     backward
    ==========================  ==========================================  ===================
    token embedding (Rowwise,   reduce-scatter ``F`` (partial rows to        all-gather ``S``
    output ``Shard(1)``)        sequence shards)
    position embedding          reduce-scatter ``T*D``                       all-gather
    (Rowwise, ``Shard(0)``)                                                  ``ceil(T/k)*D``
    norm (SequenceParallel)     none                                        all-reduce of each
                                                                            weight/bias grad, D
    attention / MLP input       all-gather ``S`` (``Shard(1)->Replicate``)   all-gather ``S``
    (PrepareModuleInput)                                                    (re-gather of the
                                                                            saved shard) and
                                                                            reduce-scatter ``F``
    q, k, v / fc (Colwise)      none                                        none (their partial
                                                                            input grads are
                                                                            summed, then reduced
                                                                            by the row above)
    proj / out (Rowwise,        reduce-scatter ``F``                         all-gather ``S``;
    output ``Shard(1)``)                                                    all-reduce of the
                                                                            bias grad, D
    head (Colwise, input        all-gather ``S``; unless ``loss_parallel``,  all-gather ``S``
    ``Shard(1)``)               all-gather ``B*T*ceil(V/k)`` (the logits)    (re-gather) and
                                                                            reduce-scatter ``F``
    loss (``loss_parallel``)    3 all-reduces of ``B*T`` (max, sum, pick)    1 all-reduce ``B*T``
    ==========================  ==========================================  ===================

    Norms have ``norm_params`` parameters each (2 for LayerNorm, 1 for RMSNorm);
    ``bias=False`` drops the row-parallel biases' all-reduces; ``regather_in_backward=False``
    (PyTorch's styles) keeps the gathered inputs instead of gathering them again.

    Activation checkpointing (``torch.distributed._composable.checkpoint`` on a block, as
    ``parallelize_transformer(activation_checkpointing=True)`` puts on each): in backward
    the block's forward runs again, and with PyTorch's default early stop
    (``torch.utils.checkpoint.set_checkpoint_early_stop``) it stops once it has rebuilt the
    last tensor checkpointing saved. Per checkpointed block, measured on the fake process
    group and on 2 gloo ranks (``tests/test_comm_model_tp_ac.py``):

    ================================  =========================================================
    early stop                        re-issued in backward by the recomputation
    ================================  =========================================================
    on (PyTorch's default)            attention's input all-gather ``S``, its output
                                      reduce-scatter ``F`` and the MLP's input all-gather
                                      ``S``: the recomputation stops at the tensors the MLP's
                                      output linear saves, before its reduce-scatter
    ``checkpoint_early_stop=False``   the whole block: both all-gathers ``S``, both
                                      reduce-scatters ``F``
    ================================  =========================================================

    The same with either ``regather_in_backward``: the regather hooks hand checkpointing
    every tensor saved in attention and the MLP but the gathered inputs, and those inputs'
    shards too ([Note: regather under outer hooks] in ``dtensor/parallel/_regather.py``):
    the recomputation rebuilds the shards, and the backward's re-gathers (in the table
    above) all-gather them again. A checkpointed block then keeps only its input from
    forward to backward, as without tensor parallelism.

    No all-reduce is re-issued (the norms' and biases' gradients are reduced once).
    ``activation_checkpointing=True`` checkpoints every block; ``checkpointed_blocks`` (block
    indices) names the checkpointed ones and, when given, decides alone.

    PyTorch's styles on the same plan send, per step, ``2 * n_layers + 1`` fewer all-gathers
    (no re-gather) and ``2 * n_layers`` fewer all-reduces: PyTorch adds a row-parallel
    bias before the reduce-scatter (its gradient then needs no reduction), this library after
    it, on sequence shards. Not modelled: ``uneven_shards`` (a small all-gather of sizes per
    sequence-parallel input).

    Example:
        >>> tp = TransformerTP(n_layers=2, batch=2, seq=6, dim=32, vocab=67, tp_size=2)
        >>> tp.by_mesh_dim()[("reduce_scatter", "tp")]    # (count, bytes per rank)
        (11, 16128)
    """

    n_layers: int
    batch: int
    seq: int
    dim: int
    vocab: int
    tp_size: int
    mesh_dim: str | int | None = "tp"
    dtype: torch.dtype = torch.float32
    loss_parallel: bool = False
    loss_dtype: torch.dtype | None = None
    bias: bool = True
    norm_params: int = 2
    position_embedding: bool = True
    regather_in_backward: bool = True
    activation_checkpointing: bool = False
    checkpointed_blocks: tuple[int, ...] | None = None
    checkpoint_early_stop: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layers", "batch", "seq", "dim", "vocab", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name != "n_layers" else 0):
                raise ValueError(f"TransformerTP: {name} must be a positive int, got {value!r}.")
        if self.checkpointed_blocks is not None:
            blocks = tuple(self.checkpointed_blocks)
            if any(type(i) is not int or not 0 <= i < self.n_layers for i in blocks):
                raise ValueError(
                    f"TransformerTP: checkpointed_blocks must be block indices in "
                    f"[0, {self.n_layers}), got {self.checkpointed_blocks!r}."
                )
            object.__setattr__(self, "checkpointed_blocks", tuple(sorted(set(blocks))))

    @property
    def checkpointed(self) -> frozenset[int]:
        """Indices of the checkpointed blocks: ``checkpointed_blocks`` when given, else
        every block under ``activation_checkpointing``, else none.

        Example:
            >>> TransformerTP(3, 1, 8, 16, 50, 2, activation_checkpointing=True).checkpointed
            frozenset({0, 1, 2})
        """
        if self.checkpointed_blocks is not None:
            return frozenset(self.checkpointed_blocks)
        return frozenset(range(self.n_layers) if self.activation_checkpointing else ())

    def comms(self) -> list[ExpectedCollective]:
        """The step's tensor-parallel collectives (forward, then backward)."""
        k, lbl, item = self.tp_size, self.mesh_dim, self.dtype.itemsize
        if k == 1:
            return []
        b, t, d = self.batch, self.seq, self.dim
        shard, full = b * _ceil_div(t, k) * d * item, b * t * d * item
        fwd, bwd = [], []

        def c(kind: str, nbytes: int, phase: str, where: str) -> None:
            (fwd if phase == "forward" else bwd).append(
                ExpectedCollective(kind, lbl, k, nbytes, phase, where)
            )

        def gathered_input(where: str) -> None:  # PrepareModuleInput / Colwise(Shard(1))
            c("all_gather", shard, "forward", where)
            if self.regather_in_backward:
                c("all_gather", shard, "backward", where)
            c("reduce_scatter", full, "backward", where)

        def norm(where: str) -> None:
            for _ in range(self.norm_params):
                c("all_reduce", d * item, "backward", where)

        def row_parallel(where: str) -> None:
            c("reduce_scatter", full, "forward", where)
            c("all_gather", shard, "backward", where)
            if self.bias:
                c("all_reduce", d * item, "backward", where)

        c("reduce_scatter", full, "forward", "tok_emb")
        c("all_gather", shard, "backward", "tok_emb")
        if self.position_embedding:
            c("reduce_scatter", t * d * item, "forward", "pos_emb")
            c("all_gather", _ceil_div(t, k) * d * item, "backward", "pos_emb")
        checkpointed = self.checkpointed
        for i in range(self.n_layers):
            if i in checkpointed:
                self._recomputed(i, c, shard, full)
            for part in ("attn", "mlp"):
                norm(f"blocks.{i}.{'ln1' if part == 'attn' else 'ln2'}")
                gathered_input(f"blocks.{i}.{part}")
                row_parallel(f"blocks.{i}.{part}.{'proj' if part == 'attn' else 'out'}")
        norm("ln_f")
        gathered_input("head")
        if self.loss_parallel:
            rows = b * t * (self.loss_dtype or self.dtype).itemsize
            for _ in range(3):
                c("all_reduce", rows, "forward", "loss")
            c("all_reduce", rows, "backward", "loss")
        else:
            c("all_gather", b * t * _ceil_div(self.vocab, k) * item, "forward", "head")
        return fwd + bwd

    def _recomputed(self, i: int, c, shard: int, full: int) -> None:
        """The collectives block ``i``'s recomputation re-issues in backward (see the
        class docstring's table)."""
        c("all_gather", shard, "backward", f"blocks.{i}.attn (recomputed)")
        c("reduce_scatter", full, "backward", f"blocks.{i}.attn.proj (recomputed)")
        c("all_gather", shard, "backward", f"blocks.{i}.mlp (recomputed)")
        if not self.checkpoint_early_stop:
            c("reduce_scatter", full, "backward", f"blocks.{i}.mlp.out (recomputed)")

    def by_mesh_dim(self) -> dict[tuple[str, str | int | None], tuple[int, int]]:
        """``{(kind, mesh_dim): (count, bytes)}`` of ``comms()``."""
        return summarize(self.comms())
