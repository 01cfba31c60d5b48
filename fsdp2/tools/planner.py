"""Memory planner: per-rank peak memory, communication and step cost of a sharded layout,
predicted from a model built on the meta device, without a training step.

``profile_model(model)`` reads the model once: every parameter's shape and dtype, which
``fully_shard`` group it falls in (one per transformer block, and the root), and what one
forward saves for backward, block by block (a forward of the meta model: no memory, no
data). ``estimate(profile, config)`` then predicts, for one :class:`PlanConfig` (mesh split,
wrapping, ``reshard_after_forward``, mixed precision, activation checkpointing, offload,
optimizer), the peak bytes of one rank by category and the collectives of one step;
``rank_configs`` enumerates the layouts of a world size and orders the ones that fit a
memory budget by predicted step time.

[Note: the memory model] Bytes of rank 0 (the largest shards when they are uneven), at
the steady state of training (the optimizer state exists, gradients were set to None by
``zero_grad``). The categories are the ones of the memory tracker (``fsdp2.tools.memory``):

* sharded parameters, sharded gradients and optimizer state: exact, from the shard sizes
  ``fully_shard`` builds (``torch.chunk`` rows of dim 0 of the tensor-parallel local
  tensor). AdamW keeps two tensors per parameter in its dtype plus a scalar step; SGD with
  momentum one; plain SGD none. The step's temporaries: the single-tensor AdamW that runs
  on CPU tensors makes two of the largest shard at once, the multi-tensor one (GPU) one of
  every shard.
* unsharded parameters in flight: the library's schedule (``fsdp2/_state.py``) gathers a
  block in its pre-forward and prefetches the next one, so two blocks are unsharded at once
  in forward and in backward (the block computing and the one prefetched), plus the root,
  which keeps its parameters from forward through backward. With
  ``reshard_after_forward=False`` every block keeps them until its backward.
* unsharded gradients: the block in backward, and the blocks whose reduction is still in
  flight (one on CPU, two on GPU: ``CommContext.max_pending``); the root's, from the start
  of backward (head) or its end (embeddings), as the trace saw the modules run.
* activations: what autograd saves, counted by a ``saved_tensors_hooks`` trace of the meta
  model (parameters excluded, each storage once), scaled linearly with the micro-batch.
  Attention is traced as the flash kernels save it (query, key, value, output and the
  log-sum-exp, never the ``t x t`` matrix). With activation checkpointing a block keeps
  only its input; its backward recomputes one block's activations. With tensor
  parallelism of degree ``t`` (sequence parallel between blocks) every saved tensor is
  ``1/t``: the inputs column-parallel modules gather are saved as their sequence shards
  and gathered again in backward (``dtensor/parallel/_regather.py``), one at a time; a
  style with ``regather_in_backward=False`` (PyTorch's behaviour) keeps them whole, and
  what is saved after a module whose output is replicated (the head's logits, unless
  ``loss_parallel``) is whole on every rank. Backward needs a working set on top: the
  gradient of the block's input and output and its largest intermediate gradient, taken
  as twice the block's largest saved tensor plus two block inputs (calibrated against the
  tracker, ``benchmarks/plan_validation.py``); the loss's backward needs twice the logits.
* communication buffers: the staged route (NCCL, small parameters on gloo) copies a
  group's shards into a row and gathers all rows (``shard_size`` rows on NCCL, twice on
  gloo: the all-to-all needs one copy per peer), and its reduction stages the gradient
  rows; the direct route on gloo stages only the ``shard_size - 1`` rows a reduction
  receives (and the reduce-dtype copy of gradients of another dtype).

The peak is the largest of these moments: the end of forward; the start of backward (the
loss's gradient); each block's backward, last to first (its activations and those before it,
the reduced shards of the blocks after it); the backward of the modules before the blocks
(the embeddings' dense gradient while the first blocks' reductions are in flight); the
root's own reduction; the optimizer step.

Example:
    >>> with torch.device("meta"):
    ...     model = GPT(GPTConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32))
    >>> profile = profile_model(model, seq_len=2048)
    >>> est = estimate(profile, PlanConfig(world_size=64))
    >>> est.peak_bytes / 2**30                                   # GiB on one rank
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import itertools
import logging
import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from dtensor.placement import padded_chunk_size
from fsdp2.tools.memory import CATEGORIES as _TRACKER_CATEGORIES

logger = logging.getLogger(__name__)

__all__ = [
    "Hardware",
    "H100",
    "CPU",
    "PlanConfig",
    "ModelProfile",
    "GroupLayout",
    "Estimate",
    "profile_model",
    "estimate",
    "rank_configs",
    "group_layouts",
    "collectives",
    "group_specs",
    "transformer_tp",
    "step_cost",
    "parse_bytes",
    "peak_bytes",
    "speed_then_memory",
    "tp_splits",
]

GiB = 1 << 30


# --------------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Hardware:
    """What one device computes and moves, for the step-cost model.

    Attributes:
        name: shown in tables.
        flops: dense peak FLOP/s of one device in the compute dtype.
        efficiency: the fraction of ``flops`` a transformer step reaches (MFU).
        intra_node_bw: bytes/s one device sends to peers in its node (bus bandwidth of a
            ring collective).
        inter_node_bw: bytes/s one device sends across nodes.
        devices_per_node: devices that share the fast intra-node links.
        memory: bytes of one device (the default budget), or None.
        device: ``"cuda"`` or ``"cpu"``: which collective routes and how many reductions
            in flight the memory model assumes.
        dtype_speed: ``((dtype name, speed), ...)``: compute dtypes that run at ``speed``
            times ``flops`` (the others at ``flops``).
        host_bw: bytes/s between the host and one device (CPU offload's copies).
        host_optimizer: parameters/s the optimizer step updates on the host under offload.
        overlap: whether FSDP's collectives overlap compute (separate streams and copy
            engines on GPUs); on a CPU the same cores do both, so they add up.
        collective_latency: seconds each tensor-parallel collective costs beyond its bytes
            (a redistribution's dispatch, copies and the messages' round trips: what makes
            many small collectives slow where few large ones are not).
        offload_allocator_factor: the same under CPU offload (None: ``allocator_factor``).
        allocator_overhead: bytes the allocator holds beyond ``allocator_factor`` times the
            live peak whatever the model (on CPU: the heap a step's first allocations grow).
        allocator_factor: what the allocator holds at the peak over the live tensor bytes
            the model predicts (the CUDA caching allocator's reserved bytes; on CPU the
            resident set above the process's baseline), measured.

    Example:
        >>> H100.flops / 1e12, H100.devices_per_node
        (989.0, 8)
        >>> replace(H100, inter_node_bw=25e9).inter_node_bw     # 200 Gb/s per GPU
        25000000000.0
    """

    name: str
    flops: float
    efficiency: float
    intra_node_bw: float
    inter_node_bw: float
    devices_per_node: int
    memory: int | None = None
    device: str = "cuda"
    dtype_speed: tuple = ()
    host_bw: float = 25e9
    host_optimizer: float = 1e9
    overlap: bool = True
    collective_latency: float = 0.0
    allocator_factor: float = 1.0
    allocator_overhead: int = 0
    offload_allocator_factor: float | None = None

    def speed(self, dtype: torch.dtype) -> float:
        """How fast a step computing in ``dtype`` runs, relative to ``flops``.

        Example:
            >>> H100.speed(torch.float32), H100.speed(torch.bfloat16)
            (0.5, 1.0)
        """
        name = _DTYPE_NAMES.get(dtype, str(dtype))
        return dict(self.dtype_speed).get(name, 1.0)


#: H100 SXM: 989 TFLOP/s dense bf16 at 40% MFU (fp32 as TF32, half of it), NVLink 4
#: (450 GB/s each way), one 400 Gb/s InfiniBand NIC per GPU (50 GB/s), 8 GPUs a node,
#: 81,559 MiB. Under CPU offload: 25 GB/s over PCIe and the host's AdamW at about 1e9
#: parameters/s, and the caching allocator reserving up to 1.35x the live bytes, 1.55x under
#: offload (seen on an H200 by benchmarks/gpu_check.py: 0.70B parameters, offload 1.04 s a
#: step against 0.13 s; reserved / allocated 1.11-1.34; an auto-plan's offload run on an
#: H100 reserved 1.52x).
H100 = Hardware(
    "H100 SXM (NVLink 450 GB/s, IB 50 GB/s)",
    989e12,
    0.4,
    450e9,
    50e9,
    8,
    81559 << 20,
    dtype_speed=(("fp32", 0.5),),
    allocator_factor=1.35,
    offload_allocator_factor=1.55,
    collective_latency=2e-5,
)
#: This kind of machine: gloo over loopback on a couple of shared cores: about 55 GFLOP/s a
#: rank in fp32 (GPTs of width 192-256 trained at 54-63 by the planner's FLOP count,
#: benchmarks/auto_plan_bench.py; width 128 at 24-30), 2 GB/s between processes, about 2.2
#: ms per tensor-parallel collective beyond its bytes (same benchmark: TP 2 took 0.378 s a
#: step where the bytes alone predict 12 ms of its collectives); a GPT step in bf16 ran 1.6x
#: faster than in fp32 (one thread; fp16 matmuls 35x slower); the resident set grew to
#: 1.35-1.56x the predicted live peak over the process's baseline (glibc keeps freed heap
#: resident), so the allocator factor is 1.6; small models' resident sets grew up to 3.4
#: MiB more (tests/test_auto_cases.py: a LoRA GPT of 9.8 MiB grew 19.1), and runs vary by up
#: to 8 MiB: 8 MiB more whatever the model.
CPU = Hardware(
    "CPU (gloo, loopback)",
    55e9,
    1.0,
    2e9,
    2e9,
    64,
    None,
    device="cpu",
    dtype_speed=(("bf16", 1.6), ("fp16", 0.03)),
    overlap=False,
    collective_latency=2.2e-3,
    allocator_factor=1.6,
    allocator_overhead=8 << 20,
)


# --------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class PlanConfig:
    """One layout of a training run over ``world_size`` ranks.

    The mesh is ``(dp_replicate, dp_shard, tp)`` with ``dp_shard = world_size /
    (dp_replicate * tp)`` (``fsdp2.parallelize_transformer``'s dim order: tensor
    parallelism innermost).

    Attributes:
        world_size: ranks in all.
        tp: tensor-parallel degree (1: none).
        dp_replicate: HSDP replicas (1: plain FSDP).
        blocks_per_group: transformer blocks per ``fully_shard`` call (1: one call per
            block; 0: a single call on the root, no per-block wrapping).
        reshard_after_forward: the blocks' ``reshard_after_forward`` (the root keeps its
            parameters, as ``fully_shard``'s default ``None`` does).
        activation_checkpointing: checkpoint every block (see ``checkpointed_blocks``).
        checkpointed_blocks: the indices of the blocks to checkpoint, when only some are
            (None: all of them with ``activation_checkpointing``, else none).
        keep_last_groups: the last this many block groups keep their gathered parameters
            from forward to backward (``reshard_after_forward=False`` for them, True for the
            others); the last group's backward starts right after forward, so keeping it
            saves one all-gather for one group's unsharded bytes.
        param_dtype / reduce_dtype: ``MixedPrecisionPolicy``'s (None: the parameters').
        offload: ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state on
            the host (not counted on the device; a CPU compute device ignores it).
        optimizer: ``"adamw"``, ``"sgd"`` (momentum) or ``"sgd-nomomentum"``.
        batch_size: sequences per data-parallel rank per step (``global / dp``), of the
            profile's ``seq_len`` tokens each.

    Example:
        >>> cfg = PlanConfig(world_size=64, tp=8, dp_replicate=2, param_dtype=torch.bfloat16)
        >>> cfg.dp_shard, cfg.dp
        (4, 8)
    """

    world_size: int
    tp: int = 1
    dp_replicate: int = 1
    blocks_per_group: int = 1
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    offload: bool = False
    optimizer: str = "adamw"
    batch_size: int = 1
    checkpointed_blocks: tuple[int, ...] | None = None
    keep_last_groups: int = 0

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "dp_replicate", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PlanConfig: {name} must be a positive int, got {value!r}.")
        if self.world_size % (self.tp * self.dp_replicate):
            raise ValueError(
                f"PlanConfig: world_size={self.world_size} is not divisible by tp * "
                f"dp_replicate = {self.tp} * {self.dp_replicate}."
            )
        if self.blocks_per_group < 0:
            raise ValueError(
                f"PlanConfig: blocks_per_group must be >= 0, got {self.blocks_per_group}."
            )
        if not isinstance(self.keep_last_groups, int) or self.keep_last_groups < 0:
            raise ValueError(
                f"PlanConfig: keep_last_groups must be an int >= 0, got {self.keep_last_groups!r}."
            )
        if self.checkpointed_blocks is not None:
            blocks = self.checkpointed_blocks
            if not isinstance(blocks, tuple) or any(
                not isinstance(b, int) or b < 0 for b in blocks
            ):
                raise ValueError(
                    "PlanConfig: checkpointed_blocks must be a tuple of block indices >= 0, "
                    f"got {blocks!r}."
                )
        if self.optimizer not in _OPTIMIZER_STATES:
            raise ValueError(
                f"PlanConfig: optimizer must be one of {sorted(_OPTIMIZER_STATES)}, got "
                f"{self.optimizer!r}."
            )

    @property
    def dp_shard(self) -> int:
        """Ranks one parameter is sharded over."""
        return self.world_size // (self.tp * self.dp_replicate)

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas times shards)."""
        return self.world_size // self.tp

    def checkpointed(self, n_blocks: int) -> frozenset[int]:
        """The indices of the checkpointed blocks among ``n_blocks``.

        Example:
            >>> PlanConfig(world_size=8, checkpointed_blocks=(0, 1)).checkpointed(4)
            frozenset({0, 1})
        """
        if self.checkpointed_blocks is not None:
            return frozenset(b for b in self.checkpointed_blocks if b < n_blocks)
        return frozenset(range(n_blocks)) if self.activation_checkpointing else frozenset()

    def reshards(self, group: int, n_groups: int) -> bool:
        """``reshard_after_forward`` of block group ``group`` of ``n_groups`` (the root's is
        False, as ``fully_shard``'s default resolves it).

        Example:
            >>> cfg = PlanConfig(world_size=8, keep_last_groups=1)
            >>> [cfg.reshards(j, 3) for j in range(3)]
            [True, True, False]
        """
        return self.reshard_after_forward and group < n_groups - self.keep_last_groups

    def describe(self) -> str:
        """A short label, e.g. ``"hsdp 2x4 tp8 ac bf16"``.

        Example:
            >>> PlanConfig(world_size=8, tp=2).describe()
            'fsdp 4 tp2'
        """
        parts = [
            f"hsdp {self.dp_replicate}x{self.dp_shard}"
            if self.dp_replicate > 1
            else f"fsdp {self.dp_shard}"
        ]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.blocks_per_group != 1:
            parts.append(
                "root-only" if self.blocks_per_group == 0 else f"{self.blocks_per_group}blk"
            )
        if not self.reshard_after_forward:
            parts.append("keep-fwd")
        elif self.keep_last_groups:
            parts.append(f"keep-last{self.keep_last_groups}")
        if self.checkpointed_blocks is not None:
            if self.checkpointed_blocks:
                parts.append(f"ac{len(self.checkpointed_blocks)}blk")
        elif self.activation_checkpointing:
            parts.append("ac")
        if self.param_dtype is not None:
            parts.append(_DTYPE_NAMES.get(self.param_dtype, str(self.param_dtype)))
        if self.offload:
            parts.append("offload")
        return " ".join(parts)


_OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "sgd-nomomentum": 0}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# --------------------------------------------------------------------------------- profile
@dataclass
class ParamInfo:
    """One parameter: its name, global shape, dtype, whether it trains, its block (None:
    the root's), the dim tensor parallelism shards (None: replicated or no plan), and when
    its module first runs relative to the blocks (``"pre"``, ``"block"``, ``"post"``)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    block: int | None
    tp_dim: int | None = None
    phase: str = "post"


@dataclass
class SavedTensor:
    """One storage autograd saved in the traced forward (batch of one)."""

    nbytes: int
    region: int | None  # block index, or None outside the blocks
    whole_under_tp: bool  # the input of a column-parallel module
    phase: str  # "pre", "block", "post"


@dataclass
class ModelProfile:
    """What the planner reads from a model once (``profile_model``).

    Example:
        >>> profile = profile_model(model, seq_len=128)
        >>> profile.n_blocks, profile.num_params
    """

    params: list[ParamInfo]
    n_blocks: int
    seq_len: int
    hidden: int
    n_layers: int
    saved: dict  # compute dtype -> list[SavedTensor] (batch 1, seq_len)
    block_inputs: dict  # compute dtype -> bytes of one block's input (batch 1)
    model: nn.Module = field(repr=False)
    blocks: list = field(repr=False)
    forward_fn: object = field(repr=False, default=None)
    tp_plan: dict | None = field(repr=False, default=None)
    cache: dict = field(repr=False, default_factory=dict)  # layouts and collectives, by key

    @property
    def num_params(self) -> int:
        """Parameters of the model (tied ones once)."""
        return sum(math.prod(p.shape) for p in self.params)

    def saved_for(self, dtype: torch.dtype) -> list[SavedTensor]:
        """The activation trace in compute dtype ``dtype`` (traced on first use)."""
        if dtype not in self.saved:
            self.saved[dtype], self.block_inputs[dtype] = _trace_activations(
                self.model, self.blocks, self.seq_len, dtype, self.forward_fn, self.tp_plan
            )
        return self.saved[dtype]


def profile_model(
    model: nn.Module,
    *,
    seq_len: int | None = None,
    blocks=None,
    tp_plan: dict | None = None,
    forward_fn=None,
) -> ModelProfile:
    """Read ``model`` (best built under ``torch.device("meta")``) for the planner.

    Args:
        model: the model, unsharded. On meta nothing is allocated; a model with real
            parameters is copied to meta for the activation trace.
        seq_len: tokens per sequence (default: ``cfg.max_seq_len`` /
            ``config.max_position_embeddings`` capped at 4096, else 2048).
        blocks: the transformer blocks (default ``model.blocks`` / ``model.layers`` /
            ``model.model.layers``), each one ``fully_shard`` group.
        tp_plan: a ``parallelize_module`` plan, for layouts with ``tp > 1`` (the styles'
            class names decide: ``ColwiseParallel`` shards a Linear's weight and bias on
            dim 0 and an Embedding's on dim 1, ``RowwiseParallel`` a Linear's weight on
            dim 1 and an Embedding's on dim 0).
        forward_fn: ``forward_fn(model, idx) -> loss`` for the activation trace (default:
            cross-entropy of the logits in fp32, as ``examples.gpt.gpt_loss``).

    Raises:
        ValueError: no blocks found, or a model without parameters.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(dim=512, n_layers=8, n_heads=8))
        >>> profile_model(model, seq_len=256).n_blocks
        8
    """
    blocks = _find_blocks(model, blocks)
    if seq_len is None:
        seq_len = _default_seq_len(model)
    meta = model
    if not _on_meta(model):
        meta, blocks = _copy_with_blocks(model, blocks)
        meta = meta.to("meta")
    params = _param_infos(meta, blocks, seq_len, tp_plan, forward_fn)
    if not params:
        raise ValueError("profile_model: the model has no parameters.")
    hidden, n_layers = _hidden_and_layers(meta, blocks)
    return ModelProfile(
        params=params,
        n_blocks=len(blocks),
        seq_len=seq_len,
        hidden=hidden,
        n_layers=n_layers,
        saved={},
        block_inputs={},
        model=meta,
        blocks=blocks,
        forward_fn=forward_fn,
        tp_plan=tp_plan,
    )


def _param_infos(meta: nn.Module, blocks, seq_len: int, tp_plan, forward_fn) -> list[ParamInfo]:
    """A ``ParamInfo`` for every parameter of the meta model (a tied one once, under its
    first name)."""
    block_of = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            block_of.setdefault(id(p), i)
    tp_dims = _tp_dims(meta, tp_plan)
    phases = _param_phases(meta, blocks, seq_len, forward_fn)
    params, seen = [], set()
    for name, p in meta.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params.append(
            ParamInfo(
                fqn=name,
                shape=tuple(p.shape),
                dtype=p.dtype,
                requires_grad=p.requires_grad,
                block=block_of.get(id(p)),
                tp_dim=tp_dims.get(id(p)),
                phase=phases.get(id(p), "post"),
            )
        )
    return params


def _find_blocks(model: nn.Module, blocks) -> list[nn.Module]:
    if blocks is not None:
        return list(blocks)
    for path in ("blocks", "layers", "model.layers", "transformer.h"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if isinstance(obj, (nn.ModuleList, nn.Sequential)):
            return list(obj)
    raise ValueError(
        "profile_model: found no transformer blocks (model.blocks, model.layers, "
        "model.model.layers or model.transformer.h); pass blocks=[...]."
    )


def _config_of(model):
    return getattr(model, "cfg", None) or getattr(model, "config", None)


def _default_seq_len(model) -> int:
    cfg = _config_of(model)
    for name in ("max_seq_len", "max_position_embeddings", "n_positions"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return min(value, 4096)
    return 2048


def _on_meta(model: nn.Module) -> bool:
    return all(p.device.type == "meta" for p in model.parameters())


def _copy_with_blocks(model: nn.Module, blocks, dtype=None):
    """A deep copy of ``model`` (cast to ``dtype``) and its blocks, found by position."""
    positions = {id(m): i for i, m in enumerate(model.modules())}
    where = [positions[id(b)] for b in blocks]
    clone = copy.deepcopy(model)
    if dtype is not None:
        clone = clone.to(dtype)
    mods = list(clone.modules())
    return clone, [mods[i] for i in where]


def _hidden_and_layers(model, blocks) -> tuple[int, int]:
    cfg = _config_of(model)
    hidden = 0
    for name in ("dim", "hidden_size", "n_embd", "d_model"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            hidden = value
            break
    if not hidden:  # the widest 2-D weight's smaller side
        shapes = [p.shape for p in blocks[0].parameters() if p.ndim == 2]
        hidden = min(max(shapes, key=math.prod)) if shapes else 0
    return hidden, len(blocks)


# --------------------------------------------------------------------------------- TP layout
def _style_name(style) -> str:
    return type(style).__name__


def _matches(pattern: str, name: str) -> bool:
    pa, na = pattern.split("."), name.split(".")
    return len(pa) == len(na) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(pa, na))


def _planned(model: nn.Module, tp_plan: dict | None):
    """``(module name, module, style class name)`` of every module ``tp_plan`` names."""
    if not tp_plan:
        return []
    out = []
    for name, m in model.named_modules():
        for pattern, style in tp_plan.items():
            if name and _matches(pattern, name):
                out.append((name, m, _style_name(style)))
    return out


def _tp_dims(model: nn.Module, tp_plan: dict | None) -> dict[int, int]:
    """``{id(param): dim}`` tensor parallelism shards (PyTorch's Colwise/Rowwise rules)."""
    dims: dict[int, int] = {}
    for _name, m, style in _planned(model, tp_plan):
        emb = isinstance(m, nn.Embedding)
        for attr, p in m._parameters.items():
            if p is None:
                continue
            if style == "ColwiseParallel":
                dims[id(p)] = 1 if emb else 0
            elif style == "RowwiseParallel" and (emb or attr == "weight"):
                dims[id(p)] = 0 if emb else 1
    return dims


# --------------------------------------------------------------------------------- tracing
def _default_forward(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None:
        logits = out[0]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), idx.reshape(-1))


