"""A training loop the parity tests of real clients share (activation checkpointing forms,
PEFT LoRA): global batches, this rank's rows, losses averaged over ranks, and a comparison
of losses and full parameters between two models."""

from __future__ import annotations

import torch
import torch.distributed as dist


def batches(vocab: int, seq: int, per_rank: int, steps: int, seed: int = 3):
    """``steps`` global batches of token ids and targets, ``per_rank`` rows per rank."""
    g = torch.Generator().manual_seed(seed)
    n = per_rank * dist.get_world_size()
    return [
        (
            torch.randint(0, vocab, (n, seq), generator=g),
            torch.randint(0, vocab, (n, seq), generator=g),
        )
        for _ in range(steps)
    ]


def adamw(model):
    """AdamW over the parameters that train."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)


def train(model, batches, loss_of, *, per_rank: int | None = None, opt=None) -> list[float]:
    """One step per batch; with ``per_rank`` each rank takes its rows and the losses are
    averaged over ranks (else the whole batch: one process). Returns the global losses."""
    opt = adamw(model) if opt is None else opt
    rank, ws = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in batches:
        if per_rank is not None:
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            x, y = x[rows], y[rows]
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().float().clone()
        if per_rank is not None:
            dist.all_reduce(loss)
            loss /= ws
        losses.append(loss.item())
    return losses


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter, ours or PyTorch's DTensor or a plain tensor."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def compare(a, b, losses_a, losses_b, *, rtol: float = 1e-5, atol: float = 2e-6) -> None:
    """Equal losses and equal full parameters, name by name."""
    torch.testing.assert_close(torch.tensor(losses_a), torch.tensor(losses_b), rtol=rtol, atol=atol)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        torch.testing.assert_close(full(p), full(pb[name]), rtol=rtol, atol=atol, msg=name)
