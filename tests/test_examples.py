"""The main job, ``examples/train_gpt.py``, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.run import get_args_parser

from examples import train_gpt
from examples.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent


def test_relaunch_command_parses_under_torchrun():
    # every option of the script, as the docstring's own command line uses them
    argv = ["--nproc", "4", "--steps", "100", "--dim", "256", "--bf16", "--log-every", "5"]
    argv += ["--temperature", "0.7", "--top-k", "10", "--threads", "1", "--seq", "64"]
    argv += ["--compile", "aot_eager"]
    args = train_gpt.parse_args(argv)
    cmd = train_gpt.torchrun_command(args, argv)
    parsed = get_args_parser().parse_args(cmd[3:])  # what torchrun itself makes of it
    assert parsed.nproc_per_node == "4" and parsed.standalone
    assert "--nproc" not in parsed.training_script_args
    forwarded = train_gpt.parse_args(parsed.training_script_args)
    assert forwarded.steps == 100 and forwarded.compile == "aot_eager"
    assert train_gpt.parse_args(["--compile"]).compile == "inductor"
    assert train_gpt.torchrun_command(args, ["--nproc=3"])[-1].endswith("train_gpt.py")


def test_generate_samples_with_temperature_and_top_k():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, max_seq_len=8))
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 12)
    a = model.generate(prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(5))
    k1 = model.generate(prompt, 12, temperature=1.0, top_k=1)
    assert torch.equal(a, b) and not torch.equal(a, greedy)  # seeded: reproducible
    assert torch.equal(k1, greedy)  # top-1 sampling is greedy
    assert int(a.max()) < 40 and a.shape == (1, 15)


@pytest.mark.slow
@pytest.mark.nightly  # 14 s; 2-D training is test_tensor_parallel's, in the test pool
def test_train_2d_runs_fsdp_with_tensor_parallelism_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "examples" / "train_2d.py"), "--dp", "2", "--tp", "2"]
    cmd += ["--steps", "4", "--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16"]
    cmd += ["--batch", "2", "--log-every", "2", "--loss-parallel"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "{'dp': 2, 'tp': 2}" in out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/4", "3/4", "4/4"], out.stdout
    first, last = float(lines[0].split()[3]), float(lines[-1].split()[3])
    assert last < first, out.stdout


@pytest.mark.nightly  # 19 s of two torchrun jobs; the checkpoint tests cover resuming in make test
def test_train_gpt_resumes_exactly_from_its_checkpoint(tmp_path):
    """4 steps with a checkpoint at 2, against 2 steps resumed from that checkpoint: the
    step-4 checkpoints of the two runs hold bit-identical values. Off a terminal the script
    prints a line every ``--log-every`` steps and the last, and a closing sample. The first
    run also profiles memory (its tables and chart: ``_check_memory_profile``), which must
    change no value."""
    from safetensors.torch import load_file

    from dtensor.checkpoint.tools import consolidate

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--nproc", "2", "--steps", "4"]
    base += ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2"]
    base += ["--log-every", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    chart = tmp_path / "memory.svg"
    runs = [
        ["--checkpoint-dir", str(straight), "--checkpoint-every", "2"]
        + ["--profile-memory", "--memory-chart", str(chart)],
        ["--checkpoint-dir", str(resumed), "--resume"],
    ]
    for i, extra in enumerate(runs):
        if i == 1:  # the second run starts from the first run's step-2 checkpoint
            resumed.mkdir()
            (straight / "step-000002").rename(resumed / "step-000002")
        out = subprocess.run(
            base + extra, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        if i == 0:  # the progress lines ("step 1/4 ..."), not the ledger's "step 3" table
            lines = [ln for ln in out.stdout.splitlines() if re.match(r"step +\d+/", ln)]
            assert [line.split()[1] for line in lines] == ["1/4", "3/4", "4/4"], out.stdout
            assert "sample: 'def " in out.stdout
            _check_memory_profile(out.stdout, chart)
    assert "resumed from step 2" in out.stdout
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    consolidate(straight / "step-000004", a)
    consolidate(resumed / "step-000004", b)
    a, b = load_file(str(a)), load_file(str(b))
    assert a.keys() == b.keys() and any(k.endswith("exp_avg") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.nightly  # 14 s; test_checkpoint loads a 4-way save into every layout in the pool
def test_checkpoint_reshard_resumes_fsdp4_as_fsdp2_tp2(tmp_path):
    """The example saves at 4-way FSDP and resumes on a 2 x 2 FSDP + TP mesh; it exits 1 when
    the resumed losses leave the straight run's by more than its tolerance."""
    from dtensor.checkpoint.tools import verify

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "examples" / "checkpoint_reshard.py"), "--dir", str(tmp_path)]
    cmd += ["--steps-before", "3", "--steps-after", "2", "--dim", "32", "--seq", "16"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "losses match" in out.stdout, out.stdout
    assert verify(tmp_path / "step-000003") == []


def _check_memory_profile(stdout: str, chart) -> None:
    """``--profile-memory`` printed rank 0's memory tables at the end of the run, and
    ``--memory-chart`` wrote its last step's memory by category as an SVG."""
    import xml.etree.ElementTree as ET

    assert "live tensor bytes by category" in stdout, stdout
    for name in ("sharded_params", "unsharded_params", "optimizer_state", "blocks.0.attn"):
        assert name in stdout, name
    svg = ET.parse(chart).getroot()
    assert svg.tag.endswith("svg") and re.search(r"memory over step \d", ET.tostring(svg, "unicode"))
    polygons = [e for e in svg.iter() if e.tag.endswith("polygon")]
    assert len(polygons) >= 4  # a band per category present: parameters, grads, state, ...
