"""Run PyTorch's OpInfo database on DTensors and compare with the same ops on full tensors.

Used by ``tests/test_dtensor_op_coverage.py`` (our DTensor, against a checked-in list of
expected failures) and by ``benchmarks/op_coverage.py`` (ours and PyTorch's DTensor side by
side). The engine is the same for both libraries: a ``Lib`` names the mesh constructor and
the DTensor classes, nothing else differs.

For every op (the float32 CPU OpInfos of ``op_db`` plus the ``_foreach_`` ops) and every
*layout* (every tensor argument Replicate, Shard(0), Shard(last), or a 2-D mesh with
Shard(last) then Shard(0)), the first few samples run:

1. On full tensors (the reference), forward and, where the op has autograd, backward with a
   fixed gradient of the outputs.
2. On DTensors built with ``from_local`` from each rank's block of the same full tensors (no
   communication to build them; uneven splits and empty blocks included).
3. Outputs are gathered (``full_tensor``) and compared with the reference: values (close, or
   equal for integers), then shape, dtype and stride (global metadata must equal what the op
   returns on full tensors). Then the same for the inputs' gradients.

A case's outcome is one word: ``pass``, ``refused`` (a ``NotImplementedError``: the library
said clearly that it has no rule), ``error`` (any other exception), ``wrong`` (a value or
metadata differs) or ``skip`` (the reference itself fails, or the sample has no tensor to
shard). An op's outcome for a layout is its worst sample's. Ranks agree on every case's
outcome before the next (one tiny all-gather), so a rank that failed alone is seen, not hung.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

LAYOUTS = ("replicate", "shard0", "shardlast", "shard2d")
ORDER = {"pass": 0, "skip": 0, "refused": 1, "error": 2, "wrong": 3}
SAMPLES_PER_OP = 2
TOL = {"atol": 1e-4, "rtol": 1e-4}


@dataclasses.dataclass
class Lib:
    """What the engine needs of a DTensor library."""

    name: str
    init_device_mesh: object
    DTensor: type
    Shard: type
    Replicate: type
    Partial: type


def ours() -> Lib:
    from device_mesh import init_device_mesh
    from dtensor import DTensor, Partial, Replicate, Shard

    return Lib("ours", init_device_mesh, DTensor, Shard, Replicate, Partial)


def pytorch() -> Lib:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return Lib("pytorch", init_device_mesh, DTensor, Shard, Replicate, Partial)


def all_ops() -> list:
    """The OpInfos the coverage test runs, sorted by name (every rank sees the same list)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal import common_methods_invocations as cmi
    ops = [o for o in cmi.op_db if torch.float32 in o.supported_dtypes("cpu")]
    for db in (
        cmi.foreach_unary_op_db,
        cmi.foreach_binary_op_db,
        cmi.foreach_pointwise_op_db,
        cmi.foreach_reduce_op_db,
        cmi.foreach_other_op_db,
    ):
        ops += [o for o in db if torch.float32 in o.supported_dtypes("cpu")]
    return sorted(ops, key=op_name)


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def samples(op, n: int = SAMPLES_PER_OP) -> list:
    """The first ``n`` samples of ``op`` (float32, CPU, requiring grad where it has autograd)."""
    torch.default_generator.manual_seed(0)
    kwargs = {}
    if op.name.startswith("_foreach_"):
        kwargs["num_input_tensors"] = [3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it = iter(
            op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd, **kwargs)
        )
        out = []
        for _ in range(n):
            try:
                out.append(next(it))
            except StopIteration:
                break
    return out


# --------------------------------------------------------------------------- layouts


def _placements(lib: Lib, layout: str, t: torch.Tensor) -> tuple:
    if t.ndim == 0 or layout == "replicate":
        return (lib.Replicate(),) * (2 if layout == "shard2d" else 1)
    if layout == "shard0":
        return (lib.Shard(0),)
    if layout == "shardlast":
        return (lib.Shard(t.ndim - 1),)
    return (lib.Shard(t.ndim - 1), lib.Shard(0))


