"""accelerate's FSDP2 checkpointing, run on PyTorch and with this project's names swapped in at
accelerate's import sites (tests/_clients.py ``ported``): a resumed run continues bit for bit,
and the ported run computes and saves what PyTorch's does, to the bit.

Each test runs the same accelerate program at 2 ranks (gloo): once as accelerate ships
(PyTorch's FSDP2, DTensor and distributed checkpoints, "torch"), once ported ("full": every
name accelerate imports from ``torch.distributed.fsdp`` / ``.tensor`` / ``.device_mesh`` /
``.checkpoint`` is ours) and, where checkpoints are involved, once half ported ("mid":
fully_shard, DTensor and DeviceMesh ours, the checkpoint imports still PyTorch's), which must
either give the same bits or raise - never write a shard as if it were the whole tensor.

The model is transformers' ``LlamaForCausalLM`` from a tiny ``LlamaConfig`` (vocabulary 67:
uneven over 2 ranks), each decoder layer its own FSDP group (accelerate's
``transformer_based_wrap``), AdamW, a different batch per rank and step.

On a CPU, accelerate's state turns FSDP on only for accelerator devices; the test marks the
``MULTI_CPU`` state FSDP with the plugin (``_clients.fsdp2_accelerator``), which is all that
``prepare``, ``save_state`` and ``load_state`` consult.

The PyTorch arm of each program runs once per worker process and is kept
(``_torch_arm``), so the ported and mid-port tests compare with the same numbers.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests import _clients
from tests.harness import run_on_ranks

VOCAB, HIDDEN, SEQ, ROWS = 67, 16, 8, 2
STEPS_BEFORE_SAVE = 2

# ----------------------------------------------------------------------------- the program


def _llama(*, tied: bool, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=tied,
                         attn_implementation="eager")  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _batch(step: int):
    """This rank's tokens for ``step``: different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def _step(accelerator, model, opt, step: int) -> float:
    x = _batch(step)
    loss = model(input_ids=x, labels=x).loss
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole (gathered from the shards), in the model's order."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _plugin(state_dict_type: str, **extra) -> dict:
    return dict(
        state_dict_type=state_dict_type,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        **extra,
    )


def _resume_program(ckpt: str, state_dict_type: str, tied: bool) -> dict:
    """Train 2 steps, save_state, train 1 (the run that did not stop); then a fresh model
    from another seed, load_state, train 1 (the resumed run)."""
    out = {"ckpt": ckpt}
    with _clients.fsdp2_accelerator(**_plugin(state_dict_type)) as acc:
        model = _llama(tied=tied, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt = acc.prepare(model, opt)
        out["types"] = _types(model)
        out["losses"] = [_step(acc, model, opt, s) for s in range(STEPS_BEFORE_SAVE)]
        out["saved_params"] = _full_params(model)
        acc.save_state(ckpt)
        out["loss_on"] = _step(acc, model, opt, STEPS_BEFORE_SAVE)
        out["params_on"] = _full_params(model)
    with _clients.fsdp2_accelerator(**_plugin(state_dict_type)) as acc:
        model = _llama(tied=tied, seed=7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt = acc.prepare(model, opt)
        acc.load_state(ckpt)
        out["loaded_params"] = _full_params(model)
        out["loss_resumed"] = _step(acc, model, opt, STEPS_BEFORE_SAVE)
        out["params_resumed"] = _full_params(model)
    return out


def _types(model) -> set[str]:
    p = next(iter(model.parameters()))
    return {type(p).__module__.split(".")[0], type(model).__mro__[1].__module__.split(".")[0]}


# ----------------------------------------------------------------------------- comparisons


def _assert_same_params(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), (what, list(got), list(want))
    bad = [n for n in want if not (got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]))]
    assert not bad, f"{what}: parameters differ: " + ", ".join(
        f"{n} (max |diff| {(got[n].double() - want[n].double()).abs().max().item():.3g})"
        for n in bad
    )