def _vocab_size(model) -> int:
    cfg = _config_of(model)
    value = getattr(cfg, "vocab_size", None)
    if isinstance(value, int):
        return value
    emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return emb[0].num_embeddings if emb else 2


@contextlib.contextmanager
def _flash_attention():
    """Trace ``F.scaled_dot_product_attention`` of meta tensors as the fused kernels save
    it, for every call (grouped-query, masked, causal): query, key, value, output and an
    fp32 log-sum-exp, never the ``t x t`` matrix the math path would save
    (``fsdp2/tools/_meta_attention.py``). Calls on real tensors are unchanged."""
    from fsdp2.tools._meta_attention import fused_attention_on_meta

    with fused_attention_on_meta():
        yield


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _param_phases(model, blocks, seq_len: int, forward_fn) -> dict[int, str]:
    """When each parameter's module first runs: before the blocks, in them, or after."""
    # cheap: a forward of the meta model at batch 1, in its own dtype, no autograd
    phases: dict[int, str] = {}
    state = {"phase": "pre"}
    block_ids = {id(b) for b in blocks}
    handles = []

    def pre(module, args):
        if id(module) in block_ids:
            state["phase"] = "block"
        for p in module.parameters(recurse=False):
            phases.setdefault(id(p), state["phase"])

    def post(module, args, out):
        if id(module) in block_ids:
            state["phase"] = "post"

    for m in model.modules():
        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        idx = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
        with torch.no_grad(), _flash_attention():
            (forward_fn or _default_forward)(model, idx)
    finally:
        for h in handles:
            h.remove()
    return phases


