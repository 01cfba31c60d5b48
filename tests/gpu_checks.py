"""fully_shard on a real GPU, one check per ``torchrun`` job (NCCL, one device per rank).

    python -m torch.distributed.run --standalone --nproc-per-node=1 tests/gpu_checks.py bf16
    ... tests/gpu_checks.py offload | memory | parity2

``tests/test_fsdp_gpu.py`` runs these when CUDA is present and skips them otherwise. Each
check trains a small GPT with awkward sizes (vocabulary 67, width 30, 3 position rows) for 4
AdamW steps and compares with an oracle: torch's FSDP2 under the same policy, the same model
without offload, the plain model, or ``torch.cuda``'s own memory counters.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from device_mesh import init_device_mesh  # noqa: E402
from examples.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402
from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: E402

STEPS = 4
CFG = GPTConfig(vocab_size=67, dim=30, n_layers=2, n_heads=3, max_seq_len=3, bias=False)


def _build(shard=None, device="cuda", **kw):
    torch.manual_seed(0)
    model = GPT(CFG)
    torch.manual_seed(0)
    model.reset_parameters()
    if shard is None:
        return model.to(device)
    if "offload_policy" not in kw:
        model = model.to(device)
    for block in model.blocks:
        shard(block, **kw)
    shard(model, **kw)
    return model


def _train(model, steps=STEPS, batch_device="cuda"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(dist.get_rank() + 1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=g).to(batch_device)
        y = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=g).to(batch_device)
        loss = gpt_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


def _full(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().cpu()
    return out


def check_bf16() -> None:
    """bf16 params + fp32 reduce: equal to torch FSDP2 under the same policy (bf16
    tolerance), and close to the fp32 plain model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    ours = _build(
        fully_shard, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    )
    theirs = _build(torch_fully_shard, mp_policy=TorchMP(torch.bfloat16, torch.float32))
    plain = _build()
    l_ours, _ = _train(ours)
    l_theirs, _ = _train(theirs)
    l_plain, _ = _train(plain)
    torch.testing.assert_close(l_ours, l_theirs, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(l_ours, l_plain, rtol=5e-2, atol=5e-2)
    a, b = _full(ours), _full(theirs)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=2e-2, atol=2e-2, msg=k)
    for p in ours.parameters():  # the optimizer sees fp32 shards on the GPU
        assert p.dtype == torch.float32 and p.to_local().is_cuda


def check_offload() -> None:
    """CPUOffloadPolicy: shards, gradients and optimizer state in pinned host memory, and
    the same training result as without offload."""
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    ref = _build(fully_shard, mesh=mesh)
    off = _build(fully_shard, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
    l_ref, _ = _train(ref)
    l_off, opt = _train(off)
    torch.testing.assert_close(l_off, l_ref, rtol=1e-5, atol=1e-6)
    a, b = _full(off), _full(ref)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=2e-6, msg=k)
    for p in off.parameters():
        local = p.to_local()
        assert local.device.type == "cpu" and local.is_pinned(), p.shape
        for v in opt.state[p].values():
            if v.ndim:
                assert v.to_local().device.type == "cpu"
    # gradients arrive on the host too
    x = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), device="cuda")
    gpt_loss(off, x, x).backward()
    assert all(p.grad.to_local().device.type == "cpu" for p in off.parameters())


def check_memory() -> None:
    """torch.cuda's counters agree with the state the library says it holds, and with
    PyTorch's MemTracker at the peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = _build(fully_shard, mesh=mesh)
    _, opt = _train(model)
    torch.cuda.synchronize()

    def local_bytes(t):
        t = t.to_local()
        return t.numel() * t.element_size()

    state = sum(local_bytes(p) for p in model.parameters())
    state += sum(
        local_bytes(v) for p in model.parameters() for v in opt.state[p].values() if v.ndim
    )
    # cuBLAS keeps a workspace (32 MiB on Hopper) from the caching allocator: not state
    torch._C._cuda_clearCublasWorkspaces()
    allocated = torch.cuda.memory_allocated()
    # at rest (grads set to None): parameters and AdamW state, plus the allocator's rounding
    assert state <= allocated <= state + 64 * 1024 * len(list(model.parameters())) * 3, (
        state,
        allocated,
    )
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), device="cuda")
    with tracker:
        gpt_loss(model, x, x).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    tracked = tracker.get_tracker_snapshot("peak")[
        torch.device("cuda", torch.cuda.current_device())
    ]["Total"]
    peak = torch.cuda.max_memory_allocated()
    # the step made cuBLAS's workspace again; MemTracker sees tensors only
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    workspace = before - torch.cuda.memory_allocated()
    peak -= workspace
    assert base <= peak and abs(tracked - peak) <= 0.25 * peak + 2**20, (tracked, peak, workspace)


def check_parity2() -> None:
    """Two GPUs: fully_shard equals the single-process model on the whole batch."""
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = _build(fully_shard, mesh=mesh)
    losses, _ = _train(model)
    ref = _build()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    gens = [torch.Generator().manual_seed(r + 1) for r in range(dist.get_world_size())]
    for _ in range(STEPS):
        xs, ys = [], []
        for g in gens:
            xs.append(torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=g))
            ys.append(torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len), generator=g))
        loss = gpt_loss(ref, torch.cat(xs).cuda(), torch.cat(ys).cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
    a, b = _full(model), _full(ref)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=2e-6, msg=k)


CHECKS = {
    "bf16": check_bf16,
    "offload": check_offload,
    "memory": check_memory,
    "parity2": check_parity2,
}


def _init_process_group() -> None:
    """One NCCL rank per GPU: torchrun sets LOCAL_RANK; the checks read the default group."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    # gloo beside NCCL, as PyTorch's default: CPU offload's full_tensor() gathers host shards
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))


if __name__ == "__main__":
    _init_process_group()
    CHECKS[sys.argv[1]]()
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"gpu check {sys.argv[1]}: ok")
    dist.destroy_process_group()
