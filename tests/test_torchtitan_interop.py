"""torchtitan's own Llama3 ``parallelize``, on PyTorch's DTensor and FSDP2 and with only its
imports changed to ours.

What runs: torchtitan 0.3.0's ``parallelize_llama`` (its ``Module.parallelize`` sharding
configs, ``local_map`` regions, vocabulary-parallel embedding and ``apply_fsdp_to_decoder``)
on its DTensor path (``spmd_backend="partial_dtensor"``), for a tiny Llama3 (2 layers, dim
24, 4 heads of which 2 key/value heads, vocabulary 35 and sequence 9, both uneven over the
ranks), with tensor parallelism 2 at world size 2 and FSDP 2 x TP 2 at world size 4, then 3
AdamW steps. It runs twice in the same processes: as torchtitan ships, and *ported*: every
name torchtitan's modules imported from ``torch.distributed.tensor`` (``DTensor``,
``distribute_tensor``, the placements, ``local_map``, the parallel styles) and from
``torch.distributed.fsdp`` (``fully_shard``, ``FSDPModule``, the policies) is rebound to
ours, which is what changing its import lines does, and restored afterwards
(``_ported``). Losses and final parameters must agree (fp32 rtol 1e-5 / atol 1e-6), at-rest
placements, meshes and local shapes must be equal, and the first loss must be the one
process's loss.

What stays PyTorch's, and why:

* meshes: torchtitan's ``ParallelDims`` builds them with PyTorch's ``init_device_mesh`` and
  its private ``DeviceMesh._unflatten`` (with a ``"fake"`` backend for size-1 dims), which our
  DeviceMesh does not have. Our dtensor and fsdp2 take PyTorch's meshes, converted
  ([Note: converted mesh families] in ``device_mesh/_interop.py``).
* placements built by ``spmd_types`` (a dependency, not torchtitan): they stay PyTorch's and
  compare equal to ours ([Note: PyTorch's placements] in ``dtensor/placement.py``).

Set aside, because a CPU lacks them:

* ``torchtitan.distributed.minimal_async_ep.kernels`` imports triton at load time (the MoE
  code imports it; Llama3 never calls it): replaced by a module whose functions raise.
* FlexAttention, torchtitan's attention for language models: "FlexAttention does not
  support backward on CPU" (PyTorch 2.13, eager and compiled). The inner attention is
  torchtitan's own ``ScaledDotProductAttention`` (causal), with the same ``local_map``
  sharding config.
* torchtitan takes "cuda" as the device type when there is no accelerator: its
  ``parallel_dims.device_type`` is set to "cpu" for the test.
* once torchtitan turns off FSDP's gradient division, PyTorch's FSDP reduces with
  ``ReduceOp.PREMUL_SUM``, which gloo lacks: PyTorch's run sets
  ``set_force_sum_reduction_for_comms(True)`` (a plain sum: the same value).
* ``update_from_config`` imports torchtitan's trainer (datasets, torchdata); the test calls
  ``set_llama3_sharding_config``, the part of it that sets the sharding.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import _torch_compat as compat
from tests.harness import run_on_ranks

pytestmark = pytest.mark.skipif(not compat.TORCHTITAN_RUNS, reason=compat.TORCHTITAN_SKIP)

VOCAB, SEQ, ROWS, STEPS = 35, 9, 2, 3

# PyTorch module -> (our module, the names torchtitan may have imported from it)
_PORT = {
    "torch.distributed.tensor": (
        "dtensor",
        ("DTensor", "Shard", "Replicate", "Partial", "Placement", "distribute_tensor",
         "distribute_module"),
    ),
    "torch.distributed.tensor.placement_types": (
        "dtensor.placement",
        ("Shard", "Replicate", "Partial", "Placement"),
    ),
    "torch.distributed.tensor.experimental": ("dtensor.experimental", ("local_map",)),
    "torch.distributed.tensor.parallel": (
        "dtensor.parallel",
        ("parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel",
         "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "loss_parallel"),
    ),
    "torch.distributed.fsdp": (
        "fsdp2",
        ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy",
         "OffloadPolicy"),
    ),
}  # fmt: skip


class _SetAside(types.ModuleType):
    """A module that a CPU cannot import (triton kernels): any function of it raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} was set aside by the test (no triton)")

        return absent


def _import_torchtitan():
    kernels = "torchtitan.distributed.minimal_async_ep.kernels"
    if importlib.util.find_spec("triton") is None and kernels not in sys.modules:
        sys.modules[kernels] = _SetAside(kernels)
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.llama3 as llama3
    from torchtitan.distributed import utils as dist_utils

    return llama3, parallel_dims, dist_utils


