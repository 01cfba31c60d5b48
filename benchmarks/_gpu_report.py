"""The GPU check's report (``benchmarks/gpu_check.py``): one line per part while it runs,
and ``gpu-report.md`` from the JSON report at the end (plain markdown, so it reads the
same in a terminal, a pull request or an issue)."""

from __future__ import annotations

ICON = {"ok": "ok", "failed": "FAILED", "timeout": "TIMEOUT", "skipped": "skipped",
        "running": "RUNNING (the run was cut here)"}  # fmt: skip


def part_line(part: str, result: dict) -> str:
    """``part: ok (52.1 s of 144 s)``."""
    return (f"{part}: {ICON.get(result['status'], result['status'])} "
            f"({result['seconds']:.1f} s of {result['budget_s']:.0f} s)")  # fmt: skip


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _one_line(text) -> str:
    return " ".join(str(text).split())[:1500]


def _x(v) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _environment(env: dict) -> list:
    keys = ("mode", "torch", "torch_supported", "cuda", "gpu", "gpus", "gpu_memory_gib",
            "capability", "nccl", "triton", "python")  # fmt: skip
    return _table(["what", "value"], [(k, env.get(k, "-")) for k in keys if k in env])


def _checks(result: dict) -> list:
    rows = [(c["name"], ICON.get(c["status"], c["status"]),
             "-" if c.get("seconds") is None else f"{c['seconds']:.1f}",
             str(c.get("detail", "")).replace("|", "/").replace("\n", " ")[:300])
            for c in result.get("checks", [])]  # fmt: skip
    return _table(["check", "result", "s", "detail"], rows) if rows else []


def _speed(result: dict) -> list:
    arms = result.get("arms", [])
    if not arms:
        return []
    rows = []
    for a in arms:
        peak = a.get("peak_allocated_gib", a.get("tracked_peak_gib"))
        rows.append((a["lib"], a["mode"], f"{a['step_s']:.3f}", f"{a['tokens_per_s']:,.0f}",
                     f"{a['mfu']:.1%}" if a.get("mfu") else "-",
                     f"{peak:.3g}" if peak is not None else "-",
                     f"{a['peak_reserved_gib']:.3g}" if "peak_reserved_gib" in a else "-",
                     f"{a['losses'][-1]:.4f}"))  # fmt: skip
    params = arms[0]["params"] / 1e9
    cuda = "peak_allocated_gib" in arms[0]
    peak = ("peak: `torch.cuda.max_memory_allocated` / `_reserved` over the timed steps"
            if cuda else "peak: PyTorch's MemTracker over one more step (live tensor bytes)")  # fmt: skip
    out = [f"Llama-style model, {params:.2f}B parameters, bf16 compute, fp32 reduction, "
           f"world size 1, both libraries from the same weights and batch; median step of "
           f"the timed steps; {peak}; MFU against {arms[0].get('peak_flops', '-')}.", ""]  # fmt: skip
    out += _table(["lib", "mode", "step (s)", "tokens/s", "MFU", "peak (GiB)",
                   "peak reserved (GiB)", "last loss"], rows)  # fmt: skip
    from benchmarks._gpu_speed import compare

    cmp_rows = [(r["mode"], _x(r["tokens_per_s_ratio"]), _x(r.get("peak_ratio")),
                 "met" if r["tokens_per_s_ratio"] >= 1.0 and r.get("peak_ratio", 1.0) <= 1.0
                 else "not met") for r in result.get("comparison") or compare(arms)]  # fmt: skip
    tiny = "" if cuda else " - --cpu's tiny sizes: these ratios check the code path, not speed"
    out += [f"Ours / PyTorch's FSDP2 (goal: tokens/s >= 1.00x, peak <= 1.00x){tiny}:", ""]
    return out + _table(["mode", "tokens/s", "peak memory", "goal"], cmp_rows)


def _dispatch(result: dict) -> list:
    tables = result.get("tables")
    if not tables:
        return []
    out = []
    for kind in ("hit", "miss"):
        t = tables[kind]
        rows = [(op, f"{r['ours_us']:.1f}", f"{r['torch_us']:.1f}", _x(r["ratio"]))
                for op, r in t["ops"].items()]  # fmt: skip
        rows.append(("geomean", "", "", _x(t["geomean"])))
        out += [f"Sharding cache {kind}:", ""] + _table(["op", "ours (us)", "torch (us)",
                                                          "ours / torch"], rows)  # fmt: skip
    return out


def _planner(result: dict) -> list:
    rows = [(r["arm"], f"{r['predicted_gib']:.3g}", f"{r['measured_gib']:.3g}",
             _x(r["predicted_over_measured"]), r["peak_phase"]) for r in result.get("rows", [])]  # fmt: skip
    if not rows:
        return []
    return _table(["arm", "predicted (GiB)", "measured (GiB)", "predicted / measured",
                   "predicted peak at"], rows)  # fmt: skip


SECTIONS = {"speed": _speed, "dispatch": _dispatch, "planner": _planner}


def markdown(report: dict) -> str:
    """The whole report as markdown."""
    env = report["environment"]
    title = "CPU (--cpu)" if env["mode"] == "cpu" else env.get("gpu", "no GPU found")
    lines = [f"# GPU check: {title}", ""]
    lines += _environment(env)
    if "error" in report:
        lines += [f"**Not run: {_one_line(report['error'])}.**", ""]
    if not env.get("torch_supported", True):
        lines += [f"**PyTorch {env['torch']} is outside the supported 2.11-2.13.**", ""]
    for part, result in report["parts"].items():
        lines += [f"## {part}: {part_line(part, result).split(': ', 1)[1]}", ""]
        if result.get("error"):
            lines += [f"Error: {_one_line(result['error'])}", ""]
        if result.get("note"):
            lines += [f"Note: {_one_line(result['note'])}", ""]
        lines += _checks(result)
        lines += SECTIONS.get(part, lambda r: [])(result)
    return "\n".join(lines)
