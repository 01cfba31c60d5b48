"""Rendering an ``AutoPlan``: the calls as Python source, the plain-text table, and the
JSON-ready ``dict`` (and back)."""

from __future__ import annotations

import keyword
from dataclasses import asdict, fields

import torch

from fsdp2.tools.planner import GiB, PlanConfig

FORMAT = "fsdp2.auto_plan/1"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"`` (None stays None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def dtype_of(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` for an unknown name."""
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"AutoPlan: unknown dtype {name!r}; expected one of {sorted(_DTYPES)}.")
    return _DTYPES[name]


def fmt_bytes(n: float | None) -> str:
    """Bytes as GiB (MiB below one GiB, KiB below one MiB)."""
    if n is None:
        return "-"
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def module_expr(fqn: str, root: str = "model") -> str:
    """The Python expression of the submodule ``fqn`` of ``root``: ``"blocks.3"`` ->
    ``model.blocks[3]``, ``""`` -> ``model``; a name that is neither an identifier nor an
    index, or is a Python keyword (``in``, ``class``), goes through ``get_submodule``.

    Example:
        >>> module_expr("model.layers.0"), module_expr("blocks.0.in")
        ('model.model.layers[0]', "model.get_submodule('blocks.0.in')")
    """
    if not fqn:
        return root
    out = root
    for part in fqn.split("."):
        if part.isdigit():
            out += f"[{int(part)}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            out += f".{part}"
        else:
            return f"{root}.get_submodule({fqn!r})"
    return out