class _ActivationTrace:
    """The hooks of one activation trace and what they record: where the forward is (the
    block, or before or after the blocks; whether after a module whose output every tp rank
    holds whole), each storage autograd saves there, and the storages column-parallel
    modules take as input."""

    def __init__(self, model: nn.Module, blocks) -> None:
        self.param_keys = {_storage_key(p) for p in model.parameters()}
        self.block_index = {id(b): i for i, b in enumerate(blocks)}
        self.col_inputs: set[int] = set()
        self.block: int | None = None
        self.phase = "pre"
        self.whole = False
        self.saved: dict[int, SavedTensor] = {}
        self.block_input = 0  # bytes of one block's input

    def block_pre(self, module, args) -> None:
        self.block = self.block_index[id(module)]
        self.phase = "block"
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None:
            self.block_input = x.numel() * x.element_size()

    def block_post(self, module, args, out) -> None:
        self.block = None
        self.phase = "post"

    def col_pre(self, module, args) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self.col_inputs.add(_storage_key(a))

    def replicated_out(self, module, args, out) -> None:
        self.whole = True

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.param_keys and key not in self.saved:
            self.saved[key] = SavedTensor(
                t.untyped_storage().nbytes(), self.block, self.whole, self.phase
            )
        return t

    def register(self, model: nn.Module, blocks, tp_plan) -> list:
        """Hook the blocks, the column-parallel modules and the modules outside the blocks
        whose output is replicated; the hooks' handles."""
        handles = []
        for b in blocks:
            handles += [
                b.register_forward_pre_hook(self.block_pre),
                b.register_forward_hook(self.block_post),
            ]
        for _name, m, style in _planned(model, tp_plan):
            if style == "ColwiseParallel":
                handles.append(m.register_forward_pre_hook(self.col_pre))
        for m in _replicated_outside_blocks(model, blocks, tp_plan):
            handles.append(m.register_forward_hook(self.replicated_out))
        return handles


