"""No host syncs and no metadata collectives in a steady-state training step.

On CUDA, reading a device tensor's value on the host (``.item()``, ``.tolist()``,
``int(t)``, ``bool(t)``, ``torch.equal``, an op whose output size depends on values such as
``nonzero``) blocks the host until the device has finished everything queued before it, and
a collective that exchanges sizes is one more round trip on top. On CPU nothing blocks, so
the test counts the calls that would: it patches those ``torch.Tensor`` methods, ``torch``
functions and ``torch.cuda`` synchronizations, and watches the aten ops that read values
with a dispatch mode. A call counts as the library's when the innermost frame outside torch
and the standard library is in ``device_mesh/``, ``dtensor/`` or ``fsdp2/``; the user's own
``loss.item()`` is counted apart (and must be seen, so the counter is known to work).

Each layout trains the GPT of ``examples/gpt.py`` (sequence 6: even over the tensor-parallel
ranks, as PyTorch's styles require) with ``loss.backward()``, ``dtensor.clip_grad_norm_``
and an AdamW step. After two warm-up steps, two more must have zero library syncs, and
every collective the library issues must be one the layout needs to move data, counted
from the model (``_expected_collectives``): none exchanges sizes or flags.

Layouts: FSDP (2 ranks), FSDP x TP (2 x 2, the shipped ``tp_plan``, with and without
activation checkpointing) and HSDP (2 x 2).
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtensor
from device_mesh import init_device_mesh
from dtensor.debug import CommDebugMode
from examples.gpt import GPT, GPTConfig, gpt_loss, tp_plan
from fsdp2 import parallelize_transformer
from tests.harness import run_on_ranks

VOCAB, SEQ, ROWS, LAYERS = 67, 6, 2, 2
WARMUP, MEASURED = 2, 2

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY = tuple(os.path.join(_ROOT, d) + os.sep for d in ("device_mesh", "dtensor", "fsdp2"))
_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
    os.path.abspath(__file__),
)

# Tensor methods and torch functions that hand a value to the host
_METHODS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
_FUNCTIONS = ("equal", "allclose", "is_nonzero")
# aten ops whose result needs values on the host (a scalar, or an output sized by values)
_ATEN = {
    "_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "allclose",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave",
}  # fmt: skip


class HostSyncCounter:
    """Counts host syncs while active: ``library`` and ``user`` map ``"what at file:line"``
    to a count (the site is the innermost frame outside torch and the standard library)."""

    def __init__(self) -> None:
        self.library: Counter = Counter()
        self.user: Counter = Counter()
        self._depth = 0  # a patched call inside another (tolist -> item) counts once

    def _note(self, what: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
            frame = frame.f_back
        if frame is None:
            return
        path = frame.f_code.co_filename
        site = f"{what} at {os.path.relpath(path, _ROOT)}:{frame.f_lineno}"
        (self.library if path.startswith(_LIBRARY) else self.user)[site] += 1

    def _wrap(self, what: str, fn):
        counter = self

        def counted(*args, **kwargs):
            if counter._depth == 0:
                counter._note(what)
            counter._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth -= 1

        return counted

    @contextlib.contextmanager
    def active(self):
        patched = []

        def patch(owner, name, what):
            old = getattr(owner, name, None)
            if old is not None:
                patched.append((owner, name, old))
                setattr(owner, name, self._wrap(what, old))

        for name in _METHODS:
            patch(torch.Tensor, name, f"Tensor.{name}")
        for name in _FUNCTIONS:
            patch(torch, name, f"torch.{name}")
        patch(torch.cuda, "synchronize", "torch.cuda.synchronize")
        patch(torch.cuda.Stream, "synchronize", "Stream.synchronize")
        patch(torch.cuda.Event, "synchronize", "Event.synchronize")
        try:
            with _AtenReads(self):
                yield self
        finally:
            for owner, name, old in reversed(patched):
                setattr(owner, name, old)


class _AtenReads(TorchDispatchMode):
    """The aten ops of ``_ATEN``, however they were reached (C++ included)."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in _ATEN and self.counter._depth == 0:
            self.counter._note(f"aten.{name}")
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------- the layouts
LAYOUTS = {
    "fsdp": (2, (2,), ("dp",), False),
    "fsdp_tp": (4, (2, 2), ("dp", "tp"), False),
    "fsdp_tp_ac": (4, (2, 2), ("dp", "tp"), True),
    "hsdp": (4, (2, 2), ("dp_replicate", "dp_shard"), False),
}


