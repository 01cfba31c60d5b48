"""Lightning Fabric 2.6's ``ModelParallelStrategy`` saves and resumes bit for bit, on
PyTorch's FSDP2/DTensor/DCP and with this project's names swapped in at Fabric's import sites.

What runs, at 2 ranks (FSDP: a ``parallelize_fn`` calling ``fully_shard`` per block, then on
the root) and at 4 ranks (FSDP 2 x TP 2: ``parallelize_module`` with a colwise/rowwise plan
per block on the ``tensor_parallel`` mesh, then ``fully_shard`` on the ``data_parallel``
mesh), for a small residual MLP (width 7, hidden 10, a head of 5 outputs) whose dims 0 of 7
and 5 - and at 4 ranks the 5 = 10 / tp rows of a column-parallel weight - shard unevenly:

1. 2 AdamW steps; ``fabric.save(path, {"model": model, "optimizer": opt, "step": 2})`` (a
   sharded checkpoint: Fabric's ``_distributed_checkpoint_save`` plus its ``meta.pt``);
   1 more step - the uninterrupted run;
2. a fresh model from another seed, its optimizer, ``fabric.load(path, state)`` (Fabric's
   ``get_model_state_dict`` / ``load`` / ``set_optimizer_state_dict`` sequence), 1 step.

The resumed step's loss and every full parameter must equal the uninterrupted run's, bit
for bit, and the loaded parameters the saved ones.

It runs in the harness's workers: their default process group is already initialized, and
their environment has ``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR/PORT``, so
Fabric's ``LightningEnvironment`` is detected with ``creates_processes_externally`` (no
launcher: ``fabric.launch()`` only sets up the strategy) and ``_init_dist_connection``
adopts the existing group.

The *ported* run is the same program with ``parallelize_fn`` using ``fsdp2.fully_shard``
and ``dtensor.parallel`` (the user's own imports) and, at Fabric's import sites, ours for
PyTorch's: ``model_parallel.py`` and ``fsdp.py`` import ``init_device_mesh``, ``DTensor``
(from ``torch.distributed._tensor``), ``FSDPModule``, the state-dict helpers and
``torch.distributed.checkpoint.save``/``load`` inside functions, at call time, so those
attributes are swapped on the PyTorch modules themselves for the run and restored after
(``tests/_client_ports.py``). Its losses and full parameters must equal PyTorch's run's, bit
for bit (every cross-rank sum here has two terms, so the order of summation cannot differ).
A nightly *mid-port* variant keeps PyTorch's DCP and state-dict helpers over our meshes,
DTensors and ``fully_shard``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._client_ports import check_resumed, ported, shared_path
from tests.harness import run_on_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning_fabric") is None,
    reason="lightning-fabric is not installed (a pinned test-only dependency: make test)",
)

DIM, HIDDEN, OUT, ROWS, LR = 7, 10, 5, 3, 1e-2

# Fabric's call-time imports (lightning_fabric/strategies/model_parallel.py, fsdp.py):
# PyTorch module -> (our module, names)
_FABRIC_PORT = {
    "torch.distributed.device_mesh": ("device_mesh", ("init_device_mesh",)),
    "torch.distributed._tensor": ("dtensor", ("DTensor",)),
    "torch.distributed._composable.fsdp": ("fsdp2", ("FSDPModule",)),
    "torch.distributed.checkpoint": ("dtensor.checkpoint", ("save", "load")),
    "torch.distributed.checkpoint.state_dict": (
        "dtensor.checkpoint",
        ("StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
         "set_model_state_dict", "set_optimizer_state_dict"),
    ),
}  # fmt: skip
# "mid-port": our meshes, DTensors and fully_shard under PyTorch's DCP and state-dict helpers
_MID_PORT = {k: v for k, v in _FABRIC_PORT.items() if "checkpoint" not in k}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        # no bias on the row-parallel layer: PyTorch's RowwiseParallel adds bias / tp on every
        # rank before the sum (its Replicate -> Partial), ours adds the bias once after it;
        # both are right, but they round differently (measured: 1 ulp in the first loss), and
        # this test compares bit for bit
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return x + self.w2(torch.tanh(self.w1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _parallelize(ours: bool):
    """The user's ``parallelize_fn``, with the user's imports (PyTorch's or ours)."""
    if ours:
        from dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from fsdp2 import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

    def parallelize_fn(model: Net, mesh):
        dp = mesh["data_parallel"]
        if mesh["tensor_parallel"].size() > 1:
            plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
            for block in model.blocks:
                parallelize_module(block, mesh["tensor_parallel"], plan)
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
        return model

    return parallelize_fn


def _batch(step: int, dp_size: int, dp_rank: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS * dp_size, DIM, generator=g)
    y = torch.randn(ROWS * dp_size, OUT, generator=g)
    mine = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
    return x[mine], y[mine]


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}