def _replicated_outside_blocks(model: nn.Module, blocks, tp_plan) -> list[nn.Module]:
    """The modules outside the blocks that ``tp_plan`` gives a ``Replicate`` output (a module
    whose output every tp rank holds whole), once per matching plan entry."""
    out = []
    for pattern, style in (tp_plan or {}).items():
        layouts = getattr(style, "output_layouts", None)
        layouts = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
        if any(type(pl).__name__ == "Replicate" for pl in layouts):
            for name, m in model.named_modules():
                if (
                    name
                    and _matches(pattern, name)
                    and not any(m is b or _is_inside(m, b) for b in blocks)
                ):
                    out.append(m)
    return out


def _regathers_in_backward(tp_plan) -> bool:
    """Whether a style of ``tp_plan`` gathers its saved sequence shards again in backward."""
    return any(
        bool(getattr(style, "regather_in_backward", False)) for style in (tp_plan or {}).values()
    )


def _trace_activations(model, blocks, seq_len, dtype, forward_fn, tp_plan):
    """Every storage autograd saves in one forward at batch 1 in ``dtype``, tagged with
    the block (or none) it was saved in; and the bytes of one block's input."""
    if any(p.dtype != dtype for p in model.parameters() if p.is_floating_point()):
        model, blocks = _copy_with_blocks(model, blocks, dtype)
    trace = _ActivationTrace(model, blocks)
    handles = trace.register(model, blocks, tp_plan)
    regather = _regathers_in_backward(tp_plan)
    try:
        idx = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(trace.pack, lambda t: t), _flash_attention():
            (forward_fn or _default_forward)(model, idx)
    finally:
        for h in handles:
            h.remove()
    for key, s in trace.saved.items():
        s.whole_under_tp = s.whole_under_tp or (key in trace.col_inputs and not regather)
    return list(trace.saved.values()), trace.block_input


def _is_inside(m: nn.Module, block: nn.Module) -> bool:
    return any(m is sub for sub in block.modules())


# --------------------------------------------------------------------------------- layout
@dataclass
class GroupLayout:
    """One ``fully_shard`` group on rank 0: its parameters' shard elements, the padded
    elements of one rank's row of its collectives, and the unsharded (padded) elements.

    Example:
        >>> [g.shard_numel for g in estimate(profile, cfg).groups][:2]
    """

    name: str
    params: list[ParamInfo]
    shard_numel: int  # rank 0's elements at rest
    row_numel: int  # padded elements one rank contributes to the group's all-gather
    unsharded_numel: int  # padded elements of the gathered parameters (shard_size * row)
    largest_shard_numel: int
    itemsize: int  # of the parameters at rest
    blocks: tuple[int, ...] = ()  # the transformer blocks in the group (none: the root)
    trained_shard_numel: int = 0  # of those, the parameters that train (have gradients)
    trained_row_numel: int = 0
    n_trained: int = 0


def _first_chunk(size: int, n: int) -> int:
    """Rank 0's share of a dim of ``size`` split ``torch.chunk``-style into ``n``."""
    return min(padded_chunk_size(size, n), size)


def group_layouts(profile: ModelProfile, cfg: PlanConfig) -> list[GroupLayout]:
    """The ``fully_shard`` groups of ``cfg`` (root first, then the blocks in order) with
    rank 0's shard sizes, as ``fully_shard`` builds them (``torch.chunk`` rows of dim 0
    of the tensor-parallel local tensor; ``tp`` chunks the tensor-parallel dim first).

    Example:
        >>> [g.name for g in group_layouts(profile, PlanConfig(world_size=8))][:2]
        ['root', 'blocks[0]']
    """
    key = ("groups", cfg.tp, cfg.dp_shard, cfg.blocks_per_group)
    cached = profile.cache.get(key)
    if cached is None:
        cached = profile.cache[key] = _group_layouts(profile, cfg)
    return cached


def _group_layouts(profile: ModelProfile, cfg: PlanConfig) -> list[GroupLayout]:
    k = cfg.blocks_per_group
    members: dict[str, list[ParamInfo]] = {"root": []}
    spans: dict[str, tuple[int, ...]] = {"root": ()}
    for p in profile.params:
        if p.block is None or k == 0:
            members["root"].append(p)
        else:
            lo = p.block // k * k
            hi = min(lo + k, profile.n_blocks) - 1
            name = f"blocks[{lo}]" if hi == lo else f"blocks[{lo}-{hi}]"
            members.setdefault(name, []).append(p)
            spans[name] = tuple(range(lo, hi + 1))
    out = []
    for name, params in members.items():
        if not params:
            continue
        shard = row = largest = t_shard = t_row = 0
        for p in params:
            local = list(p.shape)
            if cfg.tp > 1 and p.tp_dim is not None:
                local[p.tp_dim] = _first_chunk(local[p.tp_dim], cfg.tp)
            rows = local[0]
            per_row = math.prod(local[1:])
            mine = _first_chunk(rows, cfg.dp_shard) * per_row
            padded = padded_chunk_size(rows, cfg.dp_shard) * per_row
            shard += mine
            largest = max(largest, mine)
            row += padded
            if p.requires_grad:
                t_shard += mine
                t_row += padded
        out.append(
            GroupLayout(
                name=name,
                params=params,
                shard_numel=shard,
                row_numel=row,
                unsharded_numel=row * cfg.dp_shard,
                largest_shard_numel=largest,
                itemsize=params[0].dtype.itemsize,
                blocks=spans[name],
                trained_shard_numel=t_shard,
                trained_row_numel=t_row,
                n_trained=sum(p.requires_grad for p in params),
            )
        )
    return out


# --------------------------------------------------------------------------------- estimate
#: The memory tracker's categories (``fsdp2.tools.memory``), less its ``other`` (module
#: buffers): ``temporaries`` are what backward and the optimizer step make and drop.
CATEGORIES = tuple(c for c in _TRACKER_CATEGORIES if c != "other")


@dataclass
class Estimate:
    """The planner's prediction for one configuration on one rank (rank 0).

    Attributes:
        config: the configuration.
        peak_bytes: the predicted peak of live tensor bytes.
        peak_phase: the moment of the peak (``"forward"``, ``"backward start"``,
            ``"backward blocks[i]"``, ``"backward end"``, ``"root reduction"``,
            ``"optimizer"``).
        categories: bytes by category at the peak (``CATEGORIES``).
        phases: ``{phase: {category: bytes}}`` for every moment considered.
        groups: the ``fully_shard`` groups and their shard sizes.
        collectives: ``{(kind, mesh dim): (count, bytes per rank)}`` for one step.
        compute_s / comm_s / step_s: the step-cost model (seconds, see ``step_cost``).

    Example:
        >>> est = estimate(profile, PlanConfig(world_size=8))
        >>> est.peak_phase, sorted(est.categories)[:2]
    """

    config: PlanConfig
    peak_bytes: int
    peak_phase: str
    categories: dict
    phases: dict
    groups: list
    collectives: dict
    compute_s: float = 0.0
    comm_s: float = 0.0
    step_s: float = 0.0

    hardware: Hardware | None = None

    @property
    def peak_gib(self) -> float:
        """``peak_bytes`` in GiB."""
        return self.peak_bytes / GiB

    @property
    def allocator_bytes(self) -> int:
        """What the allocator is expected to hold at the peak (the CUDA caching allocator's
        reserved bytes; on CPU the resident set above the process's baseline): the live
        peak times the hardware's measured ``allocator_factor``."""
        hw = self.hardware
        if hw is None:
            return self.peak_bytes
        factor = hw.allocator_factor
        if self.config.offload and hw.offload_allocator_factor is not None:
            factor = hw.offload_allocator_factor
        return int(self.peak_bytes * factor) + hw.allocator_overhead


