"""Random module trees, wrapped at random, train like one process (and like torch FSDP2).

Each seed draws a small model - an embedding, a chain of stages that are random trees of
linears, MLPs and norms (sizes not divisible by the world size, a vocabulary smaller than
some shard counts), a head - and a way to wrap it: which submodules get ``fully_shard`` (in
bottom-up order), list groups of siblings, ``reshard_after_forward`` per call (True, False,
None or an int), tied weights (head to embedding, one linear to another), frozen
parameters, bf16 compute, gradient accumulation with or without sync, and HSDP at four
ranks. Three AdamW steps must match the single-process reference; where torch FSDP2
supports the layout (no parameter shared between two calls), they must match it too.

Tolerances and learning rate are the parity suite's (fp32: rtol 1e-5, atol 2e-6 at lr 1e-3).
Even at two ranks the libraries are not bit-identical here: with these odd widths the last
bits of a gradient depend on where each library keeps its unsharded buffers (kernel paths
follow alignment), and AdamW turns such rounding on near-zero gradients into steps of up to
~lr; at lr 1e-2 two of 200 seeds exceeded the tolerance against one process, torch FSDP2 by
as much as ours.

``make test`` runs the first fixed seeds below, ``make test-all`` (TEST_ALL=1) all of them;
``pytest tests/test_fsdp_layouts.py --layout-seeds 200`` runs 200 more.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_on_ranks

FIXED_SEEDS = list(range(14)) + [1004]  # 1004: a tie pending through a list call
NIGHTLY_SEEDS = {2, 3, *range(7, 14)}  # make test-all only: make test stays within 5 minutes
PER_RANK = 2
SEQ = 3


@dataclass
class Layout:
    """Everything one seed decides; ``describe()`` is the test id's explanation."""

    seed: int
    ws: int
    hsdp: bool
    vocab: int
    dim: int
    tree: list  # per stage: a nested list of leaf kinds ("linear", "mlp", "norm")
    tie_head: bool
    tie_linears: bool
    frozen: list = field(default_factory=list)  # parameter names
    wrap: list = field(default_factory=list)  # calls, bottom-up: a path or a list of paths
    reshard: dict = field(default_factory=dict)  # call index -> reshard_after_forward
    bf16: bool = False
    accumulate: str | None = None  # None, "sync" or "no_sync"

    def describe(self) -> str:
        return (
            f"seed {self.seed}: ws {self.ws}{' HSDP' if self.hsdp else ''}, vocab {self.vocab}, "
            f"dim {self.dim}, tree {self.tree}, ties head={self.tie_head} "
            f"linears={self.tie_linears}, frozen {self.frozen}, wrap {self.wrap}, reshard "
            f"{self.reshard}, bf16 {self.bf16}, accumulate {self.accumulate}"
        )


# ----------------------------------------------------------------------------- the model
class Node(nn.Module):
    """A residual chain of children: ``x = x + tanh(child(x))`` for each."""

    def __init__(self, children) -> None:
        super().__init__()
        self.items = nn.ModuleList(children)

    def forward(self, x):
        for child in self.items:
            x = x + torch.tanh(child(x))
        return x


def _leaf(kind: str, d: int) -> nn.Module:
    if kind == "linear":
        return nn.Linear(d, d)
    if kind == "norm":
        return nn.LayerNorm(d)
    return nn.Sequential(nn.Linear(d, 2 * d + 1), nn.GELU(), nn.Linear(2 * d + 1, d))


def _subtree(spec, d: int) -> nn.Module:
    if isinstance(spec, str):
        return _leaf(spec, d)
    return Node([_subtree(s, d) for s in spec])