def _expected_collectives(names, ac: bool) -> Counter:
    """The collectives one step needs to move data, by kind, counted from the model.

    FSDP: one all-gather per group (the blocks' and the root's) in forward, one again per
    block in backward (blocks reshard after forward, the root does not), one reduction per
    group, plus HSDP's all-reduce over the replicas per group. Clipping: one all-reduce of
    the norms per mesh dim the gradients are sharded over (not ``dp_replicate``).
    """
    groups, blocks = LAYERS + 1, LAYERS
    c = Counter(all_gather=groups + blocks, reduce_scatter=groups)
    if "dp_replicate" in names:
        c["all_reduce"] += groups
    c["all_reduce"] += sum(n != "dp_replicate" for n in names)
    if "tp" in names:
        c += _tp_expected(ac)
    return c


def _tp_expected(ac: bool) -> Counter:
    """The shipped plan (sequence parallelism) on the "tp" dim.

    Forward: the two embeddings reduce-scatter their sums over the sequence; each block
    gathers the sequence for attention and for the MLP and reduce-scatters both outputs; the
    head gathers the sequence, then the vocabulary. Backward: each reduce-scatter's gradient
    is gathered and each sequence gather's gradient reduce-scattered (the vocabulary
    gather's is a slice); the three sequence-gathered inputs per model (two per block, the
    head's) are gathered again ([Note: regather in backward]); the gradients of the norms'
    replicated weights and biases, partial over the sequence, are all-reduced once each (two
    per LayerNorm). Activation checkpointing's recompute adds two all-gathers (attention's
    and the MLP's input) and one reduce-scatter (attention's output) per block: it stops
    at the MLP's last saved tensor, before its reduce-scatter.
    """
    seq_gathers, reduce_scatters = 2 * LAYERS + 1, 2 * LAYERS + 2
    forward = Counter(all_gather=seq_gathers + 1, reduce_scatter=reduce_scatters)
    backward = Counter(
        all_gather=reduce_scatters + seq_gathers,
        reduce_scatter=seq_gathers,
        all_reduce=2 * (2 * LAYERS + 1),
    )
    if ac:
        backward += Counter(all_gather=2 * LAYERS, reduce_scatter=LAYERS)
    return forward + backward


def _steady_state(layout: str):
    ws, shape, names, ac = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    tp = "tp" in names
    dp = [n for n in names if n != "tp"]
    cfg = GPTConfig(
        vocab_size=VOCAB, dim=24, n_layers=LAYERS, n_heads=4, max_seq_len=SEQ, bias=False,
        fused_qkv=not tp,
    )  # fmt: skip
    torch.manual_seed(0)
    model = parallelize_transformer(
        GPT(cfg), mesh, tp_plan=tp_plan() if tp else None, activation_checkpointing=ac
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the ranks of one tensor-parallel group take the same rows
    dp_index = 0
    for n in dp:
        dp_index = dp_index * mesh.size(names.index(n)) + mesh.get_local_rank(n)
    g = torch.Generator().manual_seed(dp_index)
    counter = HostSyncCounter()
    for step in range(WARMUP + MEASURED):
        x, y = (torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(2))
        measuring = step >= WARMUP
        with (
            counter.active() if measuring else contextlib.nullcontext(),
            CommDebugMode() as comm,
        ):
            loss = gpt_loss(model, x, y)
            loss.backward()
            dtensor.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            loss.item()  # the user's sync, not the library's
        if not measuring:
            continue
        assert not counter.library, f"step {step}: host syncs in the library: {counter.library}"
        expected = _expected_collectives(names, ac)
        assert Counter(comm.get_comm_counts()) == expected, (step, comm.get_comm_counts())
    assert sum(counter.user.values()) >= MEASURED, counter.user  # the counter sees syncs
    # ... and the library's: a check the user asked for reads the norm on the host
    gpt_loss(model, x, y).backward()
    with counter.active():
        dtensor.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert counter.library, "the counter missed clip_grad_norm_'s isfinite check"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_host_syncs_in_a_steady_state_step(layout):
    run_on_ranks(LAYOUTS[layout][0], _steady_state, layout=layout)
