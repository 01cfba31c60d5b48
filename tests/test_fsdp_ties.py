"""Tied parameters in every wrapping pattern train like one process ([Note: tied parameters]).

A small net with two ties (``head.weight is emb.weight``; ``b[0].weight is a[0].weight``) is
wrapped in every pattern: one group, sibling groups in either order, one use in the root,
nested calls, list groups. Each trains three AdamW steps at 2 and 3 ranks against the
single-process reference, and the ties survive (the two names stay one parameter). Sibling
calls without an enclosing one fail at the first forward, naming both uses.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtensor import DTensor
from fsdp2 import fully_shard
from tests.harness import run_on_ranks

V, D = 11, 6


class TieNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.a = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        self.b[0].weight = self.a[0].weight

    def forward(self, idx):
        return self.head(self.b(self.a(self.emb(idx))))


def _wrap(pattern: str, m: TieNet, **kw) -> None:
    calls = {
        "one-group": [],
        "siblings": [m.emb, m.head, m.a, m.b],
        "siblings-reversed": [m.head, m.emb, m.b, m.a],
        "one-use-in-root": [m.head, m.a],
        "other-use-in-root": [m.emb, m.b],
        "nested": [m.a[0], m.a, m.b[0], m.b],
        "list-groups": [[m.emb, m.head], [m.a, m.b]],
        "mixed": [m.emb, [m.a, m.b[0]], m.head],
        "into-a-list": [m.a, [m.b, m.head]],
    }[pattern]
    for c in calls:
        fully_shard(c, **kw)
    fully_shard(m, **kw)


PATTERNS = [
    "one-group",
    "siblings",
    "siblings-reversed",
    "one-use-in-root",
    "other-use-in-root",
    "nested",
    "list-groups",
    "mixed",
    "into-a-list",
]


def _loss(model, idx):
    return nn.functional.cross_entropy(model(idx).reshape(-1, V), idx.roll(1, 1).reshape(-1))


def _train_tied(pattern: str, **kw):
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TieNet()
    torch.manual_seed(0)
    model = TieNet()
    _wrap(pattern, model, **kw)
    assert model.head.weight is model.emb.weight and model.b[0].weight is model.a[0].weight
    assert isinstance(model.emb.weight, DTensor) and isinstance(model.a[0].weight, DTensor)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        idx = torch.randint(0, V, (2 * ws, 4), generator=g)
        _loss(ref, idx).backward()
        _loss(model, idx[2 * rank : 2 * rank + 2]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert model.head.weight is model.emb.weight and model.b[0].weight is model.a[0].weight
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_ties_train_like_one_process_in_every_wrapping(pattern, ws):
    run_on_ranks(ws, _train_tied, pattern=pattern)


@pytest.mark.parametrize("raf", [True, False, 1], ids=["raf-True", "raf-False", "raf-1"])
@pytest.mark.parametrize("ws", [1, 2])
def test_a_group_left_empty_by_a_tie_does_nothing(ws, raf):
    # "siblings": emb's and head's calls each lose their only parameter to the root's group
    run_on_ranks(ws, _train_tied, pattern="siblings", reshard_after_forward=raf)


def _siblings_without_an_enclosing_call():
    torch.manual_seed(0)
    m = TieNet()
    fully_shard(m.emb)
    fully_shard(m.head)
    with pytest.raises(
        ValueError,
        match=r"Embedding\.weight is tied to Linear\.weight.*\(on Embedding and on Linear\).*"
        r"Call fully_shard on a module that contains both uses",
    ):
        m(torch.zeros(1, 2, dtype=torch.long))


def test_sibling_ties_need_an_enclosing_call():
    run_on_ranks(2, _siblings_without_an_enclosing_call)


# ------------------------------------------------------------------------ originals kept alive
def _gpt_with_optimizer_built_first():
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=67, dim=30, n_layers=2, n_heads=3, max_seq_len=3))
    stale = torch.optim.SGD(model.parameters(), lr=0.5)  # built before fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, stale


def _no_heap_scan():
    from examples.gpt import gpt_loss

    model, stale = _gpt_with_optimizer_built_first()  # it keeps every original alive
    saved = gc.get_referrers

    def refuse(*objs):
        raise AssertionError("lazy init scanned the heap (gc.get_referrers)")

    gc.get_referrers = refuse
    try:
        x = torch.randint(0, 67, (2, 3))
        gpt_loss(model, x, x).backward()  # lazy init walks the module tree only
    finally:
        gc.get_referrers = saved


def test_lazy_init_finds_ties_without_scanning_the_heap():
    run_on_ranks(2, _no_heap_scan)


def _stale_optimizer():
    from examples.gpt import gpt_loss

    model, stale = _gpt_with_optimizer_built_first()
    x = torch.randint(0, 67, (2, 3))
    gpt_loss(model, x, x).backward()
    before = [p.full_tensor().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError,
        match=r"SGD\.step: 29 of the optimizer's parameters \('tok_emb\.weight', "
        r"'pos_emb\.weight', 'blocks\.0\.ln1\.weight'.*after fully_shard",
    ):
        stale.step()
    for p, b in zip(model.parameters(), before, strict=True):  # nothing was updated
        assert torch.equal(p.full_tensor(), b)
    fresh = torch.optim.SGD(model.parameters(), lr=0.5)
    fresh.step()  # the right way works
    assert not all(torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before))


def test_optimizer_built_before_fully_shard_raises_at_step():
    run_on_ranks(2, _stale_optimizer)
