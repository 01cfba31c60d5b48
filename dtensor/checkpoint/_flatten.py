"""Nested state dicts <-> flat dotted keys, and non-tensor values <-> plain JSON.

``{"model": {"wq.weight": t}, "optim": {"state": {...}, "param_groups": [...]}}`` flattens to
``{"model.wq.weight": t, "optim.param_groups": [...], ...}``: dicts are walked, everything
else is a leaf. Each flat key remembers the path of original keys, so loading writes back
into the caller's own containers (integer keys of a native optimizer state dict included).

Non-tensor leaves are stored in the metadata as JSON. Values JSON cannot say exactly are
wrapped in one-key objects: tuples (``{"__tuple__": [...]}``), non-finite floats
(``{"__float__": "inf"}``) and dicts whose keys are not all strings (``{"__dict__": [[k, v],
...]}``). Anything else (a dtype, a module, an arbitrary object) is refused by name: no value
is ever pickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from dtensor.checkpoint.errors import CheckpointError

_MARKERS = ("__tuple__", "__float__", "__dict__")


def flatten(state_dict: Mapping) -> dict[str, tuple[tuple, Any]]:
    """Map each dotted key to ``(path, leaf)``, where ``path`` holds the original keys.

    Example::

        >>> flat = flatten({"model": {"w": 1}, "step": 3})
        >>> sorted(flat.items())
        [('model.w', (('model', 'w'), 1)), ('step', (('step',), 3))]
    """
    flat: dict[str, tuple[tuple, Any]] = {}
    _walk(state_dict, (), flat)
    return flat


def _walk(node: Mapping, path: tuple, flat: dict) -> None:
    for key, value in node.items():
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise CheckpointError(
                f"state dict key {key!r} at {_dotted(path) or 'the top level'} is a "
                f"{type(key).__name__}; keys must be str or int"
            )
        here = path + (key,)
        if isinstance(value, Mapping) and not isinstance(value, torch.Tensor):
            _walk(value, here, flat)
            continue
        name = _dotted(here)
        if name in flat:
            raise CheckpointError(
                f"two entries flatten to the same key {name!r}: {flat[name][0]!r} and {here!r}; "
                "rename one of them"
            )
        flat[name] = (here, value)


def _dotted(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def set_path(root: dict, path: tuple, value: Any) -> None:
    """Replace the leaf at ``path`` inside ``root`` (in place).

    Example::

        >>> sd = {"optim": {"param_groups": []}}
        >>> set_path(sd, ("optim", "param_groups"), [{"lr": 0.1}])
        >>> sd
        {'optim': {'param_groups': [{'lr': 0.1}]}}
    """
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def encode_value(key: str, value: Any) -> Any:
    """A plain-JSON form of a non-tensor leaf; refuses what JSON cannot hold.

    Example::

        >>> encode_value("g", {"betas": (0.9, 0.999), "max": float("inf")})
        {'betas': {'__tuple__': [0.9, 0.999]}, 'max': {'__float__': 'inf'}}
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(key, v) for v in value]}
    if isinstance(value, list):
        return [encode_value(key, v) for v in value]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and k not in _MARKERS for k in value):
            return {k: encode_value(key, v) for k, v in value.items()}
        return {
            "__dict__": [[encode_value(key, k), encode_value(key, v)] for k, v in value.items()]
        }
    if isinstance(value, torch.Tensor):
        raise CheckpointError(
            f"{key!r} holds a tensor inside a list or tuple; checkpoints store tensors only as "
            "dict values. Put it in a dict."
        )
    raise CheckpointError(
        f"{key!r} holds an object of type {type(value).__name__}, which a checkpoint cannot store (no pickle): "
        "use None, bool, int, float, str, or lists, tuples and dicts of those"
    )


def decode_value(value: Any) -> Any:
    """Undo :func:`encode_value`.

    Example::

        >>> decode_value({"__tuple__": [1, {"__float__": "-inf"}]})
        (1, -inf)
    """
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((marker, body),) = value.items()
            if marker == "__tuple__" and isinstance(body, list):
                return tuple(decode_value(v) for v in body)
            if marker == "__float__" and body in ("inf", "-inf", "nan"):
                return float(body)
            if marker == "__dict__" and isinstance(body, list):
                return {_hashable(decode_value(k)): decode_value(v) for k, v in _pairs(body)}
        return {k: decode_value(v) for k, v in value.items()}
    return value


def _pairs(body: list) -> list:
    if not all(isinstance(p, list) and len(p) == 2 for p in body):
        raise CheckpointError(
            "a '__dict__' value in the metadata is not a list of [key, value] pairs"
        )
    return body


def _hashable(key: Any) -> Any:
    if isinstance(key, list | dict):
        raise CheckpointError(f"a '__dict__' key in the metadata is a {type(key).__name__}")
    return key
