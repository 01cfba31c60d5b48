"""accelerate's FSDP2 ``save_state`` / ``load_state`` on a GPU, as PyTorch ships and with this
project's names swapped in at accelerate's import sites: a resumed run continues bit for bit,
and the ported run is PyTorch's to the bit (case 1 of
tests/test_client_accelerate_checkpoints.py, on CUDA at world size 1).

Run (one CUDA GPU, NCCL, no network needed; accelerate installed, transformers not needed):

    python3 -m torch.distributed.run --standalone --nproc-per-node=1 tests/gpu_accelerate_ckpt.py

and on a CPU (gloo), to check the script before a GPU is used:

    python3 -m torch.distributed.run --standalone --nproc-per-node=1 tests/gpu_accelerate_ckpt.py --cpu

Prints ``gpu accelerate ckpt: ok`` and exits 0, or prints what differs and exits 1. The model
is a small language model of plain modules (vocabulary 67, 2 blocks each its own FSDP group
through accelerate's ``transformer_based_wrap``), AdamW, 2 steps, ``save_state``, 1 more step;
then a model from another seed, ``load_state``, 1 step. cuBLAS and cuDNN run deterministic
kernels (``CUBLAS_WORKSPACE_CONFIG``, ``torch.use_deterministic_algorithms``, no TF32) so the
two arms' kernels give the same bits for the same inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import _clients  # noqa: E402

VOCAB, DIM, SEQ, ROWS, STEPS_BEFORE_SAVE = 67, 64, 16, 4, 2


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _step(acc, model, opt, step: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g).to(acc.device)
    logits = model(x)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}


def _plugin() -> dict:
    return dict(
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
    )


def _program(ckpt: str, cpu: bool) -> dict:
    out = {}
    with _clients.fsdp2_accelerator(cpu=cpu, **_plugin()) as acc:
        model = _model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt = acc.prepare(model, opt)
        p = next(iter(model.parameters()))
        out["where"] = (type(p).__module__.split(".")[0], p.device.type)
        out["losses"] = [_step(acc, model, opt, s) for s in range(STEPS_BEFORE_SAVE)]
        out["saved"] = _full(model)
        acc.save_state(ckpt)
        out["loss_on"] = _step(acc, model, opt, STEPS_BEFORE_SAVE)
        out["params_on"] = _full(model)
    with _clients.fsdp2_accelerator(cpu=cpu, **_plugin()) as acc:
        model = _model(7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt = acc.prepare(model, opt)
        acc.load_state(ckpt)
        out["loaded"] = _full(model)
        out["loss_resumed"] = _step(acc, model, opt, STEPS_BEFORE_SAVE)
        out["params_resumed"] = _full(model)
    return out


def _params_diff(got: dict, want: dict, what: str) -> list[str]:
    if list(got) != list(want):
        return [f"{what}: parameter names differ: {list(got)} vs {list(want)}"]
    return [
        f"{what}: {n} differs (max |diff| {(got[n].double() - want[n].double()).abs().max().item():.3g})"
        for n in want
        if not (got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]))
    ]


def _resume_problems(out: dict, arm: str) -> list[str]:
    problems = _params_diff(out["loaded"], out["saved"], f"{arm}: load_state")
    if out["loss_resumed"] != out["loss_on"]:
        problems.append(f"{arm}: resumed loss {out['loss_resumed']!r} != {out['loss_on']!r}")
    return problems + _params_diff(out["params_resumed"], out["params_on"], f"{arm}: resumed step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU instead of NCCL")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if not args.cpu:
        if not torch.cuda.is_available():
            print("gpu accelerate ckpt: no CUDA device (use --cpu to run on the CPU)")
            return 1
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    if not dist.is_initialized():
        dist.init_process_group("gloo" if args.cpu else "nccl")
    device = "cpu" if args.cpu else "cuda"
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt_dir = [tmp]
        dist.broadcast_object_list(ckpt_dir, src=0)  # one directory for every rank
        want = _program(os.path.join(ckpt_dir[0], "torch"), args.cpu)
        with _clients.ported("full") as port:
            got = _program(os.path.join(ckpt_dir[0], "ported"), args.cpu)
        dist.barrier()
    if want["where"] != ("torch", device) or got["where"] != ("dtensor", device):
        problems.append(f"parameters: PyTorch's run {want['where']}, ported {got['where']}")
    if ("accelerate.utils.fsdp_utils", "torch.distributed.checkpoint") not in port["imports"]:
        problems.append(f"the port did not reach accelerate's checkpoint imports: {port}")
    problems += _resume_problems(want, "torch")
    problems += _resume_problems(got, "ported")
    if got["losses"] != want["losses"]:
        problems.append(f"losses: ported {got['losses']} vs torch {want['losses']}")
    for key in ("saved", "params_on", "loaded", "params_resumed"):
        problems += _params_diff(got[key], want[key], f"ported vs torch: {key}")
    for key in ("loss_on", "loss_resumed"):
        if got[key] != want[key]:
            problems.append(f"ported vs torch: {key} {got[key]!r} != {want[key]!r}")
    seconds = time.perf_counter() - t0
    if dist.get_rank() == 0:
        for line in problems:
            print(line)
        where = torch.cuda.get_device_name() if not args.cpu else "cpu"
        verdict = "ok" if not problems else f"FAILED ({len(problems)} differences)"
        print(f"gpu accelerate ckpt: {verdict} ({where}, torch {torch.__version__}, "
              f"world size {dist.get_world_size()}, {seconds:.1f}s; losses {want['losses']} "
              f"{want['loss_on']})")  # fmt: skip
    dist.destroy_process_group()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
