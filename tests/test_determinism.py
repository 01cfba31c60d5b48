"""Determinism: bit-identical runs, and world-size invariance in the opt-in deterministic mode.

* Run to run: two runs with the same seed and layout (``fully_shard`` at 2 ranks, FSDP + TP
  at 4) give bit-identical losses and parameters, on both collective routes.
* ``set_deterministic_reduction``: a global batch of 4 equal micro-batches trained at world
  size 2 (two micro-batches per rank, accumulated without sync) and at world size 4 (one
  each) gives bit-identical losses and parameters after a few AdamW steps, on a GPT whose
  parameters' dim 0 mostly does not divide by the world size (vocabulary 61, width 18,
  13 positions). At world size 1 (all four micro-batches in one process) and under HSDP
  (2 replicas x 2 shards) too, and with ``dtensor.clip_grad_norm_(deterministic=True)``.
* The default is unchanged: the same training without the mode still equals one process
  within the parity tests' tolerances.

Comparisons are bitwise (``torch.equal`` on the int32 view, so -0.0 and 0.0 differ).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import dtensor
from device_mesh import init_device_mesh
from dtensor.comm import sum_into, tree_sum_into
from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan
from fsdp2 import fully_shard, parallelize_transformer
from tests.harness import run_on_ranks
from tests.test_fsdp_parity import ROUTES, _on_route

MICRO = 4  # micro-batches in a global batch
ROWS = 2  # sequences per micro-batch
SEQ = 12  # even: tensor parallelism shards the sequence in two
STEPS = 3


def _cfg(**kw) -> GPTConfig:
    # Dim 0 of most parameters does not divide by 2 or 4: 61 tokens, 13 positions,
    # width 18 (qkv 54 rows, out 18, norms 18).
    base = dict(vocab_size=61, dim=18, n_layers=2, n_heads=2, max_seq_len=13)
    base.update(kw)
    return GPTConfig(**base)


def _batches(steps: int = STEPS):
    """``steps`` global batches of ``MICRO`` micro-batches, each ``(ROWS, SEQ)``."""
    g = torch.Generator().manual_seed(7)
    return [
        [
            (
                torch.randint(0, 61, (ROWS, SEQ), generator=g),
                torch.randint(0, 61, (ROWS, SEQ), generator=g),
            )
            for _ in range(MICRO)
        ]
        for _ in range(steps)
    ]


def _model(layout: str, deterministic: bool, bias: bool):
    torch.manual_seed(0)
    ws = dist.get_world_size()
    if layout == "2d":
        model = GPT(_cfg(fused_qkv=False, bias=bias))
        mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_transformer(model, mesh, tp_plan=tp_plan())
    elif layout == "hsdp":
        model = GPT(_cfg(bias=bias))
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = GPT(_cfg(bias=bias))
        mesh = init_device_mesh("cpu", (ws,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if deterministic:
        model.set_deterministic_reduction(True)
    return model, mesh


def _train(
    out: str, layout: str = "fsdp", deterministic: bool = False, clip: bool = False, bias=True
):
    """Train ``STEPS`` global batches; rank 0 saves the losses of every micro-batch (in the
    global batch's order) and the full parameters to ``out``. ``clip``: clip the gradients'
    norm to 0.1 before each step (the norm is about 1: it clips)."""
    model, mesh = _model(layout, deterministic, bias)
    if layout == "2d":
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    else:  # FSDP, or HSDP: data-parallel rank = replica * shards + shard = global rank
        dp_rank, dp_size = dist.get_rank(), dist.get_world_size()
    per_rank = MICRO // dp_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in _batches():
        mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        local = []
        for i, (x, y) in enumerate(mine):
            model.set_requires_gradient_sync(i == per_rank - 1)
            loss = gpt_loss(model, x, y)
            (loss / per_rank).backward()
            local.append(loss.detach())
        if clip:
            dtensor.clip_grad_norm_(model.parameters(), 0.1, deterministic=deterministic)
        opt.step()
        opt.zero_grad()
        gathered = [torch.empty(per_rank) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.stack(local))
        # rank r of the default group is dp rank r // tp (dp is the outer mesh dim)
        step = torch.cat(gathered).view(dp_size, -1, per_rank)[:, 0].reshape(-1)
        losses.append(step)
    params = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    if dist.get_rank() == 0:
        torch.save({"losses": torch.stack(losses), "params": params}, out)


def _load(path):
    return torch.load(path)


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    def bits(t):
        return t.contiguous().view(torch.int32)

    assert torch.equal(bits(a["losses"]), bits(b["losses"])), (a["losses"], b["losses"])
    assert a["params"].keys() == b["params"].keys()
    differ = [
        f"{name} ({(bits(t) != bits(b['params'][name])).sum().item()} elements)"
        for name, t in a["params"].items()
        if not torch.equal(bits(t), bits(b["params"][name]))
    ]
    assert not differ, "parameters differ bitwise: " + ", ".join(differ)


@functools.cache
def _one_process(bias: bool) -> dict:
    """The same training without fully_shard, in this process: the whole global batch's
    micro-batches accumulated by autograd."""
    torch.manual_seed(0)
    model = GPT(_cfg(bias=bias))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in _batches():
        step = []
        for x, y in batch:
            loss = gpt_loss(model, x, y)
            (loss / MICRO).backward()
            step.append(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(step))
    params = {name: p.detach() for name, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "params": params}


# ------------------------------------------------------------------------------ run to run
@pytest.mark.parametrize("route", ROUTES)
def test_two_runs_with_one_seed_and_layout_are_bit_identical(tmp_path, route):
    """The default mode: bit-identical run to run, and still equal to one process within
    the parity tests' tolerances (the deterministic mode changes nothing unless asked)."""
    # Without biases, as in the parity tests: the key projection's bias gets a gradient of
    # rounding noise only (softmax ignores it), which AdamW scales up to a full step.
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    run_on_ranks(2, _on_route, route=route, target=_train, out=str(a), bias=False)
    run_on_ranks(2, _on_route, route=route, target=_train, out=str(b), bias=False)
    first = _load(a)
    _assert_bitwise_equal(first, _load(b))
    ref = _one_process(bias=False)
    torch.testing.assert_close(first["losses"], ref["losses"], rtol=1e-5, atol=2e-6)
    for name, t in ref["params"].items():
        torch.testing.assert_close(first["params"][name], t, rtol=1e-5, atol=2e-6, msg=name)


def test_two_runs_of_fsdp_with_tensor_parallelism_are_bit_identical(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    run_on_ranks(4, _train, out=str(a), layout="2d")
    run_on_ranks(4, _train, out=str(b), layout="2d")
    _assert_bitwise_equal(_load(a), _load(b))


# ------------------------------------------------------------------------------ world size
@pytest.mark.parametrize("route, clip", [("direct", False), ("staged", True)])
def test_deterministic_mode_gives_world_size_4_equal_to_2_and_1_bit_for_bit(tmp_path, route, clip):
    """With ``clip``, ``dtensor.clip_grad_norm_(..., deterministic=True)`` before every step:
    the norm does not depend on the shard boundaries either."""
    runs = {ws: tmp_path / f"ws{ws}.pt" for ws in (1, 2, 4)}
    for ws, out in runs.items():
        run_on_ranks(
            ws, _on_route, route=route, target=_train, out=str(out), deterministic=True, clip=clip
        )
    ws1, ws2, ws4 = (_load(runs[ws]) for ws in (1, 2, 4))
    _assert_bitwise_equal(ws2, ws4)
    _assert_bitwise_equal(ws1, ws2)
    if not clip:  # HSDP (2 replicas x 2 shards): the replicas' sums are the tree's top level
        hsdp = tmp_path / "hsdp.pt"
        run_on_ranks(
            4,
            _on_route,
            route=route,
            target=_train,
            out=str(hsdp),
            layout="hsdp",
            deterministic=True,
        )
        _assert_bitwise_equal(ws2, _load(hsdp))


# ------------------------------------------------------------------------------ the tree
def _values(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [
        torch.randn(64, generator=g) * 10.0 ** torch.randint(-3, 4, (1,), generator=g)
        for _ in range(n)
    ]


def _reference_tree(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise, level by level, written out the slow way."""
    while len(parts) > 1:
        parts = [a + b for a, b in zip(parts[::2], parts[1::2])] + parts[len(parts) // 2 * 2 :]
    return parts[0]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 12, 13])
def test_tree_sum_groups_pairwise_and_nests(n):
    parts = _values(n)
    copies = [p.clone() for p in parts]
    scratch = [i % 2 == 1 for i in range(n)]  # a mix: some parts may be overwritten
    out = tree_sum_into(torch.empty(64), copies, scratch=scratch)
    assert torch.equal(out, _reference_tree(parts))
    for i in range(n):  # parts not marked as scratch are left alone
        if not scratch[i]:
            assert torch.equal(copies[i], parts[i])
    # runs of a power-of-two length summed first, then their sums: the same tree
    for run in (2, 4):
        if n % run == 0:
            sums = [_reference_tree(parts[i : i + run]) for i in range(0, n, run)]
            assert torch.equal(tree_sum_into(torch.empty(64), sums), out)
    if n >= 4:  # the sequential sum groups otherwise (the mode's reason to exist)
        assert not torch.equal(sum_into(torch.empty(64), parts), out)


def test_micro_batch_leaves_sum_as_the_tree():
    """A parameter's leaves (micro-batches accumulated without sync, one without a
    gradient) sum to the tree of all of them, with the missing one as zero."""
    from fsdp2._param import FSDPParam

    for n in (1, 2, 3, 4, 6, 8):
        parts = _values(n)
        holder = FSDPParam.__new__(FSDPParam)
        holder.grad_leaves, holder.unsharded_param = [], torch.nn.Parameter(torch.zeros(64))
        for i, part in enumerate(parts):
            holder.unsharded_param.grad = None if i == 1 else part.clone()
            if i < n - 1:
                holder.push_grad_leaf(torch.float32)
        total = holder.take_tree_grad(torch.float32)
        expected = _reference_tree([torch.zeros(64) if i == 1 else p for i, p in enumerate(parts)])
        assert torch.equal(total, expected), n
        assert holder.grad_leaves == []


# ------------------------------------------------------------------------------ the switch
def _same_collectives_and_checked_switch():
    from dtensor.debug import CommDebugMode

    model, _ = _model("fsdp", deterministic=False, bias=True)
    x, y = _batches(1)[0][0]
    seen = {}
    for mode in (False, True, False):
        model.set_deterministic_reduction(mode)
        with CommDebugMode() as comm:
            gpt_loss(model, x, y).backward()
        model.zero_grad()
        seen[mode] = [(r.kind, r.group_size, r.bytes) for r in comm.records]
    assert seen[True] == seen[False], "the mode must move the same collectives and bytes"
    assert seen[True], "nothing was recorded"
    model.set_requires_gradient_sync(False)
    gpt_loss(model, x, y).backward()  # unreduced gradients now wait
    with pytest.raises(RuntimeError, match="between steps"):
        model.set_deterministic_reduction(True)
    with pytest.raises(TypeError):
        model.set_deterministic_reduction("yes")


def test_mode_moves_the_same_collectives_and_switches_only_between_steps():
    run_on_ranks(2, _same_collectives_and_checked_switch)
