"""torchtitan 0.3.0's ``CheckpointManager`` saves and resumes a tiny Llama3 bit for bit, on
PyTorch's FSDP2/DTensor/DCP and with this project's names at torchtitan's import sites.

What runs: the tiny Llama3 of ``tests/test_torchtitan_interop.py`` (2 layers, dim 24,
vocabulary 35 and sequence 9, uneven over the ranks), its mesh built by torchtitan's
``ParallelDims``, parallelized by torchtitan's ``parallelize_llama`` - FSDP at 2 ranks, FSDP 2
x TP 2 with sequence parallelism at 4 - trained as torchtitan's trainer trains it: an
``OptimizersContainer`` (AdamW, its FQN-keyed flat optimizer state), an
``LRSchedulersContainer`` (linear warm-up, so the learning rate changes every step), a
stateful data position in the dataloader slot and a stateful ``train_state`` (the trainer's
``{"step", "ntokens_seen"}``), all handed to ``CheckpointManager`` exactly as the trainer
hands them (``checkpoint.enable``, ``interval=2``, synchronous saves, ``keep_latest_k=0``: no
purge thread; the minimal config read off the 0.3.0 source).

1. steps 1-3 with ``checkpointer.save(step)`` after each: it writes ``step-2`` only (the
   interval) - the uninterrupted run;
2. a fresh run: the model re-initialized from another seed, new containers, a new
   ``CheckpointManager`` on the same folder; ``checkpointer.load()`` finds the latest step
   (``_find_load_step``: a ``step-N`` folder with a DCP ``.metadata`` file) and restores
   model, optimizer, learning-rate schedule, data position and step; then step 3.

The resumed loss, every full parameter, the learning rate and the restored counters must equal
the uninterrupted run's, bit for bit.

The *ported* run is the same program with every name torchtitan's modules took from
PyTorch's DTensor, tensor parallelism and FSDP2 rebound to ours (``_PORT`` of the interop
test), and in ``torchtitan.components.checkpointer.dcp`` the module it imported as ``dcp``
(``torch.distributed.checkpoint``) replaced by ``dtensor.checkpoint``, plus ``Stateful``
(a ``typing.Protocol``: torchtitan's classes are already defined on PyTorch's, so that swap
is only nominal, but ours must have it). torchtitan 0.3.0's checkpointing calls no
``torch.distributed.checkpoint.state_dict`` helper (``OptimizersContainer`` flattens its own
FQN-keyed state), so there is none to swap; the staging, async-process and Hugging Face
writer names ``checkpointer/dcp.py`` imports serve only the ``async_with_pinned_mem`` and
``last_save_in_hf`` paths, which this synchronous native save does not take. Meshes stay
PyTorch's (``ParallelDims`` uses ``DeviceMesh._unflatten``). Its losses and full parameters
must equal PyTorch's run's, bit for bit. Nightly variants: our meshes too (``ParallelDims``
on our ``init_device_mesh``), and PyTorch's DCP over our DTensors ("mid" port). What
PyTorch's run needs on a CPU is the interop test's (its docstring): SDPA for FlexAttention,
``device_type="cpu"``, and a plain-sum reduction on gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests import _torch_compat as compat
from tests._client_ports import check_resumed, ported, shared_path
from tests.harness import run_on_ranks
from tests.test_torchtitan_interop import (
    _PORT,
    ROWS,
    SEQ,
    VOCAB,
    _import_torchtitan,
    _loss,
    _model,
    _on_cpu,
)

pytestmark = pytest.mark.skipif(not compat.TORCHTITAN_RUNS, reason=compat.TORCHTITAN_SKIP)

LR = 1e-2

# what torchtitan's checkpointing imports from torch.distributed.checkpoint (the module
# itself, as ``dcp``, is swapped whole: ``_DCP_MODULES``)
_CKPT_PORT = {
    "torch.distributed.checkpoint.stateful": ("dtensor.checkpoint.stateful", ("Stateful",)),
}
_DCP_MODULES = {"torch.distributed.checkpoint": "dtensor.checkpoint"}
_MESH_PORT = {
    "torch.distributed.device_mesh": ("device_mesh", ("DeviceMesh", "init_device_mesh")),
}


class _DataPosition:
    """A stateful dataloader stand-in (torchtitan's needs torchdata): the index of the next
    global batch. A resumed run takes its batch from the restored position."""

    def __init__(self, dp: int, batch_rank: int) -> None:
        self.position, self.dp, self.batch_rank = 0, dp, batch_rank

    def next_batch(self):
        g = torch.Generator().manual_seed(1000 + self.position)
        n, mine = ROWS * self.dp, slice(self.batch_rank * ROWS, (self.batch_rank + 1) * ROWS)
        x, y = (torch.randint(0, VOCAB, (n, SEQ), generator=g) for _ in range(2))
        self.position += 1
        return x[mine], y[mine]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state_dict):
        self.position = state_dict["position"]


class _TrainState:
    """The trainer's own ``Stateful`` part (``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def _build(llama3, ParallelDims, dp: int, *, seed: int, torch_run: bool):
    """torchtitan's model, mesh, parallelize, optimizer and scheduler containers."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    ws = dist.get_world_size()
    tp, sp = ws // dp, ws // dp > 1
    model = _model(llama3, sp)  # seeded 0
    if seed != 0:
        torch.manual_seed(seed)
        model.init_states()
    parallelism = ParallelismConfig(
        tensor_parallel_degree=tp, data_parallel_shard_degree=dp,
        enable_sequence_parallel=sp, spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims = ParallelDims(
        dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=ws,
        spmd_backend="partial_dtensor",
    )  # fmt: skip
    dims.build_mesh()
    model = llama3.parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    if torch_run:  # gloo has no PREMUL_SUM (the interop test's docstring)
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    adamw = ParamGroupConfig(
        pattern=r".*",
        optimizer_name="AdamW",
        optimizer_kwargs={"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    )
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=[adamw], implementation="for-loop"),
        model_parts=[model],
    )
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=6
    )
    batch_rank = dims.get_mesh("batch").get_local_rank() if dp > 1 else 0
    return (model, optimizers, schedulers, _DataPosition(dp, batch_rank)), dims


def _checkpointer(folder, model, optimizers, schedulers, data, train_state):
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=2, keep_latest_k=0)
    return CheckpointManager(
        config,
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=folder,
    )


def _train_step(model, optimizers, schedulers, data, train_state, dp: int) -> float:
    """The trainer's order: step counter, batch, forward/backward, optimizer, scheduler."""
    train_state.step += 1
    x, y = data.next_batch()
    loss = _loss(model(x), y, ROWS * dp * SEQ)
    loss.backward()
    optimizers.step()
    optimizers.zero_grad()
    schedulers.step()
    train_state.ntokens_seen += x.numel()
    return loss.item()


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _titan_run(llama3, ParallelDims, folder: str, dp: int, *, torch_run: bool) -> dict:
    """Steps 1-3 (saving step 2); then a fresh run from another seed resumes and does step 3."""
    parts, dims = _build(llama3, ParallelDims, dp, seed=0, torch_run=torch_run)
    train_state = _TrainState()
    ckpt = _checkpointer(folder, *parts, train_state)
    try:
        assert not ckpt.load()  # an empty folder: a fresh start
        losses, saved = [], None
        for _ in range(3):
            losses.append(_train_step(*parts, train_state, dp))
            if train_state.step == 2:
                saved = _full(parts[0])
            ckpt.save(train_state.step)
    finally:
        ckpt.close()
    lr = parts[1].optimizers[0].param_groups[0]["lr"]
    run = {"losses": losses, "saved": saved, "uninterrupted": _full(parts[0]), "lr": lr}
    run["mesh"] = type(dims.world_mesh)

    parts, _ = _build(llama3, ParallelDims, dp, seed=7, torch_run=torch_run)
    assert not all(torch.equal(p, saved[n]) for n, p in _full(parts[0]).items())
    train_state = _TrainState()
    ckpt = _checkpointer(folder, *parts, train_state)
    try:
        found = ckpt.load(step=LOAD_STEP)  # -1: the latest (step-2), as the trainer resumes
        assert found, f"no checkpoint found in {ckpt.folder}: {_listing(ckpt.folder)}"
    finally:
        ckpt.close()
    data = parts[3]
    assert (train_state.step, data.position) == (2, 2), (train_state.step, data.position)
    assert train_state.ntokens_seen == 2 * ROWS * SEQ, train_state.ntokens_seen
    run["loaded"] = _full(parts[0])
    run["resumed_loss"] = _train_step(*parts, train_state, dp)
    run["resumed"] = _full(parts[0])
    run["resumed_lr"] = parts[1].optimizers[0].param_groups[0]["lr"]
    run["model"] = parts[0]
    return run


LOAD_STEP = -1


def _listing(folder: str) -> dict[str, list[str]]:
    import os

    if not os.path.isdir(folder):
        return {}
    return {d: sorted(os.listdir(os.path.join(folder, d))) for d in sorted(os.listdir(folder))}


# PyTorch's run, per dp, kept in the worker for the ported test that follows it
_THEIRS: dict[int, dict] = {}


def _torch_arm(tmp: str, dp: int) -> dict:
    import dtensor

    if dp not in _THEIRS:
        llama3, parallel_dims, dist_utils = _import_torchtitan()
        with _on_cpu(parallel_dims, dist_utils):
            run = _titan_run(
                llama3,
                parallel_dims.ParallelDims,
                shared_path(tmp, f"torch-{dp}"),
                dp,
                torch_run=True,
            )
        assert not isinstance(next(run.pop("model").parameters()), dtensor.DTensor)
        run.pop("mesh")
        check_resumed(run, "PyTorch")
        _THEIRS[dp] = run
    return _THEIRS[dp]


def _titan_pytorch(tmp: str, dp: int) -> None:
    _torch_arm(tmp, dp)


def _titan_ported(tmp: str, dp: int, port: str) -> None:
    """``port``: "imports" (``_PORT``, ``dcp`` and ``Stateful``), "meshes" (and
    ``ParallelDims``' meshes), "mid" (``_PORT`` only: PyTorch's DCP over our DTensors)."""
    import dtensor
    import fsdp2

    theirs = _torch_arm(tmp, dp)
    llama3, parallel_dims, dist_utils = _import_torchtitan()
    import torchtitan.components.checkpoint  # noqa: F401  (loaded, so its imports are swapped)

    meshes = port == "meshes"
    table = {**_PORT, **({} if port == "mid" else _CKPT_PORT), **(_MESH_PORT if meshes else {})}
    modules = {} if port == "mid" else _DCP_MODULES
    with (
        _on_cpu(parallel_dims, dist_utils),
        ported(table, clients=("torchtitan",), modules=modules) as swapped,
    ):
        ported_dcp = ("torchtitan.components.checkpointer.dcp", "dcp") in swapped.rebound
        assert ported_dcp == (port != "mid"), swapped.rebound
        folder = shared_path(tmp, f"ours-{dp}-{port}")
        ours = _titan_run(llama3, parallel_dims.ParallelDims, folder, dp, torch_run=False)
    # whose DCP wrote it: ours writes metadata.json, PyTorch's a pickled .metadata
    written = _listing(f"{folder}/checkpoint")["step-2"]
    assert ("metadata.json" in written) == (port != "mid"), written
    model = ours.pop("model")
    import device_mesh

    assert issubclass(ours.pop("mesh"), device_mesh.DeviceMesh) == meshes
    assert isinstance(model, fsdp2.FSDPModule)
    assert all(isinstance(p, dtensor.DTensor) for p in model.parameters())
    check_resumed(ours, "ours")
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    for key in ("saved", "uninterrupted", "resumed"):
        for name, full in theirs[key].items():
            got = ours[key][name]
            assert torch.equal(got, full), (
                f"{key} {name}: ours - PyTorch {(got - full).abs().max()}"
            )
    assert not swapped.missing, f"ours lacks {swapped.missing}"  # the nominal swaps (Stateful)


_LAYOUTS = pytest.mark.parametrize(
    "ws, dp",
    [(2, 2), pytest.param(4, 2, marks=pytest.mark.skipif(
        not compat.TORCHTITAN_SP_RUNS, reason=compat.TORCHTITAN_SP_SKIP))],
    ids=["fsdp2", "fsdp2-tp2-sequence-parallel"],
)  # fmt: skip


@_LAYOUTS
def test_torchtitan_checkpoint_resumes_bit_for_bit_on_pytorch(tmp_path, ws, dp):
    run_on_ranks(ws, _titan_pytorch, tmp=str(tmp_path), dp=dp, timeout_s=240)


@_LAYOUTS
def test_torchtitan_checkpoint_ported_by_imports_equals_pytorch(tmp_path, ws, dp):
    run_on_ranks(ws, _titan_ported, tmp=str(tmp_path), dp=dp, port="imports", timeout_s=240)


@pytest.mark.nightly
@_LAYOUTS
def test_torchtitan_checkpoint_ported_with_our_meshes(tmp_path, ws, dp):
    """``ParallelDims`` on our ``init_device_mesh`` (its ``_unflatten``, ``"fake"`` backend)."""
    run_on_ranks(ws, _titan_ported, tmp=str(tmp_path), dp=dp, port="meshes", timeout_s=240)


@pytest.mark.nightly
def test_torchtitan_checkpoint_mid_port_pytorch_dcp_over_ours(tmp_path):
    """Our DTensors and fully_shard under PyTorch's DCP (``dcp`` and ``Stateful`` kept)."""
    run_on_ranks(2, _titan_ported, tmp=str(tmp_path), dp=2, port="mid", timeout_s=240)
