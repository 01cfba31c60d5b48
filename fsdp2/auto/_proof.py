"""The dry-run proof of a plan: ``verify_plan`` plays the plan on the fake process group
(``fsdp2.tools.dry_run.dry_run_plan``, laid out by ``plan.apply``) and compares what the
library built and issued with what the plan predicts.

[Note: the dry-run proof] For each simulated rank played (the first and the last by
default: the last holds the short shards where rows do not divide, and the last
tensor-parallel coordinate), the comparison is:

* each ``fully_shard`` group's local shard elements against ``AutoPlan.shard_numel_for``
  at that rank, and the plan's rank-0 sizes against the same arithmetic;
* each group's parameters (by FQN), each block group's ``reshard_after_forward``, and the
  checkpointed blocks;
* the collectives of one forward and backward per ``(kind, mesh dim)``, on the
  data-parallel dims and on ``"tp"`` where the plan predicts tensor parallelism's
  (``planner.collectives``: ``examples.gpt``'s plan, with or without checkpointing): their
  COUNTS at every rank played; their BYTES (``plan.collectives`` holds rank 0's) at the
  ranks whose bytes are rank 0's (``bytes_comparable``): every rank without tensor
  parallelism (``fully_shard`` pads every shard to the first one's size), the ranks of
  tensor-parallel coordinate 0 (``rank % tp == 0``: ``tp`` is the innermost dim), and every
  rank when each tensor-parallel dim of the plan's parameters divides by ``tp``. Elsewhere
  (an uneven vocabulary at ``tp`` 2: the last rank's rows are fewer) the bytes are not
  rank 0's and only counts are compared; ``PlanCheck.notes`` says at which ranks.

The step's loss is ``auto_parallelize``'s ``forward_fn`` where it can be sent to the fresh
process (importable by name, or pickled without ``__main__``), else the sum of the logits;
where neither works (the model's output has no logits), the collectives are not compared
at all (``collectives=False``; a warning, and a note in the plan).

``auto_parallelize`` needs a process without a process group for it, so it runs
``python -m fsdp2.auto --payload ...`` (``run_in_fresh_process``) on rank 0 and
shares the verdict; the other ranks wait for it in a broadcast, under the process group's
timeout (NCCL's default: 600 s), so the fresh process gets less: ``DRY_RUN_TIMEOUT_S``
(240 s; ``FSDP2_DRY_RUN_TIMEOUT_S`` in the environment sets another). The fresh process
gets the model as a ``"module:function"`` builder when one is given, else as a pickled
meta copy (``dry_run.meta_copy``): that needs every class of the model importable by its
module name (not defined in ``__main__``).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_API = "verify_plan"
#: Seconds ``auto_parallelize``'s dry run may take in its fresh process (the environment's
#: ``FSDP2_DRY_RUN_TIMEOUT_S`` sets another): below NCCL's default process-group timeout
#: (600 s), under which the other ranks wait for the verdict.
DRY_RUN_TIMEOUT_S = 240.0
TIMEOUT_ENV = "FSDP2_DRY_RUN_TIMEOUT_S"
# a forward_fn pickled for the fresh process larger than this holds data: not sent
_MAX_LOSS_BYTES = 1 << 20
# what a fresh process must not inherit: the launcher's rendezvous (it plays no real rank)
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


@dataclass
class PlanCheck:
    """The verdict of a dry run of a plan.

    Attributes:
        ok: nothing differs.
        mismatches: one line per difference, prefixed with the simulated rank.
        reports: the dry runs' ``DryRunReport`` (one per simulated rank).
        seconds: wall time of the dry runs.
        notes: what was not compared, and why (collective bytes at some ranks, or the
            collectives altogether).

    Example:
        >>> check = verify_plan(plan, "mypkg.models:build", ranks=[0, 1023])
        >>> check.ok, check.summary()
    """

    ok: bool
    mismatches: list[str] = field(default_factory=list)
    reports: list = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One paragraph: the verdict, the ranks played and the differences.

        Example:
            >>> print(check.summary())
            plan holds at simulated ranks [0, 63] of 64 (1.2 s): 7 groups, 5 collective kinds
        """
        ranks = [r.rank for r in self.reports]
        world = self.reports[0].world_size if self.reports else "?"
        if self.ok:
            first = self.reports[0] if self.reports else None
            what = (
                f"{len(first.shard_numel)} groups, {len(first.counts)} collective kinds"
                if first
                else "nothing played"
            )
            notes = "".join(f"; {n}" for n in self.notes)
            return (
                f"plan holds at simulated ranks {ranks} of {world} ({self.seconds:.1f} s): "
                f"{what}{notes}"
            )
        body = "".join(f"\n  - {m}" for m in self.mismatches[:30])
        if not self.reports:
            return f"plan not checked:{body}"
        more = len(self.mismatches) - 30
        notes = "".join(f"\n  ({n})" for n in self.notes)
        return (
            f"plan does NOT hold at simulated ranks {ranks} of {world}:{body}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + notes
        )

    def raise_if_failed(self) -> None:
        """Raise ``PlanMismatchError`` with the differences unless ``ok``.

        Example:
            >>> verify_plan(plan, build).raise_if_failed()
        """
        from fsdp2.auto._apply import PlanMismatchError

        if not self.ok:
            raise PlanMismatchError(f"{_API}: {self.summary()}", self.mismatches)

    def to_dict(self) -> dict:
        """A JSON-ready ``dict`` (``from_dict`` reads it back).

        Example:
            >>> PlanCheck.from_dict(check.to_dict()).ok == check.ok
            True
        """
        return {
            "ok": self.ok,
            "mismatches": list(self.mismatches),
            "reports": [r.to_dict() for r in self.reports],
            "seconds": self.seconds,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict) -> PlanCheck:
        """The verdict of ``to_dict``'s output.

        Example:
            >>> PlanCheck.from_dict(json.loads(text)).summary()
        """
        from fsdp2.tools.dry_run import DryRunReport

        return cls(
            bool(d["ok"]),
            list(d["mismatches"]),
            [DryRunReport.from_dict(r) for r in d["reports"]],
            float(d["seconds"]),
            list(d.get("notes", [])),
        )