def estimate(
    profile: ModelProfile, cfg: PlanConfig, hardware: Hardware = H100, *, device: str | None = None
) -> Estimate:
    """Predict ``cfg``'s per-rank peak memory, collectives and step time.

    Args:
        profile: from ``profile_model``.
        cfg: the layout.
        hardware: bandwidths and FLOP/s for the step cost (``H100`` or ``CPU``).
        device: ``"cuda"`` or ``"cpu"``: the collective routes and reductions in flight
            (default: ``hardware.device``).

    Raises:
        ValueError: a tensor-parallel ``cfg`` for a profile without ``tp_plan``.

    Example:
        >>> est = estimate(profile, PlanConfig(world_size=64, param_dtype=torch.bfloat16))
        >>> f"{est.peak_gib:.1f} GiB at {est.peak_phase}"
    """
    device = device or hardware.device
    if cfg.tp > 1 and not profile.tp_plan:
        raise ValueError(
            f"estimate: tp={cfg.tp} needs the profile's tp_plan (profile_model(..., "
            "tp_plan=...)), which says which parameters tensor parallelism shards."
        )
    groups = group_layouts(profile, cfg)
    mem = _memory(profile, cfg, groups, device)
    peak_phase = max(mem, key=lambda ph: sum(mem[ph].values()))
    est = Estimate(
        config=cfg,
        peak_bytes=int(sum(mem[peak_phase].values())),
        peak_phase=peak_phase,
        categories=dict(mem[peak_phase]),
        phases=mem,
        groups=groups,
        collectives=_cached_collectives(profile, cfg, groups, device),
        hardware=hardware,
    )
    est.compute_s, est.comm_s, est.step_s = step_cost(profile, cfg, est, hardware)
    return est


def _cached_collectives(profile: ModelProfile, cfg: PlanConfig, groups, device: str) -> dict:
    """``collectives`` of ``cfg``, once per configuration that changes them."""
    tp_dependent = (cfg.batch_size, cfg.checkpointed(profile.n_blocks)) if cfg.tp > 1 else ()
    key = ("comms", device, *tp_dependent, replace(cfg, batch_size=1, offload=False,
           activation_checkpointing=False, checkpointed_blocks=None))  # fmt: skip
    out = profile.cache.get(key)
    if out is None:
        out = profile.cache[key] = collectives(profile, cfg, groups, device=device)
    return out


def peak_bytes(
    profile: ModelProfile, cfg: PlanConfig, hardware: Hardware = H100, *, device: str | None = None
) -> int:
    """The predicted peak of ``cfg`` alone (``estimate(...).peak_bytes`` without the
    collectives and the step cost: what a search calls many times).

    Example:
        >>> peak_bytes(profile, PlanConfig(world_size=8)) == estimate(profile, PlanConfig(world_size=8)).peak_bytes
        True
    """
    device = device or hardware.device
    mem = _memory(profile, cfg, group_layouts(profile, cfg), device)
    return int(max(sum(m.values()) for m in mem.values()))


def _memory(profile: ModelProfile, cfg: PlanConfig, groups, device: str) -> dict:
    """``{phase: {category: bytes}}`` ([Note: the memory model])."""
    step = _StepMemory(profile, cfg, groups, device)
    return _by_category(step.moments(), step.rest.sharded, step.rest.optimizer_state)


def _trains(g: GroupLayout) -> bool:
    return any(p.requires_grad for p in g.params)


@dataclass
class _StateAtRest:
    """The bytes on the device between steps, and the optimizer step's temporaries."""

    sharded: int  # parameter shards
    grads: int  # gradient shards, once backward is done
    optimizer_state: int
    step_temporaries: int


def _state_at_rest(
    profile: ModelProfile, cfg: PlanConfig, groups, device: str, offloaded: bool
) -> _StateAtRest:
    """Parameter and gradient shards, optimizer state and the optimizer step's temporaries
    on the device (none of them when offloaded)."""
    sharded = sum(g.shard_numel * g.itemsize for g in groups)
    trainable = sum(g.trained_shard_numel * g.itemsize for g in groups)
    n_trained = sum(p.requires_grad for p in profile.params)
    opt = _OPTIMIZER_STATES[cfg.optimizer] * trainable
    if cfg.optimizer == "adamw":
        opt += 4 * n_trained  # the step counters (0-d float32 tensors)
    if device == "cpu":  # single-tensor AdamW: two temporaries of one shard at a time
        opt_temp = 2 * max(g.largest_shard_numel * g.itemsize for g in groups)
    else:  # multi-tensor AdamW: one temporary per shard
        opt_temp = trainable
    if cfg.optimizer != "adamw":
        opt_temp = 0
    if offloaded:
        return _StateAtRest(0, 0, 0, 0)
    return _StateAtRest(sharded, trainable, opt, opt_temp)


@dataclass
class _Activations:
    """The bytes of the activations of one micro-batch (``cfg.batch_size``), by region."""

    pre: float  # saved before the blocks
    post: float  # saved after the blocks
    post_big: float  # the largest of those
    per_block: list[float]  # saved in each block
    biggest: list[float]  # the largest saved in each block
    block_in: float  # one block's input (sequence-sharded between blocks under tp)
    gathered: float  # under tp: a gathered input, alive again while backward re-gathers it
    kept: list[float]  # what each block keeps until its backward (its input under AC)
    checkpointed: frozenset = frozenset()  # the blocks recomputed in backward
    kept_before: list[float] = field(default_factory=list)  # sum(kept[:i]) for each i


def _activations(profile: ModelProfile, cfg: PlanConfig, compute: torch.dtype) -> _Activations:
    """The traced activations in dtype ``compute``, scaled to the batch and to ``tp``."""
    b, tp = cfg.batch_size, cfg.tp
    per_block = [0.0] * profile.n_blocks
    biggest = [0.0] * profile.n_blocks
    pre = post = post_big = 0.0
    for s in profile.saved_for(compute):
        a = s.nbytes * b * (1.0 if s.whole_under_tp or tp == 1 else 1.0 / tp)
        if s.region is not None:
            per_block[s.region] += a
            biggest[s.region] = max(biggest[s.region], a)
        elif s.phase == "pre":
            pre += a
        else:
            post += a
            post_big = max(post_big, a)
    block_in = profile.block_inputs[compute] * b / tp  # sequence-sharded between blocks
    gathered = block_in * tp if tp > 1 else 0.0
    ac = cfg.checkpointed(profile.n_blocks)
    kept = [block_in if i in ac else per_block[i] for i in range(profile.n_blocks)]
    acts = _Activations(pre, post, post_big, per_block, biggest, block_in, gathered, kept, ac)
    acts.kept_before = list(itertools.accumulate(kept, initial=0.0))
    return acts