def _config_to_dict(cfg: PlanConfig) -> dict:
    out = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, torch.dtype):
            value = dtype_name(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _config_from_dict(d: dict) -> PlanConfig:
    kw = dict(d)
    for name in ("param_dtype", "reduce_dtype"):
        kw[name] = dtype_of(kw.get(name))
    if kw.get("checkpointed_blocks") is not None:
        kw["checkpointed_blocks"] = tuple(kw["checkpointed_blocks"])
    return PlanConfig(**kw)


def _mesh_expr(plan) -> str:
    dims = plan.dp_dims
    return f"mesh[{', '.join(repr(d) for d in dims)}]".replace("'", '"')


def render_calls(plan) -> list[str]:
    """``AutoPlan.calls``."""
    steps = plan._steps()
    names = ["fully_shard"]
    mp = plan.mp_policy()
    if mp is not None:
        names.append("MixedPrecisionPolicy")
    if plan.offload:
        names.append("CPUOffloadPolicy")
    lines = []
    if mp is not None:
        lines.append("import torch")
    lines.append(f"from fsdp2 import {', '.join(sorted(names))}")
    if plan.checkpointed:
        lines.append("from torch.distributed._composable import checkpoint")
    if plan.tp > 1:
        lines.append("from dtensor.parallel import parallelize_module")
        if plan.tp_plan_source == "tp_plan_for":
            lines.append("from fsdp2.plan import tp_plan_for")
            lines.append("tp_plan = tp_plan_for(model)")
    extra = ""
    if mp is not None:
        parts = []
        if plan.param_dtype is not None:
            parts.append(f"param_dtype=torch.{dtype_name(plan.param_dtype)}")
        if plan.reduce_dtype is not None:
            parts.append(f"reduce_dtype=torch.{dtype_name(plan.reduce_dtype)}")
        extra += f", mp_policy=MixedPrecisionPolicy({', '.join(parts)})"
    if plan.offload:
        extra += ", offload_policy=CPUOffloadPolicy()"
    mesh = _mesh_expr(plan)
    for step in steps:
        if step[0] == "tp":
            lines.append('parallelize_module(model, mesh["tp"], tp_plan)')
        elif step[0] == "checkpoint":
            lines.append(f"checkpoint({module_expr(step[1])})")
        else:
            _, fqns, raf = step
            mods = [module_expr(f) for f in fqns]
            target = mods[0] if len(mods) == 1 else f"[{', '.join(mods)}]"
            raf_arg = "" if raf is None else f", reshard_after_forward={raf}"
            lines.append(f"fully_shard({target}, mesh={mesh}{raf_arg}{extra})")
    return lines


def render_table(plan) -> str:
    """``str(AutoPlan)``."""
    cfg = plan.config
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh_dim_names, plan.mesh_shape))
    margin = "-" if plan.margin is None else f"{plan.margin:.0%}"
    dtypes = "the parameters' own dtype (no mixed precision)"
    if plan.mp_policy() is not None:
        dtypes = (
            f"param {_SHORT.get(plan.param_dtype, 'own')}, "
            f"reduce {_SHORT.get(plan.reduce_dtype, 'param')}"
        )
    lines = [
        f"AutoPlan: {cfg.describe()} on {plan.world_size} rank(s), mesh {mesh} "
        f"({plan.device_type})",
        f"  peak         {fmt_bytes(plan.predicted_peak)} live at {plan.peak_phase}, "
        f"allocator {fmt_bytes(plan.allocator_bytes)}; budget {fmt_bytes(plan.budget)} "
        f"with margin {margin}"
        + (f"; measured {fmt_bytes(plan.measured_peak)}" if plan.measured_peak else ""),
        "  by category  "
        + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.categories.items() if v),
        f"  step         {plan.step_s:.4g} s (compute {plan.compute_s:.3g} s, "
        f"communication {plan.comm_s:.3g} s) on {plan.hardware or '?'}",
        f"  batch        {plan.global_batch} sequences a step ({plan.batch_size} per "
        f"data-parallel rank) x {plan.seq_len} tokens",
        f"  precision    {dtypes}; offload {'yes' if plan.offload else 'no'}; "
        f"optimizer {cfg.optimizer}",
    ]
    if plan.tp > 1:
        styles: dict[str, int] = {}
        for s in plan.tp_plan.values():
            styles[s] = styles.get(s, 0) + 1
        lines.append(
            f"  tensor par.  tp={plan.tp}, {len(plan.tp_plan)} entries ("
            + ", ".join(f"{k} {v}" for k, v in sorted(styles.items()))
            + f") from {plan.tp_plan_source}"
        )
    lines.append(
        "  checkpoint   " + (", ".join(plan.checkpointed) if plan.checkpointed else "none")
    )
    rows = [("group", "modules", "reshard", "shard (rank 0)")]
    for g in plan.groups:
        mods = ", ".join(m or "<root>" for m in g.modules)
        if len(mods) > 40:
            mods = mods[:37] + "..."
        raf = "root" if g.reshard_after_forward is None else str(g.reshard_after_forward)
        rows.append((g.name, mods, raf, f"{g.shard_numel:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if plan.alternatives:
        lines.append("  considered   (fastest first)")
        for a in plan.alternatives:
            mark = "*" if a.chosen else (" " if a.fits else "x")
            lines.append(
                f"   {mark} {a.layout:<40} peak {fmt_bytes(a.peak_bytes):>10}  "
                f"step {a.step_s:.4g} s"
            )
    for note in plan.notes:
        lines.append(f"  note         {note}")
    return "\n".join(lines)


def plan_to_dict(plan) -> dict:
    """``AutoPlan.to_dict``."""
    return {
        "format": FORMAT,
        "config": _config_to_dict(plan.config),
        "describe": plan.config.describe(),
        "mesh_shape": list(plan.mesh_shape),
        "mesh_dim_names": list(plan.mesh_dim_names),
        "device_type": plan.device_type,
        "blocks": list(plan.blocks),
        "groups": [
            {
                "name": g.name,
                "modules": list(g.modules),
                "reshard_after_forward": g.reshard_after_forward,
                "shard_numel": g.shard_numel,
                "unsharded_numel": g.unsharded_numel,
                "params": [[p.fqn, list(p.shape), p.tp_dim] for p in g.params],
            }
            for g in plan.groups
        ],
        "checkpointed": list(plan.checkpointed),
        "tp_plan": dict(plan.tp_plan),
        "tp_plan_source": plan.tp_plan_source,
        "predicted_peak": plan.predicted_peak,
        "peak_phase": plan.peak_phase,
        "categories": dict(plan.categories),
        "allocator_bytes": plan.allocator_bytes,
        "budget": plan.budget,
        "margin": plan.margin,
        "step_s": plan.step_s,
        "compute_s": plan.compute_s,
        "comm_s": plan.comm_s,
        "collectives": [[k, d, c, b] for (k, d), (c, b) in sorted(plan.collectives.items())],
        "global_batch": plan.global_batch,
        "seq_len": plan.seq_len,
        "hardware": plan.hardware,
        "alternatives": [asdict(a) for a in plan.alternatives],
        "measured_peak": plan.measured_peak,
        "notes": list(plan.notes),
    }


def plan_from_dict(cls, d: dict, PlannedGroup, PlannedParam, Alternative):  # noqa: N803
    """``AutoPlan.from_dict`` (the plan's classes passed in: ``_plan`` imports this
    module)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ValueError(
            f"AutoPlan.from_dict: expected a plan of format {FORMAT!r}, got {got!r} "
            "(write plans with AutoPlan.to_json)."
        )
    groups = [
        PlannedGroup(
            g["name"],
            tuple(g["modules"]),
            g["reshard_after_forward"],
            int(g["shard_numel"]),
            int(g["unsharded_numel"]),
            tuple(PlannedParam(f, tuple(s), t) for f, s, t in g["params"]),
        )
        for g in d["groups"]
    ]
    return cls(
        config=_config_from_dict(d["config"]),
        mesh_shape=tuple(d["mesh_shape"]),
        mesh_dim_names=tuple(d["mesh_dim_names"]),
        device_type=d["device_type"],
        blocks=tuple(d["blocks"]),
        groups=groups,
        checkpointed=tuple(d["checkpointed"]),
        tp_plan=dict(d["tp_plan"]),
        tp_plan_source=d["tp_plan_source"],
        predicted_peak=int(d["predicted_peak"]),
        peak_phase=d["peak_phase"],
        categories=dict(d["categories"]),
        allocator_bytes=int(d["allocator_bytes"]),
        budget=d["budget"],
        margin=d["margin"],
        step_s=float(d["step_s"]),
        compute_s=float(d["compute_s"]),
        comm_s=float(d["comm_s"]),
        collectives={(k, dim): (int(c), int(b)) for k, dim, c, b in d["collectives"]},
        global_batch=int(d["global_batch"]),
        seq_len=int(d["seq_len"]),
        hardware=d["hardware"],
        alternatives=[Alternative(**_alternative(a)) for a in d["alternatives"]],
        measured_peak=d["measured_peak"],
        notes=list(d.get("notes", [])),
    )


def _alternative(a: dict) -> dict:
    """An alternative's fields (its label was ``"describe"`` in earlier plan files)."""
    return {("layout" if k == "describe" else k): v for k, v in a.items()}