class Net(nn.Module):
    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self.emb = nn.Embedding(layout.vocab, layout.dim)
        self.stages = nn.ModuleList(_subtree(s, layout.dim) for s in layout.tree)
        self.head = nn.Linear(layout.dim, layout.vocab, bias=False)
        if layout.tie_head:
            self.head.weight = self.emb.weight
        if layout.tie_linears:
            linears = [m for m in self.stages.modules() if type(m) is nn.Linear]
            square = [m for m in linears if m.weight.shape[0] == m.weight.shape[1]]
            if len(square) >= 2:
                square[-1].weight = square[0].weight

    def forward(self, idx):
        x = self.emb(idx)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def build(layout: Layout) -> Net:
    torch.manual_seed(layout.seed)
    net = Net(layout)
    for name, p in net.named_parameters():
        if name in layout.frozen:
            p.requires_grad_(False)
    return net


# ----------------------------------------------------------------------------- drawing
def _tree(rng: random.Random, depth: int):
    kinds = ["linear", "mlp", "norm"]
    if depth == 0 or rng.random() < 0.35:
        return rng.choice(kinds)
    return [_tree(rng, depth - 1) for _ in range(rng.randint(1, 3))]


def draw(seed: int) -> Layout:
    rng = random.Random(seed)
    ws = [2, 3, 4][seed % 3]
    layout = Layout(
        seed=seed,
        ws=ws,
        hsdp=ws == 4 and rng.random() < 0.5,
        vocab=rng.choice([3, 5, 11]),
        dim=rng.choice([5, 6, 9]),
        tree=[[_tree(rng, 2) for _ in range(rng.randint(1, 2))] for _ in range(rng.randint(1, 3))],
        tie_head=rng.random() < 0.4,
        tie_linears=rng.random() < 0.4,
        bf16=rng.random() < 0.25,
        accumulate=rng.choice([None, None, "sync", "no_sync"]),
    )
    net = build(layout)
    names = [n for n, _ in net.named_parameters()]
    layout.frozen = sorted(rng.sample(names, k=min(len(names) - 1, rng.randint(0, 2))))
    # wrapping: random submodules, deepest first, sometimes a pair of siblings as one call
    paths = {m: n for n, m in net.named_modules() if n}
    candidates = [m for m in paths if isinstance(m, (Node, nn.Linear, nn.Sequential, nn.Embedding))]
    candidates = [m for m in candidates if not isinstance(m, nn.ModuleList)]
    chosen = [m for m in candidates if rng.random() < 0.4]
    chosen.sort(key=lambda m: -paths[m].count("."))
    calls, used = [], set()
    for m in chosen:
        if m in used:
            continue
        used.add(m)
        siblings = [s for s in chosen if s not in used and _parent(paths[s]) == _parent(paths[m])]
        if siblings and rng.random() < 0.5:
            used.add(siblings[0])
            calls.append([paths[m], paths[siblings[0]]])
        else:
            calls.append(paths[m])
    layout.wrap = calls
    shard_size = 2 if layout.hsdp else ws
    options = [True, False, None] + ([2] if shard_size == 4 else [])
    layout.reshard = {i: rng.choice(options) for i in range(len(calls) + 1)}  # + the root
    return layout


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _shares_across_calls(layout: Layout) -> bool:
    """Whether one parameter is registered in modules whose nearest enclosing fully_shard
    calls differ (torch FSDP2 cannot shard that, so it is no oracle there)."""
    net = build(layout)
    calls = [c if isinstance(c, list) else [c] for c in layout.wrap]

    def nearest_call(module_path: str):
        best, depth = "root", -1
        for i, paths in enumerate(calls):
            for q in paths:
                if (module_path == q or module_path.startswith(q + ".")) and q.count(".") > depth:
                    best, depth = i, q.count(".")
        return best

    owners: dict[int, set] = {}
    for path, m in net.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(nearest_call(path))
    return any(len(o) > 1 for o in owners.values())


