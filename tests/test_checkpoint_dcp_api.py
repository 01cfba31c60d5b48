"""PyTorch's DCP API on this library's checkpoints: ``import dtensor.checkpoint as dcp``.

At 2 gloo ranks, a model whose first dimensions (5 and 3) do not divide by 2, sharded with
our fully_shard, takes an AdamW step; its model and optimizer state are saved the way
accelerate writes them (``storage_writer=FileSystemWriter(dir), planner=DefaultSavePlanner()``)
and a torchtitan-style dict of Stateful objects through ``checkpoint_id``; fresh models load
them back bit-identical. The same sequence with PyTorch's FSDP2 and PyTorch's own DCP on
the same inputs gives the same values. Then: allow_partial_load, no_dist, checkpoint_id-less
calls, the errors for arguments this library cannot honour (on both ranks, before any
collective), format_utils and the Hugging Face storage classes.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
import torch.distributed.checkpoint.format_utils as torch_format_utils
import torch.distributed.checkpoint.state_dict as tsd
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import dtensor.checkpoint as dcp
from dtensor.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from dtensor.checkpoint.stateful import Stateful
from fsdp2 import fully_shard
from tests.harness import run_on_ranks


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))


def _trained(shard, seed: int = 0):
    """A model sharded by ``shard`` (ours or PyTorch's), after one AdamW step."""
    model = _model(seed)
    shard(model[0])
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    model(torch.randn(6, 4, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


class Counter:
    """A Stateful value (data-loader position, train state)."""

    def __init__(self, n: int = 0) -> None:
        self.n, self.loaded = n, 0

    def state_dict(self) -> dict:
        return {"n": self.n, "seen": torch.tensor([float(self.n)])}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        self.loaded += 1
        assert sd["seen"].item() == self.n


class ModelAndOptim:
    """torchtitan's ModelWrapper / OptimizersContainer in one: Stateful through the helpers."""

    def __init__(self, api, model, opt) -> None:
        self.api, self.model, self.opt = api, model, opt

    def state_dict(self) -> dict:
        return {"model": self.api.get_model_state_dict(self.model),
                "optim": self.api.get_optimizer_state_dict(self.model, self.opt)}  # fmt: skip

    def load_state_dict(self, sd: dict) -> None:
        self.api.set_model_state_dict(self.model, sd["model"])
        self.api.set_optimizer_state_dict(self.model, self.opt, sd["optim"])


def _full(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer moment, whole, by name."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor().detach().clone()
        for k, v in opt.state[p].items():
            out[f"{name}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _save_accelerate_style(api, model, opt, root: Path) -> None:
    api.save(state_dict={"model": api_sd(api).get_model_state_dict(model)},
             storage_writer=api.FileSystemWriter(root / "model"),
             planner=api.DefaultSavePlanner())  # fmt: skip
    api.save(state_dict={"optimizer": api_sd(api).get_optimizer_state_dict(model, opt)},
             storage_writer=api.FileSystemWriter(root / "optimizer"),
             planner=api.DefaultSavePlanner())  # fmt: skip


def _load_accelerate_style(api, model, opt, root: Path) -> None:
    helpers = api_sd(api)
    sd = {"model": helpers.get_model_state_dict(model)}
    api.load(state_dict=sd, storage_reader=api.FileSystemReader(root / "model"),
             planner=api.DefaultLoadPlanner())  # fmt: skip
    helpers.set_model_state_dict(model, sd["model"])
    osd = {"optimizer": helpers.get_optimizer_state_dict(model, opt)}
    api.load(state_dict=osd, storage_reader=api.FileSystemReader(root / "optimizer"),
             planner=api.DefaultLoadPlanner())  # fmt: skip
    helpers.set_optimizer_state_dict(model, opt, osd["optimizer"])


def api_sd(api):
    return dcp if api is dcp else tsd


def _round_trip(api, shard, root: Path) -> tuple[dict, dict]:
    """Save and load back through ``api``: (accelerate-style values, Stateful values)."""
    model, opt = _trained(shard)
    _save_accelerate_style(api, model, opt, root / "acc")
    counter = Counter(41 + dist.get_rank() * 0)
    api.save({"app": ModelAndOptim(api_sd(api), model, opt), "train_state": counter},
             checkpoint_id=str(root / "titan"))  # fmt: skip
    fresh, fresh_opt = _trained(shard, seed=1)
    assert not torch.equal(_full(fresh, fresh_opt)["0.weight"], _full(model, opt)["0.weight"])
    _load_accelerate_style(api, fresh, fresh_opt, root / "acc")
    accelerate = _full(fresh, fresh_opt)
    _same(accelerate, _full(model, opt))
    other, other_opt = _trained(shard, seed=2)
    loaded_counter = Counter()
    api.load({"app": ModelAndOptim(api_sd(api), other, other_opt), "train_state": loaded_counter},
             checkpoint_id=str(root / "titan"))  # fmt: skip
    assert (loaded_counter.n, loaded_counter.loaded) == (41, 1)
    stateful = _full(other, other_opt)
    _same(stateful, _full(model, opt))
    return accelerate, stateful


def _accelerate_and_stateful_parity(tmp: str) -> None:
    rank_dir = Path(tmp)
    ours = _round_trip(dcp, fully_shard, rank_dir / "ours")
    theirs = _round_trip(tdcp, torch_fully_shard, rank_dir / "torch")
    _same(ours[0], theirs[0])  # parity: the same values as PyTorch's FSDP2 + DCP
    _same(ours[1], theirs[1])
    md = dcp.FileSystemReader(rank_dir / "ours" / "acc" / "model").read_metadata()
    tmd = tdcp.FileSystemReader(rank_dir / "torch" / "acc" / "model").read_metadata()
    assert md.state_dict_metadata.keys() == tmd.state_dict_metadata.keys()
    for key, t in tmd.state_dict_metadata.items():
        assert (md.state_dict_metadata[key].size, md.state_dict_metadata[key].properties.dtype) == (
            t.size, t.properties.dtype)  # fmt: skip
    _partial_and_errors(rank_dir / "ours")
    _hf_storage(rank_dir / "hf")


def _partial_and_errors(root: Path) -> None:
    model, opt = _trained(fully_shard)
    sd = {"model": dcp.get_model_state_dict(model)}
    sd["model"]["extra"] = torch.full((2,), 7.0)
    with pytest.raises(
        dcp.CheckpointException, match="missing from the checkpoint: model.extra"
    ) as e:
        dcp.load(sd, storage_reader=dcp.FileSystemReader(root / "acc" / "model"),
                 planner=dcp.DefaultLoadPlanner())  # fmt: skip
    assert sorted(e.value.failures) == [0, 1]  # every rank found it, as PyTorch reports
    tsd_ = {"model": {"0.bias": torch.zeros(5), "extra": torch.full((2,), 7.0)}}
    with pytest.raises(tdcp.CheckpointException, match="Missing key in checkpoint state_dict"):
        tdcp.load(tsd_, checkpoint_id=root.parent / "torch" / "acc" / "model")  # PyTorch: same
    dcp.load(sd, storage_reader=dcp.FileSystemReader(root / "acc" / "model"),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))  # fmt: skip
    assert torch.equal(sd["model"]["extra"], torch.full((2,), 7.0))  # left alone
    # dedup_save_to_lowest_rank: replicated blocks all written by rank 0 (else spread)
    for lowest, files in [(False, {"a": "rank-00000", "b": "rank-00001"}),
                          (True, {"a": "rank-00000", "b": "rank-00000"})]:  # fmt: skip
        dcp.save({"a": torch.ones(4), "b": torch.ones(4)}, checkpoint_id=root / "dedup",
                 planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=lowest))  # fmt: skip
        md = dcp.read_metadata(root / "dedup")
        assert {k: t.chunks[0].file.split(".")[0] for k, t in md.tensors.items()} == files
    # Arguments this library cannot honour fail on every rank, before any collective.
    with pytest.raises(TypeError, match="storage_writer=torch.distributed.checkpoint"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=tdcp.FileSystemWriter(root / "x"))
    with pytest.raises(TypeError, match="planner=Custom overrides create_local_plan"):
        dcp.save({"w": torch.zeros(2)}, checkpoint_id=root / "x", planner=Custom())
    assert not (root / "x").exists()


class Custom(dcp.DefaultSavePlanner):
    def create_local_plan(self):
        return super().create_local_plan()


def _hf_storage(root: Path) -> None:
    model, _ = _trained(fully_shard)
    hf = {f"model.{k}": v for k, v in model.state_dict().items()}
    writer = dcp.HuggingFaceStorageWriter(str(root), fqn_to_index_mapping={
        "model.0.weight": 1, "model.0.bias": 1, "model.2.weight": 2, "model.2.bias": 2})  # fmt: skip
    dcp.save(hf, storage_writer=writer)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"], names  # fmt: skip
    fresh, _ = _trained(fully_shard, seed=3)
    back = {f"model.{k}": v for k, v in fresh.state_dict().items()}
    dcp.load(back, storage_reader=dcp.HuggingFaceStorageReader(str(root)))
    full = {k: v.full_tensor() for k, v in hf.items()}
    for k, v in full.items():
        assert torch.equal(back[k].full_tensor(), v), k
    if dist.get_rank() == 0:  # PyTorch's reader reads the folder too (one process)
        plain = {k: torch.zeros(v.shape) for k, v in full.items()}
        tdcp.load(plain, storage_reader=tdcp.HuggingFaceStorageReader(str(root)), no_dist=True)
        for k, v in full.items():
            assert torch.equal(plain[k], v), k
    dist.barrier()


def test_accelerate_and_stateful_sequences_match_pytorch(tmp_path):
    run_on_ranks(2, _accelerate_and_stateful_parity, tmp=str(tmp_path))


# ------------------------------------------------------------- one process, no group
def test_no_dist_and_checkpoint_id_less_calls(tmp_path):
    sd = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        md = dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "a"), no_dist=True)
    assert isinstance(md, dcp.Metadata)
    w = md.state_dict_metadata["model.w"]
    assert (w.size, w.properties.dtype) == (torch.Size([2, 3]), torch.float32)
    assert w.chunks == [dcp.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))]
    assert isinstance(md.state_dict_metadata["step"], dcp.BytesStorageMetadata)
    out = {"model": {"w": torch.zeros(2, 3)}, "step": 0}
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path / "a"), no_dist=True)
    assert torch.equal(out["model"]["w"], sd["model"]["w"]) and out["step"] == 4
    reader = dcp.FileSystemReader(tmp_path / "elsewhere")
    dcp.load(out, storage_reader=reader, checkpoint_id=tmp_path / "a")  # re-targets the reader
    assert reader.checkpoint_id == tmp_path / "a"
    fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "b"),
                         async_checkpointer_type=AsyncCheckpointerType.THREAD)  # fmt: skip
    assert "step" in fut.result().state_dict_metadata  # PyTorch's Metadata, as its future gives
    assert dcp.read_metadata(tmp_path / "b").values == {"step": 4}
    with pytest.raises(ValueError, match="async_checkpointer_type=.*PROCESS"):
        dcp.async_save(sd, checkpoint_id=tmp_path / "c",
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
    with pytest.raises(ValueError, match="save needs checkpoint_id"):
        dcp.save(sd)
    with pytest.raises(ValueError, match="load needs checkpoint_id"):
        dcp.load(sd)


def test_overwrite_false_and_refused_arguments(tmp_path):
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "c")
    with pytest.raises(dcp.CheckpointError, match="overwrite=False"):
        dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path / "c",
                                                                            overwrite=False))  # fmt: skip
    for kwargs, name in [({"thread_count": 4}, "thread_count=4"),
                         ({"sync_files": False}, "sync_files=False"),
                         ({"single_file_per_rank": False}, "single_file_per_rank=False"),
                         ({"cache_staged_state_dict": True}, "cache_staged_state_dict=True")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            dcp.FileSystemWriter(tmp_path, **kwargs)
    # PyTorch's own default planners (accelerate imports them from torch) are read like ours
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner as TorchLP
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner as TorchSP

    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "p", planner=TorchSP())
    part = {"w": torch.zeros(2), "absent": torch.zeros(1)}
    dcp.load(part, checkpoint_id=tmp_path / "p", planner=TorchLP(allow_partial_load=True))
    assert torch.equal(part["w"], torch.ones(2))
    with pytest.raises(dcp.CheckpointError, match="missing from the checkpoint: absent"):
        dcp.load(part, checkpoint_id=tmp_path / "p", planner=TorchLP())

    class TorchCustom(TorchSP):
        pass

    with pytest.raises(TypeError, match="planner=.*TorchCustom.*cannot be used"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "p", planner=TorchCustom())
    with pytest.raises(ValueError, match="use_collectives=False"):
        dcp.save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "d", use_collectives=False)
    with pytest.raises(ValueError, match="flatten_state_dict=False"):
        dcp.DefaultSavePlanner(flatten_state_dict=False)

    class MyWriter(dcp.StorageWriter):  # a user's own storage: its methods would never run
        reset = set_up_storage_writer = prepare_local_plan = prepare_global_plan = None
        write_data = finish = validate_checkpoint_id = None

    with pytest.raises(TypeError, match="storage_writer=.*MyWriter cannot be used"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=MyWriter())
    with pytest.raises(TypeError, match="storage_reader=torch.distributed.checkpoint"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=tdcp.FileSystemReader(tmp_path / "c"))
    td = tmp_path / "torch-dcp"
    tdcp.save({"w": torch.zeros(2)}, checkpoint_id=td, no_dist=True)
    with pytest.raises(dcp.CheckpointError, match="PyTorch's torch.distributed.checkpoint format"):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=td)
    assert (tmp_path / "c").is_dir() and dcp.read_metadata(tmp_path / "c").tensors["w"]


