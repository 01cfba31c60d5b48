"""dtensor.checkpoint.state_dict against torch.distributed.checkpoint.state_dict, option by option.

Each rank function builds one small model twice from the same seed, shards one copy with our
``fsdp2.fully_shard`` and the other with PyTorch's FSDP2, trains both two AdamW steps on the
same batches, and calls our helper and PyTorch's with the same options: the keys, the values
(full tensors compared exactly: two ranks run the same fp32 arithmetic) and the optimizer
structure must be the same. The model is awkward on purpose: an embedding of 7 rows (uneven
over 2 ranks) tied to the output head, a (1, 5) parameter (fewer rows than ranks), a frozen
linear layer and a buffer.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as tsd
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import dtensor.checkpoint.state_dict as osd_api
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.state_dict import StateDictOptions
from fsdp2 import fully_shard
from tests.harness import run_on_ranks


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.tiny = nn.Parameter(torch.randn(1, 5))
        self.blocks = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 3)])
        self.frozen = nn.Linear(3, 5)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(5, 7, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, idx):
        h = self.emb(idx) + self.tiny
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(self.frozen(h * self.scale))


def _pair(seed: int = 0, steps: int = 2, split: bool = False):
    """(ours, torch's): each a (model, optimizers) pair, trained ``steps`` identical steps."""
    torch.manual_seed(seed)
    base = _Net()
    out = []
    for shard in (fully_shard, torch_fully_shard):
        model = copy.deepcopy(base)
        for block in model.blocks:
            shard(block)
        shard(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if split:  # blocks in one optimizer, the rest in another
            ids = {id(p) for p in model.blocks.parameters()}
            optims = (
                torch.optim.AdamW([p for p in trainable if id(p) in ids], lr=0.01),
                torch.optim.SGD([p for p in trainable if id(p) not in ids], lr=0.1, momentum=0.9),
            )
        else:
            optims = (torch.optim.AdamW(trainable, lr=0.01, weight_decay=0.1),)
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        for _ in range(steps):
            idx = torch.randint(0, 7, (4,), generator=g)
            nn.functional.cross_entropy(
                model(idx), torch.randint(0, 7, (4,), generator=g)
            ).backward()
            for o in optims:
                o.step()
                o.zero_grad()
        out.append((model, optims))
    return out


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _same(ours, theirs, where: str = "", exact_seq: bool = True) -> None:
    """The same tree: keys, types of containers, tensor values (gathered), other values.

    ``exact_seq=False`` lets a tuple stand for a list (PyTorch's broadcast turns tuples such
    as AdamW's ``betas`` into lists; ours keeps them tuples).
    """
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        assert list(ours) == list(theirs), f"{where}: keys {list(ours)} != {list(theirs)}"
        for k in theirs:
            _same(ours[k], theirs[k], f"{where}.{k}", exact_seq)
    elif isinstance(theirs, (list, tuple)):
        kinds = (type(ours) is type(theirs)) if exact_seq else isinstance(ours, (list, tuple))
        assert kinds and len(ours) == len(theirs), f"{where}: {ours!r} != {theirs!r}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{i}]", exact_seq)
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), where
        assert hasattr(ours, "full_tensor") == hasattr(theirs, "full_tensor"), where
        a, b = _full(ours), _full(theirs)
        assert a.dtype == b.dtype and a.device == b.device, where
        assert torch.equal(a, b), f"{where}: values differ"
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def _params(model) -> dict:
    return {k: _full(v).clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- get


def _get_parity() -> None:
    (m, (o,)), (tm, (to,)) = _pair()
    rank = dist.get_rank()
    variants = [
        {},
        dict(full_state_dict=True),
        dict(full_state_dict=True, cpu_offload=True),
        dict(cpu_offload=True),
        dict(ignore_frozen_params=True),
        dict(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True),  # accelerate
    ]
    for kw in variants:
        ours = osd_api.get_model_state_dict(m, options=StateDictOptions(**kw))
        theirs = tsd.get_model_state_dict(tm, options=tsd.StateDictOptions(**kw))
        _same(ours, theirs, f"model {kw}")
        if kw == dict(ignore_frozen_params=True):
            assert "head.weight" in ours and "frozen.weight" not in ours  # tied alias kept
        if kw.get("cpu_offload") and kw.get("full_state_dict") and rank != 0:
            assert ours == {}
        o_ours = osd_api.get_optimizer_state_dict(m, o, options=StateDictOptions(**kw))
        o_theirs = tsd.get_optimizer_state_dict(tm, to, options=tsd.StateDictOptions(**kw))
        _same(o_ours, o_theirs, f"optim {kw}")
    for keep in (True, False):
        kw = dict(keep_submodule_prefixes=keep)
        with pytest.warns(FutureWarning):  # PyTorch deprecates submodules=; we accept it quietly
            theirs = tsd.get_model_state_dict(
                tm, submodules={tm.blocks[1]}, options=tsd.StateDictOptions(**kw)
            )
        ours = osd_api.get_model_state_dict(
            m, submodules={m.blocks[1]}, options=StateDictOptions(**kw)
        )
        _same(ours, theirs, f"submodules {kw}")
    for kw in ({}, dict(full_state_dict=True, cpu_offload=True)):
        kw["flatten_optimizer_state_dict"] = True
        flat = osd_api.get_optimizer_state_dict(m, [o], options=StateDictOptions(**kw))
        _same(flat, tsd.get_optimizer_state_dict(tm, [to], options=tsd.StateDictOptions(**kw)))
    assert rank != 0 or "state.emb.weight.exp_avg" in flat and "param_groups.tiny.lr" in flat
    both = dict(full_state_dict=True)
    _same(
        osd_api.get_state_dict(m, o, options=StateDictOptions(**both)),
        tsd.get_state_dict(tm, to, options=tsd.StateDictOptions(**both)),
    )


def test_get_helpers_match_pytorch_for_every_option():
    run_on_ranks(2, _get_parity)


def test_options_have_pytorchs_fields_and_defaults():
    ours = [(f.name, f.default) for f in dataclasses.fields(StateDictOptions)]
    theirs = [(f.name, f.default) for f in dataclasses.fields(tsd.StateDictOptions)]
    assert ours == theirs
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    assert dataclasses.replace(opts, ignore_frozen_params=True).ignore_frozen_params
    for name in ("get_state_dict", "set_state_dict", "get_model_state_dict"):
        assert getattr(osd_api, name).__doc__ and name in osd_api.__all__


# ---------------------------------------------------------------------------- set


def _set_parity() -> None:
    (m, (o,)), (tm, (to,)) = _pair(seed=0)
    full = dict(full_state_dict=True)
    src = osd_api.get_state_dict(m, o, options=StateDictOptions(**full))
    tsrc = tsd.get_state_dict(tm, to, options=tsd.StateDictOptions(**full))
    rank0 = dict(full, broadcast_from_rank0=True)
    for kw, sd, osd in [(full, *src), (rank0, *src)]:
        if kw.get("broadcast_from_rank0") and dist.get_rank() != 0:
            sd, osd = {}, {}  # only rank 0 holds the full state dicts
        (f, (fo,)), (tf, (tfo,)) = _pair(seed=5, steps=1)
        osd_api.set_state_dict(f, fo, model_state_dict=sd, optim_state_dict=osd,
                               options=StateDictOptions(**kw))  # fmt: skip
        # PyTorch's set writes its local tensors into the dict it is given: pass copies
        tsd.set_model_state_dict(tf, dict(tsrc[0]) if sd else {},
                                 options=tsd.StateDictOptions(**kw))  # fmt: skip
        tsd.set_optimizer_state_dict(tf, tfo, copy.deepcopy(tsrc[1]) if osd else {},
                                     options=tsd.StateDictOptions(**kw))  # fmt: skip
        _same(_params(f), _params(m), f"set {kw}")
        got = osd_api.get_optimizer_state_dict(f, fo)
        _same(got, tsd.get_optimizer_state_dict(tf, tfo), f"optim {kw}", exact_seq=False)
        _same(got, osd_api.get_optimizer_state_dict(m, o), f"optim {kw} vs source")
        _same(_params(f), _params(tf), f"set {kw} vs torch")
    # flattened, sharded, into fresh optimizers: the same as PyTorch's own round trip
    flat = dict(flatten_optimizer_state_dict=True)
    (f, (fo,)), (tf, (tfo,)) = _pair(seed=5, steps=1)
    osd_api.set_model_state_dict(f, osd_api.get_model_state_dict(m))
    tsd.set_model_state_dict(tf, tsd.get_model_state_dict(tm))
    osd_api.set_optimizer_state_dict(
        f, fo, osd_api.get_optimizer_state_dict(m, o, options=StateDictOptions(**flat)),
        options=StateDictOptions(**flat),
    )  # fmt: skip
    tsd.set_optimizer_state_dict(
        tf, tfo, tsd.get_optimizer_state_dict(tm, to, options=tsd.StateDictOptions(**flat)),
        options=tsd.StateDictOptions(**flat),
    )  # fmt: skip
    _same(osd_api.get_optimizer_state_dict(f, fo), tsd.get_optimizer_state_dict(tf, tfo))
    _same(osd_api.get_optimizer_state_dict(f, fo), osd_api.get_optimizer_state_dict(m, o))


def test_set_helpers_match_pytorch_full_broadcast_and_flat():
    run_on_ranks(2, _set_parity)


def _strict_false() -> None:
    (m, _), (tm, _) = _pair(steps=0)
    ours = osd_api.get_model_state_dict(m)
    theirs = tsd.get_model_state_dict(tm)
    for sd in (ours, theirs):
        del sd["blocks.0.bias"]
    ours["extra.weight"] = theirs["extra.weight"] = torch.zeros(1)
    loose = dict(strict=False)
    r = osd_api.set_model_state_dict(m, ours, options=StateDictOptions(**loose))
    tr = tsd.set_model_state_dict(tm, theirs, options=tsd.StateDictOptions(**loose))
    assert (r.missing_keys, r.unexpected_keys) == (tr.missing_keys, tr.unexpected_keys)
    assert r.missing_keys == ["blocks.0.bias"] and r.unexpected_keys == ["extra.weight"]
    with pytest.raises(RuntimeError, match="blocks.0.bias"):
        osd_api.set_model_state_dict(m, ours)
    # full, broadcast from rank 0: the same missing keys on every rank
    full = osd_api.get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    del full["tiny"]
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    r = osd_api.set_model_state_dict(m, full if dist.get_rank() == 0 else {}, options=opts)
    assert r.missing_keys == ["tiny"] and r.unexpected_keys == []


def test_strict_false_reports_missing_and_unexpected_keys():
    run_on_ranks(2, _strict_false)


def _two_optimizers() -> None:
    (m, opts), (tm, topts) = _pair(split=True)
    for kw in ({}, dict(flatten_optimizer_state_dict=True), dict(full_state_dict=True)):
        ours = osd_api.get_optimizer_state_dict(m, opts, options=StateDictOptions(**kw))
        theirs = tsd.get_optimizer_state_dict(tm, topts, options=tsd.StateDictOptions(**kw))
        _same(ours, theirs, f"two optimizers {kw}")
        (f, fopts), _ = _pair(seed=3, steps=1, split=True)
        osd_api.set_optimizer_state_dict(f, fopts, ours, options=StateDictOptions(**kw))
        _same(osd_api.get_optimizer_state_dict(f, fopts), osd_api.get_optimizer_state_dict(m, opts))


def test_several_optimizers_merge_and_split_like_pytorch():
    run_on_ranks(2, _two_optimizers)


# ---------------------------------------------------------------------------- errors


def _rank0_errors_raise_everywhere() -> None:
    (m, (o,)), _ = _pair(steps=1)
    full = osd_api.get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))
    full["emb.weight"] = torch.zeros(6, 5)  # wrong shape, on rank 0 only
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with pytest.raises(CheckpointError, match=r"emb.weight.*\(6, 5\)"):
        osd_api.set_model_state_dict(m, full if dist.get_rank() == 0 else {}, options=opts)
    bad = {"state": {}, "param_groups": "nope"}
    with pytest.raises(CheckpointError, match="rank 0's optim_state_dict"):
        osd_api.set_optimizer_state_dict(m, o, bad if dist.get_rank() == 0 else {}, options=opts)
    dist.barrier()  # every rank raised; the group is still in step


