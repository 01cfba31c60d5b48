"""The dry-run proof of a plan: ``verify_plan`` plays the plan on the fake process group
(``fsdp2.tools.dry_run.dry_run_plan``) and compares what the library built and issued with
what the plan predicts.

[Note: the dry-run proof] For each simulated rank played (the first and the last by
default: the last holds the short shards where rows do not divide), the comparison is:

* each ``fully_shard`` group's local shard elements against ``AutoPlan.shard_numel_for``
  at that rank, and the plan's rank-0 sizes against the same arithmetic;
* each group's parameters (by FQN), each block group's ``reshard_after_forward``, and the
  checkpointed blocks;
* the collectives of one forward and backward, count and bytes per ``(kind, mesh dim)``,
  against ``plan.collectives`` on the data-parallel dims, and on ``"tp"`` where the plan
  models tensor parallelism's (``planner.collectives``: only for ``examples.gpt``'s plan
  without activation checkpointing).

``auto_parallelize`` needs a process without a process group for it, so it runs
``python -m fsdp2.auto --payload ...`` (``run_in_fresh_process``) on rank 0 and
shares the verdict. The fresh process gets the model as a ``"module:function"`` builder
when one is given, else as a pickled meta copy (``dry_run.meta_copy``): that needs every
class of the model importable by its module name (not defined in ``__main__``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_API = "verify_plan"
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

    Example:
        >>> check = verify_plan(plan, "mypkg.models:build", ranks=[0, 1023])
        >>> check.ok, check.summary()
    """

    ok: bool
    mismatches: list[str] = field(default_factory=list)
    reports: list = field(default_factory=list)
    seconds: float = 0.0

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
            return (
                f"plan holds at simulated ranks {ranks} of {world} ({self.seconds:.1f} s): {what}"
            )
        body = "".join(f"\n  - {m}" for m in self.mismatches[:30])
        if not self.reports:
            return f"plan not checked:{body}"
        more = len(self.mismatches) - 30
        return f"plan does NOT hold at simulated ranks {ranks} of {world}:{body}" + (
            f"\n  ... and {more} more" if more > 0 else ""
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


def compare_report(plan, report) -> list[str]:
    """The differences between one dry run (``DryRunReport`` of ``dry_run_plan``) and
    ``plan`` ([Note: the dry-run proof]); empty when it holds.

    Example:
        >>> compare_report(plan, dry_run_plan(plan, build, rank=0))
        []
    """
    from fsdp2.auto._apply import membership_mismatches

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
    if "checkpointed" in report.layout and list(report.layout["checkpointed"]) != list(
        plan.checkpointed
    ):
        out.append(
            f"{tag}: checkpointed {report.layout['checkpointed']}, planned {list(plan.checkpointed)}"
        )
    dims = compared_dims(plan)
    keys = {k for k in plan.collectives} | {k for k in report.counts if k[1] in dims}
    for key in sorted(keys):
        want = plan.collectives.get(key)
        got = (report.counts[key], report.bytes.get(key, 0)) if key in report.counts else None
        if want != got:
            out.append(f"{tag}: {key[0]} on {key[1]!r}: issued {_fmt(got)}, planned {_fmt(want)}")
    return out


def _fmt(v) -> str:
    return "none" if v is None else f"{v[0]} call(s), {v[1]:,} bytes"


def verify_plan(
    plan,
    build_model,
    *,
    world_size: int | None = None,
    ranks=None,
    tp_plan: dict | None = None,
    loss_fn=None,
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

    Returns:
        ``PlanCheck``: ``ok``, the differences, the dry-run reports.

    Raises:
        ValueError: a world size other than the plan's, or ranks outside it.
        RuntimeError: a process group exists in this process.

    Example:
        >>> check = verify_plan(plan, lambda: GPT(cfg), world_size=1024)
        >>> check.ok
        True
    """
    from fsdp2.tools.dry_run import dry_run_plan

    if world_size is not None and world_size != plan.world_size:
        raise ValueError(
            f"{_API}: world_size={world_size!r}, but the plan is laid out for "
            f"{plan.world_size} ranks (mesh {plan.mesh_shape}); plan for {world_size} ranks "
            "and verify that plan."
        )
    if ranks is None:
        ranks = sorted({0, plan.world_size - 1})
    ranks = list(ranks)
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < plan.world_size]
    if bad or not ranks:
        raise ValueError(f"{_API}: ranks must be ints in [0, {plan.world_size}), got {ranks!r}.")
    t0 = time.perf_counter()
    reports, mismatches = [], []
    for r in ranks:
        report = dry_run_plan(plan, build_model, rank=r, tp_plan=tp_plan, loss_fn=loss_fn)
        reports.append(report)
        mismatches += compare_report(plan, report)
    check = PlanCheck(not mismatches, mismatches, reports, time.perf_counter() - t0)
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


def run_in_fresh_process(
    plan, *, build_model: str | None = None, model_bytes: bytes | None = None,
    tp_plan: dict | None = None, timeout_s: float = 600.0,
) -> PlanCheck:  # fmt: skip
    """``verify_plan`` in a fresh Python process (``python -m fsdp2.auto
    --payload``): this one may have a process group. The model goes as ``build_model``
    (``"module:function"``) or ``model_bytes`` (``model_payload``). A process that fails
    or times out is a failed check naming its error.

    Example:
        >>> run_in_fresh_process(plan, build_model="examples.gpt_builders:gpt_7b").ok
        True
    """
    with tempfile.TemporaryDirectory(prefix="fsdp2-dry-run-") as tmp:
        payload, out = Path(tmp) / "payload.pt", Path(tmp) / "verdict.json"
        torch.save(
            {"plan": plan.to_json(), "build_model": build_model, "model_bytes": model_bytes,
             "tp_plan": tp_plan},
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
            return PlanCheck(False, [f"the dry run did not finish within {timeout_s:.0f} s"])
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