def _fabric_run(fabric, path, dp: int):
    """Steps 1-2, save, step 3; a fresh model from another seed, load, step 3 again."""

    def setup(seed):
        torch.manual_seed(seed)
        model = fabric.setup_module(Net())
        opt = fabric.setup_optimizers(
            torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        )
        return model, opt

    mesh = fabric.strategy.device_mesh
    dp_rank = mesh["data_parallel"].get_local_rank()

    def step(model, opt, n):
        x, y = _batch(n, dp, dp_rank)
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = setup(seed=0)
    losses = [step(model, opt, n) for n in (1, 2)]
    saved = _full_params(model)
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
    losses.append(step(model, opt, 3))
    uninterrupted = _full_params(model)

    model, opt = setup(seed=1)
    assert not all(torch.equal(p, saved[n]) for n, p in _full_params(model).items())
    state = {"model": model, "optimizer": opt, "step": 0}
    remainder = fabric.load(path, state)
    assert state["step"] == 2 and remainder == {}, (state["step"], remainder)
    loaded = _full_params(model)
    resumed_loss = step(model, opt, 3)
    return {
        "losses": losses,
        "saved": saved,
        "loaded": loaded,
        "uninterrupted": uninterrupted,
        "resumed_loss": resumed_loss,
        "resumed": _full_params(model),
        "model": model,
    }


def _fabric(dp: int, tp: int, ours: bool, sharded: bool = True):
    from lightning_fabric import Fabric
    from lightning_fabric.plugins.environments import LightningEnvironment
    from lightning_fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=_parallelize(ours),
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        save_distributed_checkpoint=sharded,
    )
    fabric = Fabric(accelerator="cpu", devices=dp * tp, num_nodes=1, strategy=strategy)
    fabric.launch()  # adopts the workers' default group (module docstring)
    env = fabric.strategy.cluster_environment
    assert type(env) is LightningEnvironment and env.creates_processes_externally, env
    assert (fabric.global_rank, fabric.world_size) == (dist.get_rank(), dist.get_world_size())
    return fabric


# PyTorch's run, per (dp, tp, sharded), kept in the worker for the ported test that follows
_THEIRS: dict[tuple[int, int, bool], dict] = {}


def _torch_arm(tmp: str, dp: int, tp: int, sharded: bool = True) -> dict:
    """PyTorch's run (once per worker pool and layout), checked to resume bit for bit."""
    import dtensor

    key = dp, tp, sharded
    if key not in _THEIRS:
        assert dist.is_initialized() and dist.get_world_size() == dp * tp
        group = dist.group.WORLD
        fabric = _fabric(dp, tp, ours=False, sharded=sharded)
        run = _fabric_run(fabric, shared_path(tmp, f"torch-{dp}x{tp}-{sharded}"), dp)
        assert dist.group.WORLD is group  # Fabric adopted the harness's group
        assert not isinstance(next(run["model"].parameters()), dtensor.DTensor)
        check_resumed(run, "PyTorch")
        del run["model"]
        _THEIRS[key] = run
    return _THEIRS[key]


def _fabric_pytorch(tmp: str, dp: int, tp: int) -> None:
    _torch_arm(tmp, dp, tp)