@contextlib.contextmanager
def _ported():
    """Rebind every name a torchtitan module imported from PyTorch's DTensor, tensor
    parallelism or FSDP2 (by identity: the object itself) to ours; restore on exit."""
    table = {}
    for theirs, (ours, names) in _PORT.items():
        theirs, ours = importlib.import_module(theirs), importlib.import_module(ours)
        for name in names:
            table[id(getattr(theirs, name))] = (getattr(theirs, name), getattr(ours, name))
    swapped = []
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("torchtitan") and module is not None:
            for attr, value in list(vars(module).items()):
                hit = table.get(id(value))
                if hit is not None and hit[0] is value:
                    setattr(module, attr, hit[1])
                    swapped.append((module, attr, value))
    try:
        yield {(m.__name__, a) for m, a, _ in swapped}
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


@contextlib.contextmanager
def _on_cpu(parallel_dims, dist_utils):
    device_type, backend = parallel_dims.device_type, dist_utils.get_spmd_backend()
    parallel_dims.device_type = "cpu"
    dist_utils.set_spmd_backend("partial_dtensor")
    try:
        yield
    finally:
        parallel_dims.device_type = device_type
        dist_utils.set_spmd_backend(backend)


def _model(llama3, sp: bool):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dim, heads = 24, 4
    cfg = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=VOCAB, param_init=llama3._output_linear_init(dim)
        ),
        layers=llama3._build_llama3_layers(
            n_layers=2,
            dim=dim,
            n_heads=heads,
            n_kv_heads=2,
            hidden_dim=40,
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=32, theta=10000.0),
            attn_backend="flex",
        ),
    )
    for layer in cfg.layers:  # FlexAttention has no backward on CPU (module docstring)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(cfg, enable_sp=sp)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return model


def _batches(dp: int, batch_rank: int):
    """The global batches (ROWS rows per data-parallel rank), and this rank's rows of them."""
    g = torch.Generator().manual_seed(1)
    n, mine = ROWS * dp, slice(batch_rank * ROWS, (batch_rank + 1) * ROWS)
    out = []
    for _ in range(STEPS):
        x, y = (torch.randint(0, VOCAB, (n, SEQ), generator=g) for _ in range(2))
        out.append((x[mine], y[mine]))
    return out


def _loss(logits, y, tokens: int):
    """Summed over this rank's rows, divided by the global token count (torchtitan's
    normalization: FSDP's gradient division is off)."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / tokens


def _ac_config(ac: str | None):
    """torchtitan's own activation-checkpointing policies, by name."""
    if ac is None:
        return None
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"full": FullAC.Config, "selective": SelectiveAC.Config}[ac]()


def _train(llama3, ParallelDims, sp: bool, dp: int, *, torch_run: bool, ac: str | None = None):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    ws = dist.get_world_size()
    model = _model(llama3, sp)
    parallelism = ParallelismConfig(
        tensor_parallel_degree=ws // dp,
        data_parallel_shard_degree=dp,
        enable_sequence_parallel=sp,
        spmd_backend="partial_dtensor",
    )
    dims = ParallelDims(
        dp_replicate=1, dp_shard=dp, cp=1, tp=ws // dp, pp=1, ep=1, world_size=ws,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    model = llama3.parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=_ac_config(ac),
        dump_folder="",
    )
    if torch_run:  # gloo has no PREMUL_SUM (module docstring)
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batch_rank = dims.get_mesh("batch").get_local_rank() if dp > 1 else 0
    losses = []
    for x, y in _batches(dp, batch_rank):
        loss = _loss(model(x), y, ROWS * dp * SEQ)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: (p, p.full_tensor()) for n, p in model.named_parameters()}
    return model, losses, params