def compared_dims(plan) -> set[str]:
    """The mesh dims whose collectives the proof compares: the data-parallel ones, and
    any the plan predicts collectives on (``"tp"`` where the planner models it).

    Example:
        >>> sorted(compared_dims(plan))
        ['dp_shard']
    """
    dims = set(plan.dp_dims)
    dims |= {dim for (_kind, dim) in plan.collectives}
    return dims


def bytes_comparable(plan, rank: int) -> bool:
    """Whether simulated ``rank`` contributes the plan's collective bytes (rank 0's):
    without tensor parallelism every rank does (``fully_shard`` pads each shard to the
    first's size); with it, the ranks of tensor-parallel coordinate 0, and every rank when
    each tensor-parallel dim of the plan's parameters divides by ``tp``
    ([Note: the dry-run proof]).

    Example:
        >>> plan.mesh_shape, [bytes_comparable(plan, r) for r in range(4)]  # vocab 65, tp 2
        ((2, 2), [True, False, True, False])
    """
    if plan.tp <= 1:
        return True
    where = dict(zip(plan.mesh_dim_names, plan.coordinate_of(rank), strict=True))
    if where.get("tp", 0) == 0:
        return True
    return all(
        p.shape[p.tp_dim] % plan.tp == 0
        for g in plan.groups
        for p in g.params
        if p.tp_dim is not None
    )


def compare_report(plan, report, *, collectives: bool = True) -> list[str]:
    """The differences between one dry run (``DryRunReport`` of ``dry_run_plan``) and
    ``plan`` ([Note: the dry-run proof]); empty when it holds. The collectives' bytes are
    compared only where they are rank 0's (``bytes_comparable``), their counts always;
    ``collectives=False`` compares none (a dry run without the step).

    Example:
        >>> layout = functools.partial(plan.apply, check=False)
        >>> compare_report(plan, dry_run_plan(plan, build, rank=0, layout=layout))
        []
    """
    out = _shard_mismatches(plan, report) + _layout_mismatches(plan, report)
    return out + (_collective_mismatches(plan, report) if collectives else [])


def _shard_mismatches(plan, report) -> list[str]:
    tag = f"rank {report.rank}"
    out = []
    if tuple(report.mesh_shape.values()) != tuple(plan.mesh_shape):
        out.append(f"{tag}: mesh {report.mesh_shape}, planned {plan.mesh_shape}")
    rank0 = plan.shard_numel_for(0)
    for g in plan.groups:
        if g.params and rank0[g.name] != g.shard_numel:
            out.append(
                f"{g.name}: the plan says rank 0 holds {g.shard_numel} elements, its "
                f"parameters' shapes give {rank0[g.name]}"
            )
    expected = plan.shard_numel_for(report.rank)
    for name in sorted(set(expected) | set(report.shard_numel)):
        want, got = expected.get(name), report.shard_numel.get(name)
        if want != got:
            out.append(f"{tag}: {name} built {got} local elements, planned {want}")
    return out