def _block(t: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's block of ``t`` under ``placements`` (``torch.chunk`` splits, as Shard)."""
    coord = mesh.get_coordinate()
    for mesh_dim, p in enumerate(placements):
        if hasattr(p, "dim") and p.is_shard():
            n = mesh.size(mesh_dim)
            size = t.shape[p.dim]
            step = -(-size // n) if size else 0
            start = min(step * coord[mesh_dim], size)
            stop = min(start + step, size)
            t = t.narrow(p.dim, start, stop - start)
    return t


def to_dtensor(lib: Lib, mesh, layout: str, t: torch.Tensor):
    pl = _placements(lib, layout, t)
    local = _block(t.detach(), mesh, pl).clone()
    local.requires_grad_(t.requires_grad)
    return lib.DTensor.from_local(local, mesh, pl, shape=t.shape, stride=t.stride())


def _full(lib: Lib, x):
    if isinstance(x, lib.DTensor):
        return x.full_tensor()
    return x


# --------------------------------------------------------------------------- one case


def _compare(got, ref) -> str | None:
    """None when ``got`` equals ``ref`` in value and metadata; else what differs."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"returned {type(got).__name__}, expected a tensor"
        if got.shape != ref.shape:
            return f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
        if got.dtype != ref.dtype:
            return f"dtype {got.dtype} != {ref.dtype}"
        try:
            if ref.is_floating_point() or ref.is_complex():
                torch.testing.assert_close(got, ref, equal_nan=True, check_stride=False, **TOL)
            elif not torch.equal(got, ref):
                return "values differ"
        except AssertionError as e:
            return "values differ: " + str(e).splitlines()[0][:120]
        return None
    if isinstance(ref, float) and isinstance(got, float):
        return (
            None
            if abs(got - ref) <= TOL["atol"] + TOL["rtol"] * abs(ref) or (got != got and ref != ref)
            else f"{got} != {ref}"
        )
    if type(got) is not type(ref):
        return f"returned {type(got).__name__}, expected {type(ref).__name__}"
    return None if got == ref else f"{got!r} != {ref!r}"


def _metadata(dt_out, ref_out) -> str | None:
    """Global metadata of each DTensor output vs the reference's."""
    if isinstance(ref_out, torch.Tensor) and isinstance(dt_out, torch.Tensor):
        if dt_out.shape != ref_out.shape:
            return f"global shape {tuple(dt_out.shape)} != {tuple(ref_out.shape)}"
        if dt_out.dtype != ref_out.dtype:
            return f"global dtype {dt_out.dtype} != {ref_out.dtype}"
        if ref_out.numel() > 1 and dt_out.stride() != ref_out.stride() and ref_out.is_contiguous():
            return f"global stride {dt_out.stride()} != {ref_out.stride()}"
    return None


def _grad_out(ref: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ref.shape, generator=g, dtype=ref.dtype)


def _differentiable(t) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.requires_grad
        and (t.is_floating_point() or t.is_complex())
    )


def run_case(lib: Lib, mesh, layout: str, info, sample, *, backward: bool = True) -> dict:
    """``{"fwd": (outcome, detail), "bwd": (outcome, detail)}`` of one sample of OpInfo
    ``info`` on ``layout`` (``bwd`` only when ``backward``)."""
    result = {"fwd": ("skip", ""), "bwd": ("skip", "")} if backward else {"fwd": ("skip", "")}
    op = info.op
    leaves, spec = tree_flatten(((sample.input, *sample.args), dict(sample.kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not any(x.ndim > 0 for x in tensors):
        return {k: ("skip", "no tensor to shard") for k in result}
    if any(x.layout != torch.strided for x in tensors):
        return {k: ("skip", "sparse input") for k in result}
    ref_in = [_fresh(x) for x in leaves]
    try:
        ref_out = _call(op, ref_in, spec)
    except Exception as e:  # the reference fails: nothing to compare
        return {k: ("skip", f"reference raised {type(e).__name__}") for k in result}
    ref_flat = tree_flatten(ref_out)[0]
    random = _is_random(info)
    grads = _reference_grads(info, ref_flat, ref_in) if backward else None
    if backward and isinstance(grads, str):
        result["bwd"] = ("skip", grads)
    try:
        dt_in = [to_dtensor(lib, mesh, layout, x) if _shardable(x) else x for x in leaves]
        d_flat = tree_flatten(_call(op, dt_in, spec))[0]
        bad = _compare_outputs(lib, d_flat, ref_flat, random)
        if bad is not None:
            return {k: ("wrong", bad) for k in result}
        result["fwd"] = ("pass", "")
        if not backward or isinstance(grads, str):
            return result
        outs, grads_out, ref_grads = grads
        d_outs = [o for o in d_flat if _differentiable(o)]
        d_ins = [x for x in dt_in if _differentiable(x)]
        if len(d_outs) != len(outs):
            result["bwd"] = ("wrong", "outputs that need a gradient differ")
            return result
        d_grads_out = [_grad_like(lib, mesh, o, g) for o, g in zip(d_outs, grads_out, strict=True)]
        d_grads = torch.autograd.grad(d_outs, d_ins, d_grads_out, allow_unused=True)
        bad = None if random else _compare_grads(lib, d_grads, ref_grads)
        result["bwd"] = ("wrong", bad) if bad is not None else ("pass", "")
    except NotImplementedError as e:
        return {k: v if v[0] == "pass" else ("refused", _first_line(e)) for k, v in result.items()}
    except Exception as e:
        got = ("error", f"{type(e).__name__}: {_first_line(e)}")
        return {k: v if v[0] == "pass" else got for k, v in result.items()}
    return result


def _fresh(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def _shardable(x) -> bool:
    return isinstance(x, torch.Tensor) and x.ndim > 0


def _call(op, leaves, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.default_generator.manual_seed(1)
        args, kwargs = tree_unflatten(leaves, spec)
        return op(*args, **kwargs)


def _reference_grads(info, ref_flat, ref_in):
    """(outputs, their gradients, the inputs' gradients) on full tensors, or why not."""
    outs = [o for o in ref_flat if _differentiable(o)]
    ins = [x for x in ref_in if _differentiable(x)]
    if not outs or not ins or not info.supports_autograd:
        return "nothing to differentiate"
    grads_out = [_grad_out(o, 7 + i) for i, o in enumerate(outs)]
    try:
        return outs, grads_out, torch.autograd.grad(outs, ins, grads_out, allow_unused=True)
    except Exception as e:
        return f"reference backward raised {type(e).__name__}"


def _compare_outputs(lib, d_flat, ref_flat, random: bool) -> str | None:
    if len(d_flat) != len(ref_flat):
        return f"{len(d_flat)} outputs, expected {len(ref_flat)}"
    for got, ref in zip(d_flat, ref_flat, strict=True):
        bad = _metadata(got, ref)
        if bad is None and not random:
            bad = _compare(_full(lib, got), ref)
        if bad is not None:
            return bad
    return None


def _compare_grads(lib, d_grads, ref_grads) -> str | None:
    for got, ref in zip(d_grads, ref_grads, strict=True):
        if ref is None or got is None:
            # PyTorch returns None or zeros for an input that does not reach the output
            other = _full(lib, got) if got is not None else ref
            if other is not None and other.any():
                return "a gradient is missing"
            continue
        bad = _metadata(got, ref) or _compare(_full(lib, got), ref)
        if bad is not None:
            return "grad " + bad
    return None


def _grad_like(lib: Lib, mesh, out, g: torch.Tensor):
    """The output gradient ``g`` laid out as ``out`` (a Partial output gets it replicated)."""
    pl = tuple(lib.Replicate() if p.is_partial() else p for p in out.placements)
    local = _block(g, mesh, pl).clone()
    return lib.DTensor.from_local(local, out.device_mesh, pl, shape=g.shape, stride=g.stride())


def _is_random(op) -> bool:
    return bool(
        re.search(
            r"(^|[._])(empty|rand|randn|normal|bernoulli|dropout|multinomial|uniform|exponential|geometric|cauchy|log_normal|poisson|rrelu)",
            op_name(op),
        )
    )


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:160] if s else type(e).__name__


# --------------------------------------------------------------------------- ranks agree


def agree(outcomes: dict) -> dict:
    """Every rank's outcomes (``{direction: (outcome, detail)}``), merged by one all-gather:
    per direction the worst, with a note when ranks differed."""
    keys = sorted(outcomes)
    word = torch.tensor(
        [ORDER[outcomes[k][0]] if outcomes[k][0] != "skip" else -1 for k in keys],
        dtype=torch.int64,
    )
    words = [torch.zeros_like(word) for _ in range(dist.get_world_size())]
    dist.all_gather(words, word)
    merged = {}
    for j, k in enumerate(keys):
        outcome, detail = outcomes[k]
        vals = [int(w[j]) for w in words]
        if len(set(vals)) == 1:
            merged[k] = (outcome, detail)
            continue
        name = {v: n for n, v in ORDER.items() if n != "skip"}.get(max(vals), "skip")
        merged[k] = (
            "error" if name == "pass" else name,
            f"ranks differ ({vals}); this rank: {outcome} {detail}",
        )
    return merged


def run_ops(
    lib: Lib,
    layouts=LAYOUTS,
    *,
    only=None,
    skip_ops=(),
    backward=True,
    samples_per_op=SAMPLES_PER_OP,
    verbose=False,
    on_op=None,
) -> dict:
    """``{(op name, layout, 'fwd'|'bwd'): (outcome, detail)}`` over every op (or ``only``)."""
    torch.set_default_dtype(torch.float32)
    ws = dist.get_world_size()
    meshes = {}
    results = {}
    for op in all_ops():
        name = op_name(op)
        if only is not None and name not in only:
            continue
        if name in skip_ops:
            continue
        if verbose and dist.get_rank() == 0:
            print(name, flush=True)
        if on_op is not None:
            on_op(name, None)
        cases = samples(op, samples_per_op)
        for layout in layouts:
            if layout not in meshes:
                shape = (
                    (ws // 2, 2)
                    if layout == "shard2d" and ws % 2 == 0 and ws > 2
                    else ((ws, 1) if layout == "shard2d" else (ws,))
                )
                meshes[layout] = lib.init_device_mesh("cpu", shape)
            mesh = meshes[layout]
            worst = {}
            for sample in cases:
                got = agree(run_case(lib, mesh, layout, op, sample, backward=backward))
                for direction, outcome in got.items():
                    old = worst.get(direction)
                    if (
                        old is None
                        or old[0] == "skip"
                        or (outcome[0] != "skip" and ORDER[outcome[0]] > ORDER[old[0]])
                    ):
                        worst[direction] = outcome
            for direction, outcome in worst.items():
                results[(name, layout, direction)] = outcome
        if on_op is not None:
            on_op(name, {k: v for k, v in results.items() if k[0] == name})
    return results
