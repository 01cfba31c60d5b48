"""Distributed checkpoints reshard across world sizes and layouts with bit-identical values.

A GPT (vocabulary 67: uneven over 2, 3 and 4 ranks; position table of 3 rows: fewer rows than
ranks at world size 4, so one rank's shard is empty) trains 2 AdamW steps as FSDP at world
size 4, saves model + optimizer state, then takes a third step. Every other layout builds the
model from another seed, loads the checkpoint, and must hold bit-identical values for every
parameter, optimizer moment and step counter; its third step must then match the original's
(rtol 1e-5 / atol 2e-6: gradients are summed in another order at another world size, as in
tests/test_fsdp_parity.py). The reverse directions (2-D -> 1-D, one process -> sharded) are
checked the same way.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from device_mesh import init_device_mesh
from dtensor import DTensor
from dtensor import checkpoint as dcp
from dtensor.checkpoint import api
from dtensor.checkpoint._flatten import flatten
from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan
from fsdp2 import parallelize_transformer
from tests.harness import run_on_ranks

VOCAB, SEQ, BATCH = 67, 2, 12  # 12 rows split evenly over 1, 2, 3 and 4 data-parallel ranks
RTOL, ATOL = 1e-5, 2e-6

LAYOUTS = {  # name -> (mesh shape, dim names)
    "fsdp1": ((1,), ("dp",)),
    "fsdp2": ((2,), ("dp",)),
    "fsdp3": ((3,), ("dp",)),
    "fsdp4": ((4,), ("dp",)),
    "hsdp2x2": ((2, 2), ("dp_replicate", "dp_shard")),
    "fsdp2_tp2": ((2, 2), ("dp", "tp")),
    "tp2": ((2,), ("tp",)),
}


def _cfg() -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, dim=24, n_layers=2, n_heads=4, max_seq_len=3, bias=False,
                     fused_qkv=False)  # fmt: skip


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))  # fmt: skip


def _build(layout: str | None, seed: int):
    torch.manual_seed(seed)
    model = GPT(_cfg())
    if layout is None:
        return model, 0, 1
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    parallelize_transformer(model, mesh, tp_plan=tp_plan() if "tp" in names else None)
    dp = [n for n in names if n != "tp"]
    index, count = 0, 1
    for n in dp:
        index, count = (
            index * mesh.size(names.index(n)) + mesh.get_local_rank(n),
            count * mesh.size(names.index(n)),
        )
    return model, index, count


def _step(model, opt, step: int, index: int, count: int) -> None:
    x, y = _batch(step)
    rows = slice(index * BATCH // count, (index + 1) * BATCH // count)
    gpt_loss(model, x[rows], y[rows]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()


def _state(model, opt, step: int) -> dict:
    return {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt),
            "step": step}  # fmt: skip


def _full(sd: dict) -> dict[str, torch.Tensor]:
    out = {}
    for key, (_, v) in flatten(sd).items():
        if isinstance(v, torch.Tensor):
            out[key] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _params(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _train_and_save(layout: str | None, directory: str) -> None:
    """2 steps, save, reference values, third step, reference parameters after it."""
    model, index, count = _build(layout, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(2):
        _step(model, opt, step, index, count)
    sd = _state(model, opt, 2)
    dcp.save(sd, checkpoint_id=Path(directory) / "ckpt")
    before = _full(sd)
    _step(model, opt, 2, index, count)
    after = _params(model)
    if _rank0():
        save_file(before, str(Path(directory) / "before.safetensors"))
        save_file(after, str(Path(directory) / "after.safetensors"))


def _load_and_continue(layout: str | None, directory: str) -> None:
    model, index, count = _build(layout, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=5.0, weight_decay=0.0)  # overwritten by the load
    sd = _state(model, opt, 0)
    dcp.load(sd, checkpoint_id=Path(directory) / "ckpt")
    dcp.set_optimizer_state_dict(model, opt, sd["optim"])
    assert sd["step"] == 2
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    expected = load_file(str(Path(directory) / "before.safetensors"))
    got = _full(_state(model, opt, 2))
    assert got.keys() == expected.keys()
    for key, value in got.items():
        assert torch.equal(value, expected[key]), f"{layout}: {key} differs after load"
    _step(model, opt, 2, index, count)
    after = load_file(str(Path(directory) / "after.safetensors"))
    for name, value in _params(model).items():
        torch.testing.assert_close(
            value, after[name], rtol=RTOL, atol=ATOL, msg=f"{layout}: {name}"
        )


def _in_process(fn, layout, directory) -> None:
    assert not dist.is_initialized()
    fn(layout, directory)


@pytest.fixture(scope="module")
def fsdp4_checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fsdp4"))
    run_on_ranks(4, _train_and_save, layout="fsdp4", directory=directory)
    return directory


@pytest.mark.parametrize("layout", ["fsdp1", "fsdp2", "fsdp3", "hsdp2x2", "fsdp2_tp2", None])
def test_fsdp4_checkpoint_loads_into_every_layout(fsdp4_checkpoint, layout):
    if layout is None:  # a plain model in this process, no process group
        _in_process(_load_and_continue, None, fsdp4_checkpoint)
        return
    ws = 1
    for s in LAYOUTS[layout][0]:
        ws *= s
    run_on_ranks(ws, _load_and_continue, layout=layout, directory=fsdp4_checkpoint)


def test_2d_checkpoint_loads_into_1d_and_one_process(tmp_path):
    run_on_ranks(4, _train_and_save, layout="fsdp2_tp2", directory=str(tmp_path))
    run_on_ranks(2, _load_and_continue, layout="fsdp2", directory=str(tmp_path))
    _in_process(_load_and_continue, None, str(tmp_path))


def test_one_process_checkpoint_loads_into_sharded_layouts(tmp_path):
    _in_process(_train_and_save, None, str(tmp_path))
    run_on_ranks(3, _load_and_continue, layout="fsdp3", directory=str(tmp_path))
    run_on_ranks(2, _load_and_continue, layout="tp2", directory=str(tmp_path))


def test_files_are_plain_safetensors_and_json(fsdp4_checkpoint):
    ckpt = Path(fsdp4_checkpoint) / "ckpt"
    meta = json.loads((ckpt / "metadata.json").read_text())
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert files == sorted(meta["files"]) and len(files) == 4  # every rank wrote a share
    expected = load_file(str(Path(fsdp4_checkpoint) / "before.safetensors"))
    seen = {}
    for name in files:
        for key, block in load_file(str(ckpt / name)).items():
            chunk = next(c for c in meta["tensors"][key]["chunks"] if c["file"] == name)
            box = tuple(slice(o, o + s) for o, s in zip(chunk["offsets"], chunk["sizes"]))
            assert torch.equal(block, expected[key][box]), (name, key)
            seen[key] = seen.get(key, 0) + block.numel()
    assert seen == {k: v.numel() for k, v in expected.items() if v.numel() > 0}
    # the position table has 3 rows over 4 ranks: 3 chunks, none empty
    assert len(meta["tensors"]["model.pos_emb.weight"]["chunks"]) == 3
    # replicated values (step counters) are written once each
    steps = [k for k in meta["tensors"] if k.endswith(".step")]
    assert steps and all(len(meta["tensors"][k]["chunks"]) == 1 for k in steps)
    assert meta["values"]["step"] == 2


def _async_save_snapshots(directory: str) -> None:
    model, index, count = _build("fsdp2", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 0, index, count)
    sd = _state(model, opt, 1)
    expected = _full(sd)
    # Hold the background writer until the model has moved on, so the test sees whether the
    # snapshot was really taken when async_save returned.
    moved_on = threading.Event()
    real_write = api.write_file

    def write_after_training_moved_on(path, items):
        assert moved_on.wait(timeout=60)
        return real_write(path, items)

    api.write_file = write_after_training_moved_on
    try:
        future = dcp.async_save(sd, checkpoint_id=Path(directory) / "ckpt")
        _step(model, opt, 1, index, count)  # the model and optimizer move on at once
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(-1.0)
            for state in opt.state.values():
                for v in state.values():
                    (v.to_local() if isinstance(v, DTensor) else v).fill_(-1.0)
        moved_on.set()
        assert "model.tok_emb.weight" in future.result(timeout=60).state_dict_metadata
    finally:
        api.write_file = real_write
    loaded = _state(*_fresh("fsdp2"), 0)
    dcp.load(loaded, checkpoint_id=Path(directory) / "ckpt")
    got = _full(loaded)
    assert got.keys() == expected.keys()
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key
    assert loaded["step"] == 1


def _fresh(layout):
    model, _, _ = _build(layout, seed=3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_async_save_writes_the_state_as_it_was_when_called(tmp_path):
    run_on_ranks(2, _async_save_snapshots, directory=str(tmp_path))


def _full_state_dict_options():
    """Full state dicts on rank 0 only (cpu_offload), and back in by broadcast from rank 0."""
    model, index, count = _build("fsdp2", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, 0, index, count)
    opts = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = dcp.get_model_state_dict(model, options=opts)
    full_optim = dcp.get_optimizer_state_dict(model, opt, options=opts)
    if dist.get_rank() == 0:
        assert full and all(not isinstance(v, DTensor) for v in full.values())
        assert full["tok_emb.weight"].shape == (VOCAB, 24)
    else:
        assert full == {} and full_optim == {}
    fresh, _, _ = _build("fsdp2", seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=7.0)
    bcast = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dcp.set_model_state_dict(fresh, full, options=bcast)
    dcp.set_optimizer_state_dict(fresh, fresh_opt, full_optim, options=bcast)
    assert fresh_opt.param_groups[0]["lr"] == 1e-3
    want = _full(_state(model, opt, 0))
    got = _full(_state(fresh, fresh_opt, 0))
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # every rank holding full tensors (no broadcast) loads the same way
    everyone = dcp.get_model_state_dict(model, options=dcp.StateDictOptions(full_state_dict=True))
    third, _, _ = _build("fsdp2", seed=9)
    dcp.set_model_state_dict(third, everyone, options=dcp.StateDictOptions(full_state_dict=True))
    for name, value in _params(third).items():
        assert torch.equal(value, _params(model)[name]), name


def test_full_state_dicts_gather_to_rank0_and_broadcast_back():
    run_on_ranks(2, _full_state_dict_options)


def _optimizer_state_after_an_evaluation():
    """After an evaluation forward the root registers its gathered parameters (as PyTorch's
    FSDP2 does); the optimizer's state dict still names every parameter it holds, and loads
    back into the same parameters."""
    model, index, count = _build("fsdp2", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _step(model, opt, 0, index, count)
    with torch.no_grad():
        model(_batch(1)[0][index::count])
    assert not all(isinstance(p, DTensor) for p in model.parameters())  # gathered, kept
    osd = dcp.get_optimizer_state_dict(model, opt)
    assert set(osd["state"]) == set(dict(model.state_dict()))
    assert all(isinstance(v["exp_avg"], DTensor) for v in osd["state"].values())
    dcp.set_optimizer_state_dict(model, opt, osd)
    _step(model, opt, 1, index, count)


def test_optimizer_state_dict_after_an_evaluation_forward():
    run_on_ranks(2, _optimizer_state_after_an_evaluation)