def _first_loss_of_one_process(llama3, sp: bool, dp: int) -> float:
    """This rank's share of the first loss, from the unparallelized model."""
    tp = dist.get_world_size() // dp
    x, y = _batches(dp, batch_rank=dist.get_rank() // tp)[0]  # ParallelDims' order: (dp, tp)
    with torch.no_grad():
        return _loss(_model(llama3, sp)(x), y, ROWS * dp * SEQ).item()


def _torchtitan_ports_by_imports(sp: bool, dp: int):
    import dtensor
    import fsdp2

    llama3, parallel_dims, dist_utils = _import_torchtitan()
    with _on_cpu(parallel_dims, dist_utils):
        _, their_losses, theirs = _train(llama3, parallel_dims.ParallelDims, sp, dp, torch_run=True)
        with _ported() as swapped:
            model, losses, ours = _train(
                llama3, parallel_dims.ParallelDims, sp, dp, torch_run=False
            )
        reference = _first_loss_of_one_process(llama3, sp, dp)
    # the port is real: torchtitan's own code ran on ours
    for name in ("distribute_tensor", "DTensor", "local_map", "fully_shard", "Shard"):
        assert any(attr == name for _, attr in swapped), (name, sorted(swapped))
    assert isinstance(model, fsdp2.FSDPModule) and isinstance(model.layers["0"], fsdp2.FSDPModule)
    assert all(isinstance(p, dtensor.DTensor) for p, _ in ours.values())
    assert not any(isinstance(p, dtensor.DTensor) for p, _ in theirs.values())
    # and it computed what PyTorch's run computed, which is what one process computes
    # (measured: equal losses; parameters equal with sequence parallelism and within 6.4e-7
    # without it, where partial input gradients are summed in another order. A conjugated
    # rotary-embedding gradient, for scale, moved a parameter by 0.058.)
    assert losses == pytest.approx(their_losses, rel=1e-5, abs=1e-6), (losses, their_losses)
    assert losses[0] == pytest.approx(reference, rel=1e-5, abs=1e-6), (losses[0], reference)
    assert ours.keys() == theirs.keys()
    for name, (p, full) in ours.items():
        their_p, their_full = theirs[name]
        torch.testing.assert_close(
            full, their_full, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
        # laid out alike at rest (placements compare across the libraries)
        assert p.placements == tuple(their_p.placements), (name, p, their_p)
        assert p.device_mesh.mesh.tolist() == their_p.device_mesh.mesh.tolist(), name
        assert p.to_local().shape == their_p.to_local().shape, name


_SP = pytest.mark.skipif(not compat.TORCHTITAN_SP_RUNS, reason=compat.TORCHTITAN_SP_SKIP)


@pytest.mark.parametrize(
    "ws, dp, sp",
    [
        pytest.param(2, 1, True, marks=_SP),
        (2, 1, False),
        pytest.param(4, 2, True, marks=_SP),
    ],
    ids=["tp2-sequence-parallel", "tp2", "fsdp2-tp2-sequence-parallel"],
)
def test_torchtitan_llama3_parallelize_ports_by_changing_imports(ws, dp, sp):
    run_on_ranks(ws, _torchtitan_ports_by_imports, sp=sp, dp=dp, timeout_s=300)


def _torchtitan_activation_checkpointing(ac: str):
    """torchtitan's full and selective activation checkpointing (its ``apply`` wraps every
    block in ``checkpoint_wrapper``, then ``apply_fsdp`` shards each wrapper) over FSDP at 2
    ranks, ported by its imports, equal to PyTorch's run and to one process."""
    import fsdp2

    llama3, parallel_dims, dist_utils = _import_torchtitan()
    with _on_cpu(parallel_dims, dist_utils):
        _, their_losses, theirs = _train(
            llama3, parallel_dims.ParallelDims, False, 2, torch_run=True, ac=ac
        )
        with _ported():
            model, losses, ours = _train(
                llama3, parallel_dims.ParallelDims, False, 2, torch_run=False, ac=ac
            )
        _, plain_losses, _ = _train(
            llama3, parallel_dims.ParallelDims, False, 2, torch_run=True, ac=None
        )
        reference = _first_loss_of_one_process(llama3, False, 2)
    wrapped = model.layers["0"]
    assert isinstance(wrapped, fsdp2.FSDPModule)
    assert type(wrapped).__name__ == "FSDPCheckpointWrapper", type(wrapped)
    assert losses == pytest.approx(their_losses, rel=1e-5, abs=1e-6), (losses, their_losses)
    assert losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6), (losses, plain_losses)
    assert losses[0] == pytest.approx(reference, rel=1e-5, abs=1e-6), (losses[0], reference)
    for name, (_, full) in ours.items():
        torch.testing.assert_close(
            full, theirs[name][1], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize(  # selective takes 8 s (its op-level policy): make test-all runs it
    "ac", ["full", pytest.param("selective", marks=pytest.mark.nightly)]
)
def test_torchtitan_activation_checkpointing_over_fully_shard(ac):
    run_on_ranks(2, _torchtitan_activation_checkpointing, ac=ac, timeout_s=300)
