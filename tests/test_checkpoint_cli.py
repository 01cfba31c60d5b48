"""``python -m dtensor.checkpoint`` with its output piped or redirected (not a terminal): every
key and every message comes out whole, one line each, whatever width rich would assume."""

from __future__ import annotations

import pytest
import torch

from dtensor import checkpoint as dcp
from dtensor.checkpoint.__main__ import main as cli
from dtensor.checkpoint.tools import verify

# 100 and more characters: past the 80 columns rich assumes off a terminal
LONG = "transformer.layers.0.attention_block.query_key_value_projection_with_a_long_name"


@pytest.fixture
def long_ckpt(tmp_path, monkeypatch):
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    state = {
        "model": {
            LONG: {"weight": torch.randn(33, 7), "bias[0]": torch.zeros(33)},
            "w": torch.ones(2),
        },
        "step": 3,
    }
    path = tmp_path / "a_checkpoint_directory_whose_name_is_long_too" / "step-000100"
    dcp.save(state, checkpoint_id=path)
    return path


def test_inspect_piped_prints_every_key_whole(long_ckpt, capsys):
    assert cli(["inspect", str(long_ckpt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [f"model.{LONG}.bias[0]", f"model.{LONG}.weight", "model.w"]
    for key in keys:
        rows = [line.split() for line in lines if line.split()[:1] == [key]]
        assert len(rows) == 1, (key, lines)
    weight = next(line.split() for line in lines if line.startswith(f"model.{LONG}.weight"))
    assert weight[1:] == ["[33,", "7]", "F32", "1", "924", "B"], weight
    assert any(line.split()[:1] == ["total"] for line in lines), lines
    assert "values: step" in lines


def test_verify_piped_prints_each_message_on_one_line(long_ckpt, capsys):
    assert cli(["verify", str(long_ckpt)]) == 0
    out = capsys.readouterr().out
    assert out == f"ok {long_ckpt}: metadata, headers and every chunk's CRC-32 check out\n"
    data = long_ckpt / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # the last chunk's bytes no longer match its CRC-32
    data.write_bytes(bytes(raw))
    problems = verify(long_ckpt)
    assert problems and max(len(p) for p in problems) > 80
    assert cli(["verify", str(long_ckpt)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"problem {p}" for p in problems]


def test_cli_errors_print_whole_on_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    missing = tmp_path / ("not_a_checkpoint_" * 5)
    missing.mkdir()
    assert cli(["inspect", str(missing)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error {missing} is not a checkpoint"), lines