def _assert_resumes(out: dict, arm: str) -> None:
    _assert_same_params(out["loaded_params"], out["saved_params"], f"{arm}: load_state")
    assert out["loss_resumed"] == out["loss_on"], (arm, out["loss_resumed"], out["loss_on"])
    _assert_same_params(out["params_resumed"], out["params_on"], f"{arm}: resumed step")


def _assert_same_run(got: dict, want: dict, arm: str) -> None:
    assert got["losses"] == want["losses"], (arm, got["losses"], want["losses"])
    for key in ("saved_params", "params_on", "loaded_params", "params_resumed"):
        _assert_same_params(got[key], want[key], f"{arm} vs torch: {key}")
    assert got["loss_on"] == want["loss_on"] and got["loss_resumed"] == want["loss_resumed"]


_TORCH_ARM: dict = {}
_OURS = ("dtensor", "fsdp2", "device_mesh")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clear_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is this project refusing a mix of the libraries in words: raised by
    our code (the innermost frame is in one of our packages) and naming PyTorch's side."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    path = tb.tb_frame.f_code.co_filename if tb is not None else ""
    ours = any(path.startswith(os.path.join(_ROOT, pkg) + os.sep) for pkg in _OURS)
    return ours and ("PyTorch" in str(exc) or "torch.distributed" in str(exc))


def _run_arm(arm: str, program, *args):
    """``program(*args)`` ported as ``arm``: (the port's record, the result), or (the record,
    None) when the half-done port ("mid") was refused with a clear error - the one outcome
    besides PyTorch's bits that the half-done port may have."""
    record = {}
    try:
        with _clients.ported(arm) as record:
            return record, program(*args)
    except Exception as exc:
        if arm != "mid" or not _clear_refusal(exc):
            raise
        return record, None


def _torch_arm(key, program, *args):
    """PyTorch's run of ``program(*args)``, once per worker process."""
    if key not in _TORCH_ARM:
        _TORCH_ARM[key] = program(*args)
    return _TORCH_ARM[key]


def _saved_shapes(directory: str) -> tuple[str, dict[str, tuple]]:
    """The format of a distributed checkpoint directory (ours: ``metadata.json``, next to a
    ``.metadata`` note for PyTorch's reader; or PyTorch's pickled ``.metadata``) and the
    global shape of each tensor in it."""
    if os.path.exists(os.path.join(directory, "metadata.json")):
        from dtensor import checkpoint as dcp

        md = dcp.read_metadata(directory)
        return "ours", {k: tuple(v.shape) for k, v in md.tensors.items()}
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(directory).read_metadata().state_dict_metadata
    return "torch", {
        k: tuple(v.size) for k, v in md.items() if isinstance(v, TensorStorageMetadata)
    }


def _assert_whole_tensors_saved(directory: str, arm: str, expected: dict[str, tuple]) -> None:
    """The checkpoint is in the format of the arm's checkpoint library, and every tensor of
    ``expected`` is saved with its whole shape: no rank's shard was written as if it were the
    tensor (vocabulary 67 is split 34 + 33)."""
    fmt, shapes = _saved_shapes(directory)
    assert fmt == ("ours" if arm == "full" else "torch"), (arm, fmt, directory)
    wrong = {k: (shapes.get(k), shape) for k, shape in expected.items() if shapes.get(k) != shape}
    assert not wrong, f"{arm}: {directory}: saved shape vs whole shape: {wrong}"


def _expected_shapes(params: dict) -> tuple[dict, dict]:
    """The tensors accelerate's sharded ``save_state`` writes: ``model.<name>``, and
    ``optimizer.state.<name>.exp_avg`` / ``.exp_avg_sq`` (AdamW)."""
    model = {f"model.{n}": tuple(p.shape) for n, p in params.items()}
    optim = {f"optimizer.state.{n}.{s}": tuple(p.shape)
             for n, p in params.items() for s in ("exp_avg", "exp_avg_sq")}  # fmt: skip
    return model, optim