def test_a_bad_rank0_state_dict_raises_on_every_rank():
    run_on_ranks(2, _rank0_errors_raise_everywhere)


def test_bad_options_and_arguments_name_what_to_fix():
    model = _Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match="broadcast_from_rank0=True needs full_state_dict"):
        osd_api.get_model_state_dict(model, options=StateDictOptions(broadcast_from_rank0=True))
    with pytest.raises(ValueError, match="StateDictOptions.strict must be True or False"):
        osd_api.get_model_state_dict(model, options=StateDictOptions(strict="yes"))
    with pytest.raises(ValueError, match="dsd_fqn_modifiers"):
        osd_api.get_model_state_dict(model, options=StateDictOptions(dsd_fqn_modifiers=3))
    with pytest.raises(TypeError, match="options must be a StateDictOptions"):
        osd_api.get_model_state_dict(model, options={"full_state_dict": True})
    with pytest.raises(ValueError, match="optimizers is empty"):
        osd_api.get_optimizer_state_dict(model, [])
    with pytest.raises(ValueError, match="not a module of model"):
        osd_api.get_model_state_dict(model, submodules={nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="optim_state_dict is empty"):
        osd_api.set_optimizer_state_dict(model, opt, {})
    # PyTorch's own options object is taken as it is
    sd = osd_api.get_model_state_dict(
        model, options=tsd.StateDictOptions(ignore_frozen_params=True)
    )
    assert "frozen.weight" not in sd and "emb.weight" in sd


def test_one_process_without_a_process_group_round_trips():
    """No process group: the helpers work on a plain module, flat optimizer state included."""
    torch.manual_seed(0)
    model, twin = _Net(), _Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    twin_opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=0.5)
    nn.functional.cross_entropy(model(torch.arange(4)), torch.arange(4)).backward()
    opt.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    sd, osd = osd_api.get_state_dict(model, opt, options=flat)
    _same(osd, tsd.get_optimizer_state_dict(model, opt, options=tsd.StateDictOptions(
        flatten_optimizer_state_dict=True)))  # fmt: skip
    osd_api.set_state_dict(twin, twin_opt, model_state_dict=sd, optim_state_dict=osd, options=flat)
    _same(_params(twin), _params(model))
    _same(
        osd_api.get_optimizer_state_dict(twin, twin_opt), tsd.get_optimizer_state_dict(model, opt)
    )


def test_wrapper_path_parts_are_left_out_like_pytorch():
    """torch.compile's ``_orig_mod.`` and activation checkpointing's wrapper are not in the keys
    (model and optimizer), and loading puts them back."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 3)), nn.Linear(3, 2))
    model[1] = torch.compile(model[1])  # built lazily: nothing is compiled here
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert "1._orig_mod.weight" in model.state_dict()
    sd, osd = osd_api.get_state_dict(model, opt)
    _same(sd, tsd.get_model_state_dict(model))
    _same(osd, tsd.get_optimizer_state_dict(model, opt))
    assert list(sd) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    result = osd_api.set_state_dict(model, opt, model_state_dict=sd, optim_state_dict=osd)
    assert result.missing_keys == [] and result.unexpected_keys == []