def _layout_mismatches(plan, report) -> list[str]:
    from fsdp2.auto._apply import membership_mismatches

    tag = f"rank {report.rank}"
    out = []
    if "params" in report.layout:
        out += [f"{tag}: {m}" for m in membership_mismatches(plan, report.layout["params"])]
    raf = report.layout.get("reshard_after_forward", {})
    for g in plan.groups:
        if g.reshard_after_forward is not None and g.name in raf:
            if raf[g.name] != g.reshard_after_forward:
                out.append(
                    f"{tag}: {g.name} reshard_after_forward={raf[g.name]}, planned "
                    f"{g.reshard_after_forward}"
                )
    built = report.layout.get("checkpointed")
    if built is not None and list(built) != list(plan.checkpointed):
        out.append(f"{tag}: checkpointed {built}, planned {list(plan.checkpointed)}")
    return out


def _collective_mismatches(plan, report) -> list[str]:
    tag = f"rank {report.rank}"
    out = []
    dims = compared_dims(plan)
    with_bytes = bytes_comparable(plan, report.rank)
    keys = {k for k in plan.collectives} | {k for k in report.counts if k[1] in dims}
    for key in sorted(keys):
        want = plan.collectives.get(key)
        got = (report.counts[key], report.bytes.get(key, 0)) if key in report.counts else None
        if with_bytes and want != got:
            out.append(f"{tag}: {key[0]} on {key[1]!r}: issued {_fmt(got)}, planned {_fmt(want)}")
        elif not with_bytes and (want or (0,))[0] != (got or (0,))[0]:
            out.append(
                f"{tag}: {key[0]} on {key[1]!r}: issued {(got or (0,))[0]} call(s), planned "
                f"{(want or (0,))[0]} (counts only: this rank's bytes are not rank 0's)"
            )
    return out


def _fmt(v) -> str:
    return "none" if v is None else f"{v[0]} call(s), {v[1]:,} bytes"


def _ranks_to_play(plan, world_size, ranks) -> list[int]:
    """``verify_plan``'s ranks (default: the first and the last), checked."""
    if world_size is not None and world_size != plan.world_size:
        raise ValueError(
            f"{_API}: world_size={world_size!r}, but the plan is laid out for "
            f"{plan.world_size} ranks (mesh {plan.mesh_shape}); plan for {world_size} ranks "
            "and verify that plan."
        )
    ranks = sorted({0, plan.world_size - 1}) if ranks is None else list(ranks)
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < plan.world_size]
    if bad or not ranks:
        raise ValueError(f"{_API}: ranks must be ints in [0, {plan.world_size}), got {ranks!r}.")
    return ranks


def _bytes_note(plan, ranks: list[int]) -> list[str]:
    counts_only = [r for r in ranks if not bytes_comparable(plan, r)]
    if not counts_only:
        return []
    with_bytes = [r for r in ranks if r not in counts_only]
    return [
        f"collective bytes compared at simulated rank(s) {with_bytes}, counts only at "
        f"{counts_only} (another tensor-parallel coordinate, where a tensor-parallel dim "
        f"that does not divide by tp={plan.tp} makes their shards differ from rank 0's)"
    ]