# ----------------------------------------------------------------------------- case 1 and 2


def _resume_case(tmp: str, arm: str, state_dict_type: str, tied: bool) -> None:
    want = _torch_arm(("resume", state_dict_type, tied), _resume_program,
                      os.path.join(tmp, "torch"), state_dict_type, tied)  # fmt: skip
    _assert_resumes(want, "torch")
    assert want["types"] == {"torch"}, want["types"]
    if state_dict_type == "SHARDED_STATE_DICT":
        model, optim = _expected_shapes(want["params_on"])
        ckpt = want["ckpt"]
        _assert_whole_tensors_saved(os.path.join(ckpt, "pytorch_model_fsdp_0"), "torch", model)
        _assert_whole_tensors_saved(os.path.join(ckpt, "optimizer_0"), "torch", optim)
    if arm == "torch":
        return
    port, got = _run_arm(arm, _resume_program, os.path.join(tmp, arm), state_dict_type, tied)
    if got is None:  # refused; what it saved before, if anything, holds whole tensors
        model, optim = _expected_shapes(want["params_on"])
        for sub, expected in (("pytorch_model_fsdp_0", model), ("optimizer_0", optim)):
            if os.path.exists(os.path.join(tmp, arm, sub, ".metadata")):
                _assert_whole_tensors_saved(os.path.join(tmp, arm, sub), arm, expected)
        return
    assert ("accelerate.utils.fsdp_utils", "torch.distributed.fsdp") in port["imports"], port
    if arm == "full" and state_dict_type == "SHARDED_STATE_DICT":
        assert ("accelerate.utils.fsdp_utils", "torch.distributed.checkpoint") in port["imports"]
    assert got["types"] == {"dtensor", "fsdp2"}, got["types"]
    if state_dict_type == "SHARDED_STATE_DICT":
        model, optim = _expected_shapes(got["params_on"])
        ckpt = os.path.join(tmp, arm)
        _assert_whole_tensors_saved(os.path.join(ckpt, "pytorch_model_fsdp_0"), arm, model)
        _assert_whole_tensors_saved(os.path.join(ckpt, "optimizer_0"), arm, optim)
    _assert_resumes(got, arm)
    _assert_same_run(got, want, arm)


@pytest.mark.parametrize("arm", ["torch", "full", "mid"])
@pytest.mark.parametrize(
    "state_dict_type,tied",
    [("SHARDED_STATE_DICT", False), ("FULL_STATE_DICT", True)],
    ids=["sharded", "full-tied"],
)
def test_save_state_load_state_resumes_bit_for_bit(tmp_path, arm, state_dict_type, tied):
    """Cases 1 and 2: ``save_state`` after 2 steps, ``load_state`` into a model built from
    another seed; the next step is the uninterrupted run's, and the ported run PyTorch's."""
    run_on_ranks(2, _resume_case, tmp=str(tmp_path), arm=arm,
                 state_dict_type=state_dict_type, tied=tied)  # fmt: skip


# ----------------------------------------------------------------------------- case 3


def _export_program(out_dir: str) -> dict:
    with _clients.fsdp2_accelerator(**_plugin("SHARDED_STATE_DICT")) as acc:
        model = _llama(tied=True, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        _step(acc, model, opt, 0)
        full = _full_params(model)
        sd = acc.get_state_dict(model)
        acc.save_model(model, out_dir)
        acc.wait_for_everyone()
    files = {}
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name), "rb") as f:
            files[name] = f.read()
    return {
        "full": full,
        "sd": {k: v.detach().clone() for k, v in sd.items()},
        "where": {k: (v.dtype, v.device.type, type(v).__name__) for k, v in sd.items()},
        "files": files,
    }