def test_stateful_protocol_and_deprecated_aliases(tmp_path):
    assert isinstance(Counter(), Stateful) and isinstance(nn.Linear(2, 2), Stateful)
    assert not isinstance({"n": 1}, Stateful)
    lin = nn.Linear(3, 2)
    with pytest.warns(FutureWarning, match="save_state_dict"):
        dcp.save_state_dict({"lin": lin.state_dict()}, dcp.FileSystemWriter(tmp_path / "s"))
    back = nn.Linear(3, 2)
    dcp.load({"lin": back}, checkpoint_id=tmp_path / "s")  # an nn.Module is Stateful
    assert torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)
    out = {"lin": nn.Linear(3, 2).state_dict()}
    with pytest.warns(FutureWarning, match="load_state_dict"):
        dcp.load_state_dict(out, dcp.FileSystemReader(tmp_path / "s"))
    assert torch.equal(out["lin"]["weight"], lin.weight)
    with pytest.raises(dcp.CheckpointError, match="only at the top level"):
        dcp.save({"nested": {"lin": lin}}, checkpoint_id=tmp_path / "n")


def test_format_utils_round_trip_against_torch_load(tmp_path):
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3)).to(torch.float64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    full = {"model": model.state_dict(), "optim": opt.state_dict(), "bf": torch.ones(3).bfloat16()}
    torch.save(full, tmp_path / "full.pt")
    torch_save_to_dcp(tmp_path / "full.pt", tmp_path / "ckpt")
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    flat = _flat(torch.load(tmp_path / "full.pt", weights_only=True))
    assert back.keys() == flat.keys()
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == back[k].dtype and torch.equal(v, back[k]), k
        else:
            assert back[k] == v, k
    # PyTorch's dcp_to_torch_save reads a checkpoint of PyTorch's own DCP; same values here
    tdcp.save(full, checkpoint_id=tmp_path / "tckpt", no_dist=True)
    torch_format_utils.dcp_to_torch_save(tmp_path / "tckpt", tmp_path / "t.pt")
    assert torch.equal(_flat(torch.load(tmp_path / "t.pt", weights_only=True))["model.0.weight"],
                       back["model.0.weight"])  # fmt: skip
    torch.save({"obj": _NotAllowed()}, tmp_path / "evil.pt")
    with pytest.raises(dcp.CheckpointError, match="refusing the global"):
        torch_save_to_dcp(tmp_path / "evil.pt", tmp_path / "never")
    assert not (tmp_path / "never").exists()


class _NotAllowed:
    pass


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _user_mistakes(tmp: str) -> None:
    root = Path(tmp)
    rank = dist.get_rank()
    state = {"model": {"w": torch.arange(6.0).view(3, 2)}, "step": 3}
    # a rank number in the path: every rank learns it, nothing is written
    with pytest.raises(dcp.CheckpointError, match=r"different checkpoint_id directories") as e:
        dcp.save(state, checkpoint_id=root / f"rank-{rank}")
    assert str(root / "rank-0") in str(e.value) and str(root / "rank-1") in str(e.value)
    dist.barrier()
    # nothing of the refused save is left (only its names: rank 0 goes on to save "ok" next)
    assert [p.name for p in root.iterdir() if p.name.startswith((".rank-", "rank-"))] == []
    dist.barrier()
    # a misspelt top-level name: the checkpoint's names, and no strict=False advice
    dcp.save(state, checkpoint_id=root / "ok")
    wrong = {"Model": {"w": torch.zeros(3, 2)}, "step": 0}
    with pytest.raises(dcp.CheckpointError, match=r"holds nothing under \['Model'\]") as e:
        dcp.load(wrong, checkpoint_id=root / "ok")
    assert "['model', 'step']" in str(e.value) and "strict=False" not in str(e.value)
    assert torch.equal(wrong["Model"]["w"], torch.zeros(3, 2)) and wrong["step"] == 0


def test_user_mistakes_are_named(tmp_path):
    run_on_ranks(2, _user_mistakes, tmp=str(tmp_path))
