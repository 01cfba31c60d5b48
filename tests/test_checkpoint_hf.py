"""Hugging Face weights in and out, with a real ``transformers`` Llama (tiny, random, local).

In: ``save_pretrained`` writes sharded safetensors with an index; ``load_hf`` fills an FSDP
model at world size 3 (vocabulary 67 and intermediate size 36 split unevenly, a 12-row k/v
projection into 4/4/4) whose own init differs: every parameter must equal the Hugging Face
weights bit for bit and the logits must match, and each rank must read exactly the bytes of
its own shards. Out: after an AdamW step, ``dcp.save`` + ``consolidate --hf`` writes a folder
that ``from_pretrained`` loads with the same logits as the sharded model. A second test loads
a single-file, tied-embedding model into a wrapper through a ``key_map``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from device_mesh import init_device_mesh
from dtensor import DTensor
from dtensor import checkpoint as dcp
from dtensor.checkpoint import api
from dtensor.checkpoint.__main__ import main as cli
from dtensor.checkpoint.hf import read_hf_metadata
from fsdp2 import fully_shard
from tests.harness import run_on_ranks

VOCAB = 67


def _config(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=36, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                       tie_word_embeddings=tied)  # fmt: skip


def _reference(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_config(tied)).eval()


def _sharded(model: torch.nn.Module, layers) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(seed))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _sharded_in_and_out(directory: str) -> None:
    hf_in, ckpt, hf_out = (Path(directory) / n for n in ("hf-in", "ckpt", "hf-out"))
    ref = _reference(tied=False)
    if dist.get_rank() == 0:
        ref.save_pretrained(hf_in, max_shard_size="20KB")
        assert (hf_in / "model.safetensors.index.json").is_file()
        assert len(list(hf_in.glob("model-*.safetensors"))) > 1
    dist.barrier()

    torch.manual_seed(1 + dist.get_rank())  # a different init on every rank, all replaced
    model = LlamaForCausalLM(_config(tied=False))
    _sharded(model, model.model.layers)
    sd = model.state_dict()
    # each rank reads exactly its own shards' bytes out of the whole-tensor files
    _, md = read_hf_metadata(hf_in)
    plan = api._load_plan(sd, md, strict=True, whole_source=True)
    read = sum(_volume(r.src) for _, reads, _ in plan.copies for r in reads)
    mine = sum(v.to_local().numel() for v in sd.values())
    assert read == mine, (read, mine)

    dcp.load_hf(sd, hf_in)
    for name, p in model.named_parameters():
        assert torch.equal(_full(p), ref.get_parameter(name).detach()), name
    # built on the shards (after a forward the root registers its gathered parameters)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = _tokens(5)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=0, atol=1e-6)

    rows = slice(dist.get_rank(), None, dist.get_world_size())
    model(_tokens(6)[rows], labels=_tokens(6)[rows]).loss.backward()
    opt.step()
    state = {"model": dcp.get_model_state_dict(model),
             "optim": dcp.get_optimizer_state_dict(model, opt)}  # fmt: skip
    dcp.save(state, checkpoint_id=ckpt)
    with torch.no_grad():
        trained = model(x).logits
    if dist.get_rank() == 0:
        assert cli(["consolidate", str(ckpt), str(hf_out), "--hf", "--prefix", "model.",
                    "--max-shard-size", "20KB"]) == 0  # fmt: skip
        index = json.loads((hf_out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(ref.state_dict())  # no optimizer state
        ref.config.save_pretrained(hf_out)
        back = LlamaForCausalLM.from_pretrained(hf_out).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(x).logits, trained, rtol=0, atol=1e-6)
        for name, p in model.named_parameters():
            assert torch.equal(back.get_parameter(name).detach(), _full(p)), name
    else:
        for p in model.parameters():
            _full(p)  # the gathers rank 0 takes part in


def _volume(slices: tuple[slice, ...]) -> int:
    n = 1
    for s in slices:
        n *= s.stop - s.start
    return n


@pytest.mark.timeout(240)
def test_hf_sharded_folder_into_fsdp_and_back_out(tmp_path):
    run_on_ranks(3, _sharded_in_and_out, timeout_s=200, directory=str(tmp_path))


class _Wrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = LlamaForCausalLM(_config(tied=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(x).logits


def _key_map_and_ties(directory: str) -> None:
    hf_in = Path(directory) / "hf-tied"
    ref = _reference(tied=True)
    if dist.get_rank() == 0:
        ref.save_pretrained(hf_in)  # one model.safetensors; the tied lm_head is not stored
        assert (hf_in / "model.safetensors").is_file()
    dist.barrier()
    torch.manual_seed(7)
    wrapper = _Wrapper()
    lm = wrapper.lm
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    _sharded(wrapper, lm.model.layers)

    # a key_map that drops a tensor: strict names the key the state dict then lacks, on every
    # rank, and changes nothing
    before = _full(lm.model.norm.weight).clone()
    with pytest.raises(
        dcp.CheckpointError, match=r"missing from the checkpoint: lm\.model\.norm\.weight"
    ):
        dcp.load_hf(wrapper.state_dict(), hf_in,
                    key_map=lambda k: None if k == "model.norm.weight" else "lm." + k)  # fmt: skip
    assert torch.equal(_full(lm.model.norm.weight), before)

    dcp.load_hf(wrapper.state_dict(), hf_in, key_map=lambda k: "lm." + k)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    for name, p in ref.named_parameters():
        assert torch.equal(_full(lm.get_parameter(name)), p.detach()), name
    x = _tokens(8)
    with torch.no_grad():
        torch.testing.assert_close(wrapper(x), ref(x).logits, rtol=0, atol=1e-6)


@pytest.mark.timeout(240)
def test_hf_single_file_with_key_map_and_tied_embeddings(tmp_path):
    run_on_ranks(2, _key_map_and_ties, timeout_s=200, directory=str(tmp_path))


# ---- hostile Hugging Face input (one process) ----


def _write_hf(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    save_file({"a": tensors["a"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": tensors["b"]}, folder / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_hf_load_in_one_process_converts_dtype(tmp_path):
    tensors = _write_hf(tmp_path)
    sd = {"a": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(4)}
    dcp.load_hf(sd, tmp_path)
    assert sd["a"].dtype == torch.float64 and torch.equal(sd["a"], tensors["a"].double())
    assert torch.equal(sd["b"], tensors["b"])
    with pytest.raises(
        dcp.CheckpointError, match=r"in the checkpoint but not in the state dict: b"
    ):
        dcp.load_hf({"a": torch.zeros(2, 3)}, tmp_path)
    only_a = {"a": torch.zeros(2, 3)}
    dcp.load_hf(only_a, tmp_path, strict=False)
    assert torch.equal(only_a["a"], tensors["a"])


def _index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


@pytest.mark.parametrize(
    "damage, message",
    [
        ("index_path", "not a plain '\\*.safetensors' name"),
        ("index_missing_file", "which is missing"),
        ("index_wrong_file", "places in"),
        ("index_extra_key", "lists tensors its files do not hold: c"),
        ("index_not_json", "is not valid JSON"),
        ("truncated", "truncated"),
        ("header_past_end", "header claims"),
        ("header_not_json", "header is not JSON"),
        ("bad_dtype", "has dtype 'F7'"),
        ("dtype_not_a_name", "has dtype \\[\\]"),
        ("deep_json", "header is not JSON"),
        ("bad_shape", "bytes .* for 32 bytes"),
        ("pickle_only", "never does"),
    ],
)
def test_hf_hostile_input_is_refused_by_name(tmp_path, damage, message):
    folder = tmp_path / "hf"
    _write_hf(folder)
    first = folder / "model-00001-of-00002.safetensors"
    index = _index(folder)
    if damage == "index_path":
        index["weight_map"]["a"] = "../outside.safetensors"
    elif damage == "index_missing_file":
        index["weight_map"]["a"] = "model-00009-of-00009.safetensors"
    elif damage == "index_wrong_file":
        index["weight_map"]["a"] = "model-00002-of-00002.safetensors"
        index["weight_map"]["z"] = "model-00001-of-00002.safetensors"
    elif damage == "index_extra_key":
        index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    elif damage == "index_not_json":
        (folder / "model.safetensors.index.json").write_text("{not json")
    elif damage == "truncated":
        first.write_bytes(first.read_bytes()[:-5])
    elif damage in ("header_past_end", "header_not_json", "bad_dtype", "bad_shape",
                    "dtype_not_a_name", "deep_json"):  # fmt: skip
        raw = first.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        head, data = raw[8 : 8 + n], raw[8 + n :]
        if damage == "header_past_end":
            raw = struct.pack("<Q", n + 10_000) + head + data
        else:
            text = head.decode()
            text = {"header_not_json": text.replace("{", "[", 1),
                    "bad_dtype": text.replace('"F32"', '"F7"'),
                    "dtype_not_a_name": text.replace('"F32"', "[]"),
                    "deep_json": "[" * 100_000 + "]" * 100_000,
                    "bad_shape": text.replace("[2,3]", "[4,2]")}[damage]  # fmt: skip
            raw = struct.pack("<Q", len(text)) + text.encode() + data
        first.write_bytes(raw)
    elif damage == "pickle_only":
        for p in folder.iterdir():
            p.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    if damage.startswith("index_") and damage != "index_not_json":
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    sd = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    with pytest.raises(dcp.CheckpointError, match=message):
        dcp.load_hf(sd, folder)
    assert not sd["a"].any() and not sd["b"].any()  # nothing was loaded


def test_hf_missing_untied_twin_and_meta_destinations_are_errors(tmp_path):
    _write_hf(tmp_path)
    tied = torch.zeros(4)
    sd = {"a": torch.zeros(2, 3), "b": tied, "b_twin": tied.detach()}  # same memory: fine
    dcp.load_hf(sd, tmp_path)
    assert torch.equal(sd["b_twin"], torch.ones(4))
    with pytest.raises(dcp.CheckpointError, match="missing from the checkpoint: c"):
        dcp.load_hf({"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(4)}, tmp_path)
    with pytest.raises(dcp.CheckpointError, match=r"meta device .*to_empty"):
        dcp.load_hf({"a": torch.zeros(2, 3, device="meta"), "b": torch.zeros(4)}, tmp_path)


def test_hf_single_file_wins_over_an_index_as_in_transformers(tmp_path):
    from safetensors.torch import save_file

    _write_hf(tmp_path)
    save_file(
        {"a": torch.full((2, 3), 7.0), "b": torch.full((4,), 7.0)}, tmp_path / "model.safetensors"
    )
    sd = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    dcp.load_hf(sd, tmp_path)
    assert (sd["a"] == 7).all() and (sd["b"] == 7).all()


def test_export_cut_short_leaves_an_unloadable_folder_never_a_mixed_one(tmp_path):
    from dtensor.checkpoint.hf import export_hf

    def save(value: float, name: str):
        sd = {"a": torch.full((40,), value), "b": torch.full((40,), value)}
        dcp.save(sd, checkpoint_id=tmp_path / name)

    save(1.0, "one")
    save(2.0, "two")
    out = tmp_path / "hf"
    assert len(export_hf(tmp_path / "one", out, max_shard_bytes=160)) == 2

    def stop_after_first(key):
        if key == "a":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_hf(tmp_path / "two", out, max_shard_bytes=160, progress=stop_after_first)
    assert not list(out.glob(".*partial"))
    sd = {"a": torch.zeros(40), "b": torch.zeros(40)}
    with pytest.raises(dcp.CheckpointError, match="has neither"):
        dcp.load_hf(sd, out)
    assert export_hf(tmp_path / "two", out, max_shard_bytes=160)  # a full export repairs it
    dcp.load_hf(sd, out)
    assert (sd["a"] == 2).all() and (sd["b"] == 2).all()
    (out / "model_ema.safetensors").write_bytes(b"not ours")  # other files are left alone
    export_hf(tmp_path / "one", out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "model_ema.safetensors"]