def verify_plan(
    plan,
    build_model,
    *,
    world_size: int | None = None,
    ranks=None,
    tp_plan: dict | None = None,
    loss_fn=None,
    collectives: bool = True,
) -> PlanCheck:
    """Dry-run ``plan`` at its world size on the fake process group and compare what the
    library builds and issues with the plan ([Note: the dry-run proof]).

    Runs in this process, which must not have a process group (``auto_parallelize``
    runs it in a fresh one); nothing is allocated (the model lives on meta).

    Args:
        plan: the ``AutoPlan``.
        build_model: a callable building the model (called under ``torch.device("meta")``),
            a ``"module:function"`` string naming one, or the model itself (copied to meta).
        world_size: the simulated world; the plan's (``plan.world_size``) and only that,
            given to say so explicitly (a plan is laid out for one world size).
        ranks: the simulated ranks to play (default: the first and the last).
        tp_plan: with tensor parallelism, the ``parallelize_module`` plan (default:
            ``tp_plan_for(model)``).
        loss_fn: ``loss_fn(model, idx) -> loss`` for the step (default: sum of logits).
        collectives: run the step and compare its collectives (False: shard sizes and
            layout only, for a model whose loss the step cannot compute).

    Returns:
        ``PlanCheck``: ``ok``, the differences, the dry-run reports, ``notes`` on what
        was not compared.

    Raises:
        ValueError: a world size other than the plan's, or ranks outside it.
        RuntimeError: a process group exists in this process.

    Example:
        >>> check = verify_plan(plan, lambda: GPT(cfg), world_size=1024)
        >>> check.ok
        True
    """
    from fsdp2.tools.dry_run import dry_run_plan

    ranks = _ranks_to_play(plan, world_size, ranks)
    layout = functools.partial(plan.apply, tp_plan=tp_plan, check=False)
    t0 = time.perf_counter()
    reports, mismatches = [], []
    for r in ranks:
        report = dry_run_plan(
            plan, build_model, layout=layout, rank=r, loss_fn=loss_fn, collectives=collectives
        )
        reports.append(report)
        mismatches += compare_report(plan, report, collectives=collectives)
    notes = _bytes_note(plan, ranks) if collectives else ["collectives not compared"]
    check = PlanCheck(not mismatches, mismatches, reports, time.perf_counter() - t0, notes)
    logger.info("%s: %s", _API, check.summary())
    return check


# ---------------------------------------------------------------------------- fresh process
def importable_name(fn) -> str | None:
    """``"module:qualname"`` of ``fn`` when a fresh process can import it by that name
    (a module-level function or class outside ``__main__``), else None.

    Example:
        >>> importable_name(GPT)
        'examples.gpt:GPT'
    """
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qual:
        return None
    try:
        from fsdp2.tools.dry_run import import_builder

        return f"{module}:{qual}" if import_builder(f"{module}:{qual}") is fn else None
    except ValueError:
        return None


def model_payload(model) -> bytes:
    """A meta copy of ``model``, pickled for a fresh process (``torch.save``).

    Raises:
        ValueError: a class of the model defined in ``__main__`` (a fresh process cannot
            import it), or a model that does not pickle.

    Example:
        >>> len(model_payload(model)) < 1 << 20           # no data: structure only
        True
    """
    from fsdp2.tools.dry_run import meta_copy

    fix = (
        "pass build_model='package.module:function' (a function building the model, "
        "importable in a fresh process) or dry_run=False"
    )
    local = sorted({type(m).__name__ for m in model.modules() if type(m).__module__ == "__main__"})
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    if cfg is not None and type(cfg).__module__ == "__main__":
        local.append(type(cfg).__name__)
    if local:
        raise ValueError(
            f"auto_parallelize: the dry run rebuilds the model in a fresh process, which "
            f"cannot import {local} (defined in __main__); {fix}."
        )
    buf = io.BytesIO()
    try:
        torch.save(meta_copy(model), buf)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same fix
        raise ValueError(
            f"auto_parallelize: the dry run sends a meta copy of the model to a fresh "
            f"process, but it does not pickle ({type(e).__name__}: {e}); {fix}."
        ) from None
    return buf.getvalue()


class _NotSendable(Exception):
    """A loss function that a fresh process cannot load or should not get (internal:
    ``loss_payload`` returns None for it)."""


class _SendablePickler(pickle.Pickler):
    """A pickler that refuses what a fresh process cannot load or should not get:
    functions, classes and objects of ``__main__``, tensors and modules (data)."""

    def reducer_override(self, obj):
        if isinstance(obj, (torch.Tensor, torch.nn.Module)):
            raise _NotSendable(type(obj).__name__)
        own = isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__")
        module = getattr(obj, "__module__", None) if own else type(obj).__module__
        if module == "__main__":
            raise _NotSendable("__main__")
        return NotImplemented