def _export_case(tmp: str, arm: str) -> None:
    from safetensors.torch import load as load_safetensors

    want = _torch_arm(("export",), _export_program, os.path.join(tmp, "torch"))
    if dist.get_rank() == 0:  # PyTorch: the whole model on rank 0, on the CPU
        assert set(want["full"]) <= set(want["sd"]), (list(want["full"]), list(want["sd"]))
        for name, value in want["full"].items():
            assert torch.equal(want["sd"][name], value), name
        assert list(want["files"]) == ["model.safetensors"], list(want["files"])
        saved = load_safetensors(want["files"]["model.safetensors"])
        for name, value in want["full"].items():
            assert torch.equal(saved[name], value), name
    if arm == "torch":
        return
    port, got = _run_arm(arm, _export_program, os.path.join(tmp, arm))
    if got is None:
        return
    if arm == "full":  # Accelerator.get_state_dict's import of the state-dict helpers
        site = ("accelerate.accelerator", "torch.distributed.checkpoint.state_dict")
        assert site in port["imports"], port["imports"]
    assert list(got["sd"]) == list(want["sd"]), (arm, list(got["sd"]), list(want["sd"]))
    assert got["where"] == want["where"], (arm, got["where"], want["where"])
    _assert_same_params(got["sd"], want["sd"], f"{arm}: get_state_dict")
    assert list(got["files"]) == list(want["files"]), (arm, list(got["files"]))
    for name, data in want["files"].items():
        assert got["files"][name] == data, f"{arm}: {name} differs from PyTorch's run's"


@pytest.mark.parametrize("arm", ["torch", "full", "mid"])
def test_get_state_dict_and_save_model_files_equal(tmp_path, arm):
    """Case 3: ``get_state_dict`` (full, on rank 0, on the CPU) and ``save_model``
    (safetensors, tied embeddings): the same tensors and the same file bytes as PyTorch."""
    run_on_ranks(2, _export_case, tmp=str(tmp_path), arm=arm)


# ----------------------------------------------------------------------------- case 4


def _ram_efficient_program() -> dict:
    out = {}
    plugin = _plugin("SHARDED_STATE_DICT", cpu_ram_efficient_loading=True)
    with _clients.fsdp2_accelerator(**plugin) as acc:
        # only rank 0's weights count: the others' are overwritten from rank 0's
        model = _llama(tied=True, seed=0 if dist.get_rank() == 0 else 99)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt = acc.prepare(model, opt)
        out["types"] = _types(model)
        out["meta"] = sorted(n for n, p in model.named_parameters() if p.is_meta)
        out["loaded"] = _full_params(model)
        out["losses"] = [_step(acc, model, opt, s) for s in range(2)]
        out["params"] = _full_params(model)
    return out


def _ram_efficient_case(arm: str) -> None:
    want = _torch_arm(("ram-efficient",), _ram_efficient_program)
    rank0 = dict(_llama(tied=True, seed=0).named_parameters())
    assert want["meta"] == [], want["meta"]
    _assert_same_params(want["loaded"], {n: p.detach() for n, p in rank0.items()}, "torch: loaded")
    if arm == "torch":
        return
    _, got = _run_arm(arm, _ram_efficient_program)
    assert got["types"] == {"dtensor", "fsdp2"}, got["types"]
    assert got["meta"] == [], got["meta"]
    _assert_same_params(got["loaded"], want["loaded"], f"{arm}: loaded from rank 0")
    assert got["losses"] == want["losses"], (arm, got["losses"], want["losses"])
    _assert_same_params(got["params"], want["params"], f"{arm}: trained")


@pytest.mark.parametrize("arm", ["torch", "full"])
def test_cpu_ram_efficient_loading_trains_like_torch(arm):
    """Case 4: ``cpu_ram_efficient_loading=True``: the model is sharded on the meta device
    and filled from rank 0's weights (``fsdp2_load_full_state_dict``: ``distribute_tensor``,
    ``load_state_dict(assign=True)``), then trains as PyTorch's."""
    run_on_ranks(2, _ram_efficient_case, arm=arm)