# ----------------------------------------------------------------------------- training
def _wrap(layout: Layout, net: Net, shard, mesh, mp_policy) -> None:
    for i, call in enumerate(layout.wrap):
        target = (
            [net.get_submodule(p) for p in call]
            if isinstance(call, list)
            else net.get_submodule(call)
        )
        shard(target, mesh=mesh, reshard_after_forward=layout.reshard[i], mp_policy=mp_policy)
    shard(
        net, mesh=mesh, reshard_after_forward=layout.reshard[len(layout.wrap)], mp_policy=mp_policy
    )


def _train(layout: Layout, net: nn.Module, *, local: bool) -> list[float]:
    from fsdp2 import FSDPModule

    rank, ws = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1000 + layout.seed)
    losses = []
    for _ in range(3):
        idx = torch.randint(0, layout.vocab, (PER_RANK * ws, SEQ), generator=g)
        tgt = torch.randint(0, layout.vocab, (PER_RANK * ws, SEQ), generator=g)
        if local:
            idx, tgt = (
                idx[rank * PER_RANK : (rank + 1) * PER_RANK],
                tgt[rank * PER_RANK : (rank + 1) * PER_RANK],
            )
        parts = [slice(0, len(idx))] if layout.accumulate is None else [
            slice(0, len(idx) // 2), slice(len(idx) // 2, len(idx))
        ]  # fmt: skip
        total = 0.0
        for i, rows in enumerate(parts):
            if layout.accumulate == "no_sync" and isinstance(net, FSDPModule):
                net.set_requires_gradient_sync(i == len(parts) - 1)
            out = net(idx[rows]).float()
            loss = nn.functional.cross_entropy(out.reshape(-1, layout.vocab), tgt[rows].reshape(-1))
            loss = loss / len(parts)
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        total = torch.as_tensor(total).clone()
        if local:
            dist.all_reduce(total)
            total /= ws
        losses.append(total.item())
    return losses


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _check_layout(seed: int):
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from device_mesh import init_device_mesh
    from fsdp2 import MixedPrecisionPolicy, fully_shard

    layout = draw(seed)
    ws = dist.get_world_size()
    shape = (2, 2) if layout.hsdp else (ws,)
    names = ("replicate", "shard") if layout.hsdp else None
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if layout.bf16 else {}
    ref = build(layout)
    ref_losses = _train(layout, ref, local=False)
    ours = build(layout)
    _wrap(layout, ours, fully_shard, init_device_mesh("cpu", shape, mesh_dim_names=names),
          MixedPrecisionPolicy(**bf16))  # fmt: skip
    losses = _train(layout, ours, local=True)
    ref_params = dict(ref.named_parameters())
    tol = dict(rtol=2e-2, atol=0) if layout.bf16 else dict(rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    if not layout.bf16:
        for name, p in ours.named_parameters():
            torch.testing.assert_close(_full(p), ref_params[name].detach(), **tol, msg=name)
    if not _shares_across_calls(layout):
        theirs = build(layout)
        _wrap(layout, theirs, torch_fully_shard, torch_init("cpu", shape, mesh_dim_names=names),
              TorchMP(**bf16))  # fmt: skip
        their_losses = _train(layout, theirs, local=True)
        close = dict(rtol=1.6e-2, atol=1e-3) if layout.bf16 else dict(rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(their_losses), **close)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(_full(p), _full(q), **close, msg=name)


def _seeds(config) -> list[int]:
    extra = config.getoption("--layout-seeds")
    return FIXED_SEEDS + list(range(1000, 1000 + extra))


def pytest_generate_tests(metafunc):
    if "layout_seed" in metafunc.fixturenames:
        seeds = [
            pytest.param(s, marks=pytest.mark.nightly) if s in NIGHTLY_SEEDS else s
            for s in _seeds(metafunc.config)
        ]
        metafunc.parametrize("layout_seed", seeds)


def test_random_layout_trains_like_one_process(layout_seed):
    layout = draw(layout_seed)
    try:
        run_on_ranks(layout.ws, _check_layout, seed=layout_seed)
    except AssertionError as e:
        raise AssertionError(f"{layout.describe()}\n{e}") from None