def loss_payload(fn) -> dict | None:
    """How a fresh process gets the loss function ``fn``: ``{"loss_fn": "module:qualname"}``
    when it imports by name, ``{"loss_fn_bytes": pickle}`` when it pickles without
    ``__main__`` and without tensors or modules (a ``functools.partial`` of an importable
    function, an instance of an importable class), else None.

    Example:
        >>> loss_payload(examples.gpt.gpt_loss)
        {'loss_fn': 'examples.gpt:gpt_loss'}
    """
    name = importable_name(fn)
    if name is not None:
        return {"loss_fn": name}
    buf = io.BytesIO()
    try:
        _SendablePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    except Exception:  # noqa: BLE001 - any failure: it cannot be sent
        return None
    if buf.tell() > _MAX_LOSS_BYTES:
        return None
    return {"loss_fn_bytes": buf.getvalue()}


def loss_from_payload(payload: dict):
    """The loss function ``loss_payload`` sent (None: the default).

    Raises:
        ValueError: a name that does not import here, or bytes that do not load.

    Example:
        >>> loss_from_payload({"loss_fn": "examples.gpt:gpt_loss"})
        <function gpt_loss at ...>
    """
    from fsdp2.tools.dry_run import import_builder

    if payload.get("loss_fn") is not None:
        return import_builder(payload["loss_fn"], what="forward_fn")
    if payload.get("loss_fn_bytes") is not None:
        try:
            return pickle.loads(payload["loss_fn_bytes"])  # noqa: S301 - our own payload
        except Exception as e:  # noqa: BLE001 - any failure: say what did not load
            raise ValueError(
                f"forward_fn did not unpickle in the dry run's fresh process "
                f"({type(e).__name__}: {e}); pass a module-level function."
            ) from None
    return None


def dry_run_timeout() -> float:
    """Seconds the dry run's fresh process may take: ``FSDP2_DRY_RUN_TIMEOUT_S`` from the
    environment, else ``DRY_RUN_TIMEOUT_S`` (240).

    Raises:
        ValueError: the variable set to something other than a positive number.

    Example:
        >>> dry_run_timeout()
        240.0
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DRY_RUN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"auto_parallelize: {TIMEOUT_ENV}={raw!r} is not a positive number of seconds; "
            f"unset it (default {DRY_RUN_TIMEOUT_S:.0f} s) or give seconds below the process "
            "group's timeout, such as 300."
        )
    return value


def run_in_fresh_process(
    plan, *, build_model: str | None = None, model_bytes: bytes | None = None,
    tp_plan: dict | None = None, loss: dict | None = None, collectives: bool = True,
    timeout_s: float | None = None,
) -> PlanCheck:  # fmt: skip
    """``verify_plan`` in a fresh Python process (``python -m fsdp2.auto
    --payload``): this one may have a process group. The model goes as ``build_model``
    (``"module:function"``) or ``model_bytes`` (``model_payload``), the loss function as
    ``loss`` (``loss_payload``; None: the sum of the logits). A process that fails or
    runs past ``timeout_s`` (default ``dry_run_timeout()``: 240 s) is a failed check
    naming its error.

    Example:
        >>> run_in_fresh_process(plan, build_model="examples.gpt_builders:gpt_7b").ok
        True
    """
    timeout_s = dry_run_timeout() if timeout_s is None else float(timeout_s)
    with tempfile.TemporaryDirectory(prefix="fsdp2-dry-run-") as tmp:
        payload, out = Path(tmp) / "payload.pt", Path(tmp) / "verdict.json"
        torch.save(
            {"plan": plan.to_json(), "build_model": build_model, "model_bytes": model_bytes,
             "tp_plan": tp_plan, "collectives": collectives, **(loss or {})},
            payload,
        )  # fmt: skip
        env = {k: v for k, v in os.environ.items()
               if k not in _LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}  # fmt: skip
        path = [p or os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(path)
        env["CUDA_VISIBLE_DEVICES"] = ""  # all on meta: keep the fresh process off the GPUs
        cmd = [sys.executable, "-m", "fsdp2.auto", "--payload", str(payload), "--json", str(out)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return PlanCheck(
                False,
                [f"the dry run did not finish within {timeout_s:.0f} s (set {TIMEOUT_ENV} "
                 "for more, below the process group's timeout, or pass dry_run=False)"],
            )  # fmt: skip
        if out.exists():
            check = PlanCheck.from_dict(json.loads(out.read_text()))
            logger.info("dry run in a fresh process (%.1f s): %s", time.perf_counter() - t0,
                        check.summary())  # fmt: skip
            return check
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
        return PlanCheck(
            False,
            [f"the dry run's process failed (exit status {proc.returncode}):\n    "
             + "\n    ".join(tail)],
        )  # fmt: skip