# ----------------------------------------------------------------------------- case 5


def _lora_model(lora_seed: int):
    from peft import LoraConfig, get_peft_model

    base = _llama(tied=False, seed=0)
    torch.manual_seed(lora_seed)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(base, lora)
    with torch.no_grad():  # PEFT starts lora_B at zero; give it values of this seed
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in _full_params(model).items() if "lora_" in n}


def _adapter_program(ckpt: str, state_dict_type: str) -> dict:
    from accelerate.utils import load_fsdp_model, save_fsdp_model

    out = {}
    with _clients.fsdp2_accelerator(**_plugin(state_dict_type)) as acc:
        model = _lora_model(1)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = acc.prepare(model, opt)
        out["types"] = _types(model)
        out["losses"] = [_step(acc, model, opt, s) for s in range(2)]
        out["adapters"] = _adapters(model)
        out["base"] = {n: p for n, p in _full_params(model).items() if "lora_" not in n}
        # what transformers' Trainer does for a PEFT model under FSDP
        save_fsdp_model(acc.state.fsdp_plugin, acc, model, ckpt, adapter_only=True)
        acc.wait_for_everyone()
    if state_dict_type == "FULL_STATE_DICT":
        if dist.get_rank() == 0:
            out["file"] = torch.load(
                os.path.join(ckpt, "pytorch_model_fsdp.bin"), weights_only=True
            )
    else:
        out["shapes"] = _saved_shapes(os.path.join(ckpt, "pytorch_model_fsdp_0"))[1]
    with _clients.fsdp2_accelerator(**_plugin(state_dict_type)) as acc:
        model = _lora_model(2)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = acc.prepare(model, opt)
        load_fsdp_model(acc.state.fsdp_plugin, acc, model, ckpt, adapter_only=True)
        out["reloaded"] = _adapters(model)
    return out


def _adapter_case(tmp: str, arm: str, state_dict_type: str) -> None:
    want = _torch_arm(("adapter", state_dict_type), _adapter_program,
                      os.path.join(tmp, "torch"), state_dict_type)  # fmt: skip
    _assert_same_params(want["reloaded"], want["adapters"], "torch: reloaded adapters")
    if "file" in want:  # adapters only, whole, on rank 0
        assert len(want["file"]) == len(want["adapters"]) > 0, sorted(want["file"])
    if arm == "torch":
        return
    _, got = _run_arm(arm, _adapter_program, os.path.join(tmp, arm), state_dict_type)
    if got is None:
        return
    assert got["types"] == {"dtensor", "fsdp2"}, got["types"]
    assert got["losses"] == want["losses"], (arm, got["losses"], want["losses"])
    _assert_same_params(got["adapters"], want["adapters"], f"{arm}: trained adapters")
    _assert_same_params(got["base"], want["base"], f"{arm}: frozen base")
    if "file" in want:
        _assert_same_params(got["file"], want["file"], f"{arm}: saved adapter file")
    if "shapes" in want:
        assert got["shapes"] == want["shapes"], (arm, got["shapes"], want["shapes"])
    _assert_same_params(got["reloaded"], got["adapters"], f"{arm}: reloaded adapters")


@pytest.mark.parametrize("arm", ["torch", "full", "mid"])
@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"],
                         ids=["full", "sharded"])  # fmt: skip
def test_peft_adapter_only_save_equals_torch(tmp_path, arm, state_dict_type):
    """Case 5: LoRA on the tiny Llama, ``save_fsdp_model(..., adapter_only=True)`` as
    transformers' Trainer calls it (full: ``get_model_state_dict`` with
    ``dataclasses.replace(options, ignore_frozen_params=True)``; sharded: PEFT's state dict
    through the distributed checkpoint), then ``load_fsdp_model`` into fresh adapters."""
    run_on_ranks(2, _adapter_case, tmp=str(tmp_path), arm=arm, state_dict_type=state_dict_type)
