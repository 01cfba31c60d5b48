"""``local_map``: run a function written for plain tensors on the local pieces of DTensors.

The wrapped function sees each DTensor argument as this rank's local tensor and returns
plain tensors; ``local_map`` wraps those back as DTensors laid out as ``out_placements``
on the mesh of the arguments. Nothing is communicated unless an argument has to be
redistributed to ``in_placements`` (``redistribute_inputs=True``), or its gradient to
``in_grad_placements`` in backward. The function is trusted to produce pieces that fit the
declared placements: ``local_map`` does not check them, as PyTorch's does not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from device_mesh import as_device_mesh
from dtensor.placement import format_placements, normalize_placements
from dtensor.tensor import DTensor, is_torch_dtensor, torch_dtensor_message

_API = "local_map"


def local_map(
    func: Callable | None = None,
    out_placements=None,
    in_placements=None,
    in_grad_placements=None,
    device_mesh=None,
    *,
    redistribute_inputs: bool = False,
):
    """``func`` made to take DTensors: it runs on their local tensors and its tensor outputs
    become DTensors laid out as ``out_placements``.

    Arguments and outputs are matched to placements in pytree-flattened order (a list
    argument counts once per element).

    Args:
        func: the function on local tensors; without it, ``local_map(...)`` is a decorator.
        out_placements: the placements of each flattened output: one placement sequence for
            a single output, a tuple of them (``None`` for a non-tensor output) for several.
        in_placements: the placements each flattened argument must have (``None`` for a
            non-tensor argument), or None to accept any. A plain-tensor argument is passed
            through unchecked.
        in_grad_placements: for each DTensor argument, the layout of the gradient of its
            local tensor (``to_local(grad_placements=...)``); None: as the argument.
        device_mesh: the mesh of the outputs; default: the first DTensor argument's.
        redistribute_inputs: redistribute an argument whose placements differ from
            ``in_placements`` instead of raising.

    Without any DTensor argument ``func`` runs unchanged and its outputs stay plain.

    Raises:
        ValueError: an argument's placements differ from ``in_placements`` (without
            ``redistribute_inputs``), or the number of placements differs from the number
            of flattened arguments or outputs.
        TypeError: a placement is given for a non-tensor argument or output, none is given
            for a DTensor argument, or ``func`` returned a DTensor.

    Example:
        >>> def row_sums(x):                     # x: this rank's rows
        ...     return x.sum(dim=1)
        >>> f = local_map(row_sums, out_placements=[Shard(0)], in_placements=([Shard(0)],))
        >>> f(distribute_tensor(torch.ones(5, 3), mesh, [Shard(0)])).full_tensor()
        tensor([3., 3., 3., 3., 3.])
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )
    if not callable(func):
        raise TypeError(f"{_API}: func must be callable, got {func!r}.")
    placements = (out_placements, in_placements, in_grad_placements)
    return functools.partial(_run_local, func, *placements, device_mesh, redistribute_inputs)


def _run_local(
    func, out_placements, in_placements, in_grad_placements, mesh, redistribute, *args, **kwargs
):
    flat, spec = pytree.tree_flatten(args)
    for name, given in (
        ("in_placements", in_placements),
        ("in_grad_placements", in_grad_placements),
    ):
        if given is not None and len(given) != len(flat):
            raise ValueError(
                f"{_API}: {name} must have one entry per flattened argument ({len(flat)}), "
                f"got {len(given)}."
            )
    local_args = []
    seen_dtensor = False
    for i, arg in enumerate(flat):
        if isinstance(arg, DTensor):
            seen_dtensor = True
            if mesh is None:
                mesh = arg.device_mesh
            arg = _with_placements(arg, i, in_placements, redistribute)
            grads = None if in_grad_placements is None else in_grad_placements[i]
            if in_grad_placements is not None and grads is None:
                raise TypeError(
                    f"{_API}: in_grad_placements[{i}] must be placements for the DTensor "
                    "argument there, got None."
                )
            local_args.append(arg.to_local(grad_placements=grads))
            continue
        if is_torch_dtensor(arg):
            raise TypeError(torch_dtensor_message(_API, f"argument {i}", arg))
        if (
            in_placements is not None
            and not isinstance(arg, torch.Tensor)
            and in_placements[i] is not None
        ):
            raise TypeError(
                f"{_API}: in_placements[{i}] must be None for the non-tensor argument "
                f"{type(arg).__name__} there, got {in_placements[i]!r}."
            )
        local_args.append(arg)
    out = func(*pytree.tree_unflatten(local_args, spec), **kwargs)
    if not seen_dtensor:
        return out
    return _wrap_outputs(
        out, out_placements, as_device_mesh(mesh, api=_API, argument="device_mesh")
    )


def _with_placements(arg: DTensor, i: int, in_placements, redistribute: bool) -> DTensor:
    """``arg`` laid out as ``in_placements[i]``, redistributed only when allowed."""
    if in_placements is None:
        return arg
    want = in_placements[i]
    if want is None:
        raise TypeError(
            f"{_API}: in_placements[{i}] must be placements for the DTensor argument there, "
            "got None."
        )
    want = normalize_placements(want, arg.device_mesh.ndim, arg.ndim, api=_API)
    if arg.placements == want:
        return arg
    if not redistribute:
        raise ValueError(
            f"{_API}: argument {i} must be laid out as {format_placements(want)} "
            f"(in_placements), got {format_placements(arg.placements)}. Redistribute it "
            "first or pass redistribute_inputs=True."
        )
    return arg.redistribute(placements=want)


def _wrap_outputs(out, out_placements, mesh):
    flat, spec = pytree.tree_flatten(out)
    per_output = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(per_output) != len(flat):
        raise ValueError(
            f"{_API}: out_placements must have one entry per flattened output ({len(flat)}), "
            f"got {len(per_output)}."
        )
    wrapped = []
    for i, (value, placements) in enumerate(zip(flat, per_output)):
        if isinstance(value, DTensor):
            raise TypeError(
                f"{_API}: the function must return plain tensors, got a DTensor as output "
                f"{i}. Call .to_local() on it inside the function."
            )
        if isinstance(value, torch.Tensor):
            wrapped.append(DTensor.from_local(value, mesh, placements))
        elif placements is not None:
            raise TypeError(
                f"{_API}: out_placements[{i}] must be None for the non-tensor output "
                f"{type(value).__name__} there, got {placements!r}."
            )
        else:
            wrapped.append(value)
    return pytree.tree_unflatten(wrapped, spec)