@dataclass
class _GroupBytes:
    """What a ``fully_shard`` group holds besides its shards under one configuration: its
    unsharded parameters and gradients, and the buffers of its collectives."""

    cfg: PlanConfig
    root: GroupLayout | None
    c_item: int  # bytes of one element in the compute dtype
    r_item: int  # in the reduce dtype
    trivial: bool  # one data-parallel rank and no cast: nothing gathered, grads in place
    offloaded: bool
    gloo: bool

    def unsharded(self, g) -> int:
        return 0 if self.trivial or g is None else g.unsharded_numel * self.c_item

    def ugrads(self, g) -> int:
        return 0 if g is None else g.trained_row_numel * self.cfg.dp_shard * self.c_item

    def grad_shards(self, gs) -> int:
        """The gradient shards of the groups ``gs`` that train, on the device."""
        if self.offloaded:
            return 0
        return sum(g.trained_shard_numel * g.itemsize for g in gs)

    def direct(self, g, itemsize: int) -> bool:
        """Whether gloo sends ``g``'s collectives by the direct route (large parameters)."""
        return self.gloo and g.unsharded_numel * itemsize >= (1 << 20) * len(g.params)

    def pooled(self, g, nbytes: int) -> int:
        """A CPU buffer from the root's pool (groups of the blocks, whose shapes repeat)
        is a whole number of huge pages with some headroom (``BufferPool.get``)."""
        if not self.gloo or g is self.root:
            return nbytes
        return -(-(nbytes + (64 << 10)) // (2 << 20)) * (2 << 20)

    def gather_buffers(self, g) -> int:
        if self.trivial or g is None or self.direct(g, self.c_item):
            return 0
        shard, c_item = self.cfg.dp_shard, self.c_item
        rows_in = shard if self.gloo else 1  # the all-to-all sends one copy per peer
        return self.pooled(g, rows_in * g.row_numel * c_item) + self.pooled(
            g, shard * g.row_numel * c_item
        )

    def reduce_buffers(self, g) -> int:
        """What one reduction in flight holds besides the unsharded gradients."""
        if self.trivial or g is None or not _trains(g):
            return 0
        width = (g.trained_row_numel + g.n_trained) * self.r_item  # values, a flag each
        if self.direct(g, self.r_item):
            unsharded = g.trained_row_numel * self.cfg.dp_shard
            cast = unsharded * self.r_item if self.r_item != self.c_item else 0
            return self.pooled(g, (self.cfg.dp_shard - 1) * width) + cast
        rows = self.pooled(g, self.cfg.dp_shard * width)  # the gradient rows, cast on the way
        if self.gloo:  # the all-to-all receives as many
            return 2 * rows
        return rows + width

    def held_grads(self, g) -> int:
        """Unsharded gradients a reduction in flight still holds (a cast copy replaces
        them on the direct route; the staged route copied them into its rows)."""
        if self.trivial or g is None or not _trains(g):
            return 0
        if self.direct(g, self.r_item) and self.r_item == self.c_item:
            return self.ugrads(g)
        return 0


class _StepMemory:
    """The moments of one step ([Note: the memory model]), each as ``{category: bytes}``
    of the categories that change over the step."""

    def __init__(self, profile: ModelProfile, cfg: PlanConfig, groups, device: str) -> None:
        own = groups[0].params[0].dtype
        compute = cfg.param_dtype or own
        reduce_dtype = cfg.reduce_dtype or compute
        offloaded = cfg.offload and device != "cpu"
        gloo = device == "cpu"
        self.cfg = cfg
        self.pending = 1 if gloo else 2  # CommContext.max_pending
        self.root = groups[0] if groups[0].name == "root" else None
        self.blocks = [g for g in groups if g.name != "root"]
        n = len(self.blocks)
        self.raf = [cfg.reshards(j, n) for j in range(n)]
        trivial = cfg.dp == 1 and compute == own
        self.g = _GroupBytes(
            cfg, self.root, compute.itemsize, reduce_dtype.itemsize, trivial, offloaded, gloo
        )
        self.rest = _state_at_rest(profile, cfg, groups, device, offloaded)
        self.acts = _activations(profile, cfg, compute)
        self.tp_workspace = self._tp_workspace(profile, compute)
        # the group whose gathers size the buffers: the largest block
        self.ref = max(self.blocks, key=lambda g: g.unsharded_numel) if self.blocks else self.root
        self.root_u = self.g.unsharded(self.root)
        self.root_post = self._root_post_grads()
        self.grads_key = "sharded_grads" if trivial else "unsharded_grads"

    def _root_post_grads(self) -> int:
        """The root's gradients that exist from the start of backward: those of the modules
        that ran after the blocks (the head); the others (the embeddings) only at its end."""
        root = self.root
        if root is None:
            return 0
        share = sum(math.prod(p.shape) for p in root.params if p.phase == "post")
        total = sum(math.prod(p.shape) for p in root.params) or 1
        return int(self.g.ugrads(root) * share / total)

    def moments(self) -> dict:
        """``{phase: {category: bytes}}`` in the order of a step."""
        phases = self.forward_moments()
        for i in range(len(self.blocks) - 1, -1, -1):
            phases[f"backward {self.blocks[i].name}"] = self.block_backward(i)
        phases.update(self.backward_end_moments())
        phases["optimizer"] = {
            "sharded_grads": self.rest.grads,
            "optimizer_state": self.rest.optimizer_state,
            "temporaries": self.rest.step_temporaries,
        }
        if self.tp_workspace:  # kept from step to step: there at every moment
            for cats in phases.values():
                cats["comm_buffers"] = cats.get("comm_buffers", 0) + self.tp_workspace
        return phases

    def _tp_workspace(self, profile: ModelProfile, compute: torch.dtype) -> int:
        """The buffers tensor parallelism's collective workspace keeps on a CPU
        ([Note: collective workspace] in ``dtensor/_workspace.py``): measured on gloo with
        the GPT's sequence-parallel plan, three full activations of the micro-batch (four
        when blocks are checkpointed) and two fp32 logits, whatever the depth, within the
        workspace's budget; none on a GPU (the workspace keeps host buffers only)."""
        cfg = self.cfg
        if cfg.tp == 1 or not self.g.gloo:
            return 0
        from dtensor import Workspace

        def kept(nbytes: int) -> int:  # the workspace keeps buffers of these sizes only
            return nbytes if Workspace.MIN_BYTES <= nbytes <= Workspace.MAX_BYTES else 0

        tokens = cfg.batch_size * profile.seq_len
        full = kept(tokens * profile.hidden * compute.itemsize)
        logits = kept(tokens * _vocab_size(profile.model) * 4)
        n_full = 4 if cfg.checkpointed(profile.n_blocks) else 3
        return min(n_full * full + 2 * logits, Workspace.DEFAULT_BUDGET)

    def forward_moments(self) -> dict:
        """The end of forward, and the start of backward (the loss's gradient)."""
        g, a, blocks = self.g, self.acts, self.blocks
        kept = [b for b, raf in zip(blocks, self.raf, strict=True) if not raf]
        after_forward = sum(g.unsharded(b) for b in kept)
        # the last block (gathered again, or kept) and the one its backward prefetches
        last = [b for b, raf in zip(blocks[-2:], self.raf[-2:], strict=True) if raf]
        in_flight = after_forward + sum(g.unsharded(b) for b in last)
        return {
            "forward": {
                "unsharded_params": self.root_u + after_forward,
                "activations": a.pre + sum(a.kept) + a.post,
                "comm_buffers": g.gather_buffers(self.ref),
            },
            "backward start": {
                "unsharded_params": self.root_u + in_flight,
                self.grads_key: self.root_post,
                "activations": a.pre + sum(a.kept) + a.post,
                "temporaries": 2 * a.post_big,
                "comm_buffers": g.gather_buffers(self.ref),
            },
        }

    def block_backward(self, i: int) -> dict:
        """Block ``i``'s backward: it and the block prefetched are unsharded, the blocks
        after it are reduced (but the ``pending`` latest, whose reductions are in flight),
        the blocks before it still hold their activations."""
        g, a, blocks = self.g, self.acts, self.blocks
        queued = blocks[i + 1 : i + 1 + self.pending]
        # groups kept since forward, and the group computing and the one prefetched
        gathered_now = sum(
            g.unsharded(b) for j, b in enumerate(blocks[: i + 1]) if not self.raf[j] or j >= i - 1
        )
        # the group's worst moment: the backward of its last block (the group's other
        # blocks still hold what they kept). Backward's working set in a block: the
        # gradients of its input and output, and of its largest intermediate (twice); the
        # recomputed block when it is checkpointed
        last = blocks[i].blocks[-1] if blocks[i].blocks else i
        ac = last in a.checkpointed
        return {
            "unsharded_params": self.root_u + gathered_now,
            **self._block_grads(i, queued),
            "activations": a.pre + a.kept_before[last] + (0 if ac else a.per_block[last]),
            "temporaries": 2 * a.biggest[last]
            + 2 * a.block_in
            + a.gathered
            + (a.per_block[last] if ac else 0),
            "comm_buffers": g.gather_buffers(self.ref) + sum(g.reduce_buffers(b) for b in queued),
        }

    def _block_grads(self, i: int, queued) -> dict:
        """The gradients during block ``i``'s backward, the blocks ``queued`` reducing."""
        g, blocks = self.g, self.blocks
        if g.trivial:  # gradients land in .grad at once, whole
            return {"sharded_grads": self.root_post + sum(g.ugrads(b) for b in blocks[i:])}
        return {
            "sharded_grads": g.grad_shards(blocks[i + 1 + self.pending :]),
            "unsharded_grads": self.root_post
            + g.ugrads(blocks[i])
            + sum(g.held_grads(b) for b in queued),
        }

    def backward_end_moments(self) -> dict:
        """The backward of the modules before the blocks (embeddings), the first blocks'
        reductions still in flight: their dense gradient is built, then accumulated; then
        the root's own reduction. None without a root."""
        root, g, blocks = self.root, self.g, self.blocks
        if root is None:
            return {}
        queued = blocks[: self.pending]
        if g.trivial:
            grads = {"sharded_grads": g.ugrads(root) + sum(g.ugrads(b) for b in blocks)}
        else:
            grads = {
                "sharded_grads": g.grad_shards(blocks[self.pending :]),
                "unsharded_grads": g.ugrads(root) + sum(g.held_grads(b) for b in queued),
            }
        out = {
            "backward end": {
                "unsharded_params": self.root_u,
                **grads,
                "activations": self.acts.pre,
                "temporaries": g.ugrads(root) - self.root_post,
                "comm_buffers": sum(g.reduce_buffers(b) for b in queued),
            }
        }
        if not g.trivial and _trains(root):
            # the root's own reduction, last: every block reduced, the root resharded
            out["root reduction"] = {
                "sharded_grads": g.grad_shards(blocks),
                "unsharded_grads": g.held_grads(root),
                "temporaries": root.trained_row_numel * g.r_item,
                "comm_buffers": g.reduce_buffers(root),
            }
        return out


def _by_category(phases: dict, sharded: int, opt: int) -> dict:
    """Every moment in every category (``CATEGORIES``), as ints: the parameter shards at
    every moment, the optimizer state at every one but the optimizer step's (which has it)."""
    out = {}
    for ph, cats in phases.items():
        row = {c: 0 for c in CATEGORIES}
        row["sharded_params"] = sharded
        if ph != "optimizer":
            row["optimizer_state"] = opt
        for c, v in cats.items():
            row[c] = int(v)
        out[ph] = row
    return out


# --------------------------------------------------------------------------------- collectives
def collectives(profile: ModelProfile, cfg: PlanConfig, groups=None, *, device: str = "cuda"):
    """``{(kind, mesh dim name): (count, bytes per rank)}`` of the collectives of one
    forward and backward of ``cfg``, as ``CommDebugMode`` records them (bytes: what one
    rank contributes). The counting is the communication ledger's analytic model
    (``fsdp2.tools.comm_model``), fed the planner's groups: FSDP's always; tensor
    parallelism's for ``examples.gpt``'s plan (``TransformerTP``, the recomputed
    forward's included under activation checkpointing), else left out.

    Example:
        >>> count, nbytes = collectives(profile, PlanConfig(world_size=8))[("all_gather", "dp_shard")]
        >>> count                          # per block: forward and backward; the root once
        2 * profile.n_blocks + 1
    """
    from fsdp2.tools.comm_model import expected_step_comms

    specs = group_specs(profile, cfg, groups, device=device)
    return expected_step_comms(specs, tp=transformer_tp(profile, cfg)).by_mesh_dim()


def transformer_tp(profile: ModelProfile, cfg: PlanConfig):
    """The ledger's ``TransformerTP`` for ``cfg`` when it applies: ``tp > 1`` and a model
    laid out by ``examples.gpt.tp_plan`` (a GPT with token and position embeddings,
    LayerNorms); else None.

    Activation checkpointing: the blocks ``cfg.checkpointed_blocks`` names when it is set
    (those below ``profile.n_blocks``), else every block under
    ``cfg.activation_checkpointing`` (``parallelize_transformer``'s), and every block when
    the model checkpoints its own (``GPTConfig.checkpoint_blocks``); their recomputation
    re-issues attention's input all-gather and output reduce-scatter.

    Example:
        >>> transformer_tp(profile, PlanConfig(world_size=8, tp=2)).tp_size
        2
        >>> ac = PlanConfig(world_size=8, tp=2, activation_checkpointing=True)
        >>> len(transformer_tp(profile, ac).checkpointed) == profile.n_blocks
        True
    """
    from fsdp2.tools.comm_model import TransformerTP

    model_cfg = _config_of(profile.model)
    is_gpt = type(profile.model).__name__ == "GPT" and hasattr(model_cfg, "tie_weights")
    if cfg.tp == 1 or not is_gpt:
        return None
    n = profile.n_blocks
    blocks = getattr(cfg, "checkpointed_blocks", None)
    if blocks is None:
        blocks = range(n) if cfg.activation_checkpointing else ()
    if getattr(model_cfg, "checkpoint_blocks", False):  # torch.utils.checkpoint in forward
        blocks = range(n)
    return TransformerTP(
        n_layers=profile.n_blocks,
        batch=cfg.batch_size,
        seq=profile.seq_len,
        dim=profile.hidden,
        vocab=_vocab_size(profile.model),
        tp_size=cfg.tp,
        dtype=cfg.param_dtype or profile.params[0].dtype,
        bias=bool(getattr(model_cfg, "bias", True)),
        checkpointed_blocks=tuple(b for b in blocks if b < n),  # as PlanConfig.checkpointed
    )


def group_specs(profile: ModelProfile, cfg: PlanConfig, groups=None, *, device: str = "cuda"):
    """The planner's groups as ``comm_model.GroupSpec`` (the tensor-parallel local shapes,
    the mesh dims named as ``parallelize_transformer`` names them).

    Example:
        >>> [g.shard_size for g in group_specs(profile, PlanConfig(world_size=8))][:1]
        [8]
    """
    from fsdp2.tools.comm_model import GroupSpec, ParamSpec

    groups = groups or group_layouts(profile, cfg)
    n_blocks = sum(g.name != "root" for g in groups)
    specs = []
    for g in groups:
        params = []
        for p in g.params:
            local = list(p.shape)
            if cfg.tp > 1 and p.tp_dim is not None:
                local[p.tp_dim] = _first_chunk(local[p.tp_dim], cfg.tp)
            params.append(ParamSpec(tuple(local), p.dtype, p.requires_grad))
        is_root = g.name == "root"
        specs.append(
            GroupSpec(
                params,
                shard_size=cfg.dp_shard,
                mesh_dim="dp_shard",
                replicate_size=cfg.dp_replicate,
                replicate_mesh_dim="dp_replicate" if cfg.dp_replicate > 1 else None,
                reshard_after_forward=not is_root
                and cfg.reshards(len(specs) - (groups[0].name == "root"), n_blocks),
                param_dtype=cfg.param_dtype,
                reduce_dtype=cfg.reduce_dtype,
                name=g.name,
                device_type="cpu" if device == "cpu" else "cuda",
                backend="gloo" if device == "cpu" else "nccl",
            )
        )
    return specs


# --------------------------------------------------------------------------------- cost
def step_cost(
    profile: ModelProfile, cfg: PlanConfig, est: Estimate, hw: Hardware
) -> tuple[float, float, float]:
    """``(compute, communication, step)`` seconds of one step on ``hw``.

    Compute: ``6 N T + 12 L d s T`` FLOPs for ``T`` tokens per data-parallel rank (``N``
    parameters, ``L`` layers, width ``d``, sequence ``s``), plus each checkpointed block's
    forward again (``2 N_b T + 4 d s T``), split over ``tp`` ranks, at ``hw.flops *
    hw.efficiency * hw.speed(compute dtype)``; under CPU offload (on a GPU) the host copies
    and the host's optimizer step add to it. Communication: ring collectives move ``(n -
    1) / n`` of the gathered size per rank, at the intra-node bandwidth while the group
    fits in a node (the mesh puts ``tp`` innermost, then ``dp_shard``, then
    ``dp_replicate``), else the inter-node. FSDP's gathers and reductions overlap compute
    where ``hw.overlap``; tensor parallelism's do not (the ledger's ``TransformerTP`` when
    it applies, else two all-gathers and two reduce-scatters of a block's activations per
    forward, as many in backward, and again in a recomputed forward). Step = ``max(compute,
    fsdp)`` (``compute + fsdp`` without overlap) ``+ tp +`` the first gather, which nothing
    hides.

    Example:
        >>> compute, comm, step = step_cost(profile, cfg, estimate(profile, cfg), H100)
    """
    compute = _compute_seconds(profile, cfg, hw)
    if cfg.offload and hw.device != "cpu":
        compute += _offload_seconds(est, cfg, hw)
    fsdp, first = _fsdp_seconds(cfg, est, hw)
    tp_s = _tp_seconds(profile, cfg, est, hw)
    hidden = max(compute, fsdp) if hw.overlap else compute + fsdp
    return compute, fsdp + tp_s, hidden + tp_s + first


def _bandwidth(hw: Hardware, span: int) -> float:
    """Bytes/s of a collective over ``span`` consecutive ranks."""
    return hw.intra_node_bw if span <= hw.devices_per_node else hw.inter_node_bw


def _compute_seconds(profile: ModelProfile, cfg: PlanConfig, hw: Hardware) -> float:
    """The FLOPs of a step (checkpointed blocks' forward again) at the hardware's rate."""
    tokens = cfg.batch_size * profile.seq_len
    attn = 4 * profile.hidden * profile.seq_len * tokens  # one layer's attention, forward
    flops = 6 * profile.num_params * tokens + 3 * profile.n_layers * attn
    for b in cfg.checkpointed(profile.n_blocks):  # the block's forward again
        flops += 2 * _block_params(profile, b) * tokens + attn * profile.n_layers / profile.n_blocks
    compute_dtype = cfg.param_dtype or profile.params[0].dtype
    return flops / cfg.tp / (hw.flops * hw.efficiency * hw.speed(compute_dtype))


def _fsdp_seconds(cfg: PlanConfig, est: Estimate, hw: Hardware) -> tuple[float, float]:
    """FSDP's (and HSDP's) collectives of a step, and its first all-gather alone."""
    shard_bw = _bandwidth(hw, cfg.tp * cfg.dp_shard)
    fsdp = first = 0.0
    for (kind, dim), (count, nbytes) in est.collectives.items():
        if dim == "dp_shard":
            size = cfg.dp_shard
            moved = nbytes * (size - 1) if kind == "all_gather" else nbytes * (size - 1) / size
            fsdp += moved / shard_bw
            if kind == "all_gather" and count:
                first = max(first, moved / count / shard_bw)
        elif dim == "dp_replicate":
            size = cfg.dp_replicate
            fsdp += 2 * nbytes * (size - 1) / size / _bandwidth(hw, cfg.world_size)
    return fsdp, first


def _tp_seconds(profile: ModelProfile, cfg: PlanConfig, est: Estimate, hw: Hardware) -> float:
    """Tensor parallelism's collectives of a step: the ledger's ``TransformerTP`` when it
    applies, else two all-gathers and two reduce-scatters of a block's activations per
    forward, backward and recomputed forward."""
    k, bw = cfg.tp, _bandwidth(hw, cfg.tp)
    known = [(kind, v) for (kind, dim), v in est.collectives.items() if dim == "tp"]
    if known:
        moved = {"all_gather": lambda b: b * (k - 1), "reduce_scatter": lambda b: b * (k - 1) / k}
        default = lambda b: 2 * b * (k - 1) / k  # noqa: E731 (all-reduce)
        seconds = sum(moved.get(kind, default)(nbytes) / bw for kind, (_c, nbytes) in known)
        return seconds + sum(count for _kind, (count, _b) in known) * hw.collective_latency
    if k == 1:
        return 0.0
    tokens = cfg.batch_size * profile.seq_len
    act = tokens * profile.hidden * (cfg.param_dtype or torch.float32).itemsize
    passes = 2 + len(cfg.checkpointed(profile.n_blocks)) / max(profile.n_blocks, 1)
    count = passes * 4 * profile.n_layers
    return count * (act * (k - 1) / k / bw + hw.collective_latency)


def _block_params(profile: ModelProfile, block: int) -> int:
    """Parameters of transformer block ``block``."""
    counts = profile.cache.get("block params")
    if counts is None:
        counts = [0] * profile.n_blocks
        for p in profile.params:
            if p.block is not None:
                counts[p.block] += math.prod(p.shape)
        profile.cache["block params"] = counts
    return counts[block]


def _offload_seconds(est: Estimate, cfg: PlanConfig, hw: Hardware) -> float:
    """CPU offload's share of a step: the parameter shards copied to the device for every
    all-gather, the gradient shards copied back, and the optimizer step on the host."""
    trained = sum(g.trained_shard_numel for g in est.groups)
    blocks = [g for g in est.groups if g.name != "root"]
    gathered = sum(g.shard_numel * g.itemsize for g in est.groups)
    again = sum(  # the groups that reshard after forward are gathered (copied) again
        g.shard_numel * g.itemsize for j, g in enumerate(blocks) if cfg.reshards(j, len(blocks))
    )
    copies = gathered + again + sum(g.trained_shard_numel * g.itemsize for g in est.groups)
    return copies / hw.host_bw + trained / hw.host_optimizer


# --------------------------------------------------------------------------------- ranking
def rank_configs(
    profile: ModelProfile,
    world_size: int,
    budget_bytes: int | None = None,
    *,
    hardware: Hardware = H100,
    global_batch: int | None = None,
    tp_degrees=(1, 2, 4, 8),
    replicate_degrees=None,
    blocks_per_group=(1, 2, 0),
    reshard_after_forward=(True, False),
    activation_checkpointing=(False, True),
    base: PlanConfig | None = None,
) -> tuple[list[Estimate], list[Estimate]]:
    """Every layout of ``world_size`` ranks, estimated: ``(fits, too_big)``, those whose
    peak fits ``budget_bytes`` first, each list ordered by predicted step time.

    The global batch (sequences per step, default ``world_size``) is held fixed, so every
    layout does the same work: a layout whose data-parallel size does not divide it is
    skipped. ``tp`` stays within a node and divides the heads when the config names them.

    Example:
        >>> fits, too_big = rank_configs(profile, 64, 80 * 10**9, tp_degrees=(1, 8))
        >>> fits[0].config.describe(), f"{fits[0].peak_gib:.1f} GiB"
    """
    budget = budget_bytes if budget_bytes is not None else hardware.memory
    base = base or PlanConfig(world_size=world_size)
    global_batch = global_batch or world_size
    out = []
    for tp in tp_degrees:
        if world_size % tp or tp > hardware.devices_per_node:
            continue
        if not tp_splits(profile, tp):
            continue
        dp = world_size // tp
        if global_batch % dp:
            continue
        reps = replicate_degrees or [r for r in _divisors(dp) if r == 1 or dp // r >= 2]
        for rep, k, raf, ac in itertools.product(
            reps, blocks_per_group, reshard_after_forward, activation_checkpointing
        ):
            if dp % rep:
                continue
            if k == 0 and not raf:
                continue  # root-only keeps its parameters anyway
            cfg = replace(
                base,
                world_size=world_size,
                tp=tp,
                dp_replicate=rep,
                blocks_per_group=k,
                reshard_after_forward=raf,
                activation_checkpointing=ac,
                batch_size=global_batch // dp,
            )
            out.append(estimate(profile, cfg, hardware))
    fits = [e for e in out if budget is None or e.peak_bytes <= budget]
    rest = [e for e in out if not (budget is None or e.peak_bytes <= budget)]
    return sorted(fits, key=speed_then_memory), sorted(rest, key=lambda e: e.peak_bytes)


def speed_then_memory(est: Estimate) -> tuple[float, int]:
    """Sort key: predicted step time to four significant digits, then peak memory (of
    layouts equally fast, the one that leaves most memory free first).

    Example:
        >>> fits.sort(key=speed_then_memory)
    """
    return float(f"{est.step_s:.4g}"), est.peak_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _heads(model) -> int | None:
    cfg = _config_of(model)
    for name in ("n_heads", "num_attention_heads", "num_heads"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    return None


def tp_splits(profile: ModelProfile, tp: int) -> bool:
    """Whether tensor parallelism of degree ``tp`` can lay the model out: a plan exists,
    ``tp`` divides the attention heads and the key/value heads (grouped-query attention
    splits by whole key/value heads) when the config names them, and the sequence (the
    sequence-parallel shards between blocks are equal).

    Example:
        >>> tp_splits(profile, 2), tp_splits(profile, 3)
        (True, False)
    """
    if tp == 1:
        return True
    if not profile.tp_plan or profile.seq_len % tp:
        return False
    cfg = _config_of(profile.model)
    counts = [_heads(profile.model)]
    counts += [getattr(cfg, n, None) for n in ("num_key_value_heads", "n_kv_heads")]
    return all(c % tp == 0 for c in counts if isinstance(c, int) and c > 0)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9 bytes, ``"24GiB"`` -> 24 * 2**30 (also ``"1.5TB"``, ``"512"``).

    Raises:
        ValueError: not a number followed by an optional unit.

    Example:
        >>> parse_bytes("80GB"), parse_bytes("1GiB")
        (80000000000, 1073741824)
    """
    s = str(text).strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = None
    if value is None or unit not in _UNITS or value < 0:
        raise ValueError(f"parse_bytes: expected a size such as '80GB' or '24GiB', got {text!r}.")
    return int(value * _UNITS[unit])