def _fabric_ported(tmp: str, dp: int, tp: int, port: str, sharded: bool = True) -> None:
    """The ported run (``port`` "full": every name of ``_FABRIC_PORT``; "mid": PyTorch's DCP
    and state-dict helpers kept), resumed bit for bit and equal to PyTorch's run.
    ``sharded=False``: Fabric's single-file checkpoint (``save_distributed_checkpoint=False``:
    full state dicts gathered to rank 0, loaded back with ``broadcast_from_rank0``)."""
    import device_mesh
    import dtensor
    import fsdp2

    theirs = _torch_arm(tmp, dp, tp, sharded)
    table = _FABRIC_PORT if port == "full" else _MID_PORT
    with ported(table, clients=("lightning_fabric",), call_time=table) as swapped:
        assert not swapped.missing, f"ours lacks {swapped.missing}"
        fabric = _fabric(dp, tp, ours=True, sharded=sharded)
        path = shared_path(tmp, f"ours-{port}-{dp}x{tp}-{sharded}")
        ours = _fabric_run(fabric, path, dp)
    if sharded:  # whose DCP wrote it: ours writes metadata.json (and a plain-text .metadata
        # marker), PyTorch's a pickled .metadata and .distcp files
        written = sorted(os.listdir(path))
        assert ("metadata.json" in written) == (port == "full"), written
        assert any(n.endswith(".distcp") for n in written) == (port == "mid"), written
    assert ("torch.distributed.device_mesh", "init_device_mesh") in swapped.torch_attrs
    helpers = ("torch.distributed.checkpoint.state_dict", "get_model_state_dict")
    assert (helpers in swapped.torch_attrs) == (port == "full"), swapped.torch_attrs
    assert isinstance(fabric.strategy.device_mesh, device_mesh.DeviceMesh)
    assert isinstance(ours["model"].module, fsdp2.FSDPModule)
    assert all(isinstance(p, dtensor.DTensor) for p in ours["model"].parameters())
    check_resumed(ours, "ours")
    # and it computed what PyTorch computed, bit for bit
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    for key in ("saved", "uninterrupted", "resumed"):
        for name, full in theirs[key].items():
            got = ours[key][name]
            assert torch.equal(got, full), (
                f"{key} {name}: ours - PyTorch {(got - full).abs().max()}"
            )


_LAYOUTS = pytest.mark.parametrize("ws, dp, tp", [(2, 2, 1), (4, 2, 2)], ids=["fsdp2", "fsdp2-tp2"])


@_LAYOUTS
def test_fabric_checkpoint_resumes_bit_for_bit_on_pytorch(tmp_path, ws, dp, tp):
    run_on_ranks(ws, _fabric_pytorch, tmp=str(tmp_path), dp=dp, tp=tp, timeout_s=180)


@_LAYOUTS
def test_fabric_checkpoint_ported_by_imports_equals_pytorch(tmp_path, ws, dp, tp):
    run_on_ranks(ws, _fabric_ported, tmp=str(tmp_path), dp=dp, tp=tp, port="full", timeout_s=180)


@pytest.mark.parametrize(
    "ws, dp, tp",
    [(2, 2, 1), pytest.param(4, 2, 2, marks=pytest.mark.nightly)],
    ids=["fsdp2", "fsdp2-tp2"],
)
def test_fabric_single_file_checkpoint_pytorch_and_ported(tmp_path, ws, dp, tp):
    """``save_distributed_checkpoint=False``: the full-state-dict helpers (``full_state_dict``,
    ``cpu_offload``, ``broadcast_from_rank0``, ``strict``) on both arms."""
    run_on_ranks(
        ws, _fabric_ported, tmp=str(tmp_path), dp=dp, tp=tp, port="full", sharded=False,
        timeout_s=180,
    )  # fmt: skip


@pytest.mark.nightly
def test_fabric_checkpoint_mid_port_pytorch_dcp_over_ours(tmp_path):
    """Our meshes, DTensors and fully_shard under PyTorch's DCP and state-dict helpers."""
    run_on_ranks(2, _fabric_ported, tmp=str(tmp_path), dp=2, tp=1, port="mid", timeout_s=180)
