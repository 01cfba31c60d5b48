"""``backend_override``: the process-group backend of chosen mesh dims, as PyTorch spells it.

PyTorch's ``init_device_mesh``, ``DeviceMesh._unflatten`` and ``DeviceMesh._flatten`` take a
backend per mesh dim, keyed by index or name (torchtitan's ``ParallelDims`` gives its size-1
dims the ``"fake"`` backend, whose groups create no communicator). Here a mesh dim's groups
are made with the named backend when this machine can honour it for the mesh's device type,
and anything else is refused before any group is made, so every rank fails together.

[Note: honoured backends] ``"cpu"`` meshes take ``"gloo"`` (the default) and ``"fake"``;
``"cuda"`` meshes take ``"nccl"`` (the default) and ``"fake"``. A ``"fake"`` group moves no
data: a collective over it leaves every rank's tensor as it was, which is exact for a dim of
size 1 and a placeholder otherwise (PyTorch's meaning, which torchtitan relies on for dims it
never communicates over). Process-group options (``C10dBackend.Options``) are refused: a
group's timeout and options come from ``dist.init_process_group``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

_HONOURED = {"cpu": ("gloo", "fake"), "cuda": ("nccl", "fake")}


def _one(value, device_type: str, where: str, *, api: str) -> str | None:
    """The backend name one override value asks for (None: the mesh's default)."""
    original = value
    if isinstance(value, tuple):
        if len(value) != 2 or value[1] is not None:
            raise NotImplementedError(
                f"{api}: backend_override{where} = {original!r}: process-group options are "
                "not supported here. Pass the backend name alone (e.g. 'gloo' or 'fake') and "
                "set timeouts with dist.init_process_group(..., timeout=...)."
            )
        value = value[0]
    if value is None:
        return None
    if not isinstance(value, str):
        raise NotImplementedError(
            f"{api}: backend_override{where} = {original!r} ({type(original).__name__}) "
            "cannot be honoured: only a backend name is supported, e.g. 'fake'."
        )
    name = value.lower()
    honoured = _HONOURED.get(device_type, ())
    if name not in honoured:
        raise ValueError(
            f"{api}: backend_override{where} = {original!r} cannot be honoured for a "
            f"{device_type!r} mesh; use one of {list(honoured)}."
        )
    return name


def normalize_backend_override(
    override, ndim: int, names: Sequence[str] | None, device_type: str, *, api: str
) -> tuple[str | None, ...]:
    """One backend name (or None for the mesh's default) per mesh dim.

    ``override`` is PyTorch's dict keyed by mesh-dim index or name (``init_device_mesh``,
    ``_unflatten``) or a sequence with one entry per mesh dim (``DeviceMesh``); values are a
    backend name, ``(name, None)`` or None.

    Raises:
        ValueError: a key names no mesh dim, a dim is named twice (index and name), the
            sequence has the wrong length, or a backend cannot be honoured ([Note: honoured
            backends]).
        NotImplementedError: process-group options were given.

    Example:
        >>> normalize_backend_override({"pp": "fake"}, 2, ("pp", "tp"), "cpu", api="x")
        ('fake', None)
    """
    if override is None:
        return (None,) * ndim
    names = tuple(names or ())
    if isinstance(override, Mapping):
        return _from_mapping(dict(override), ndim, names, device_type, api=api)
    if isinstance(override, Sequence) and not isinstance(override, str):
        if len(override) != ndim:
            raise ValueError(
                f"{api}: backend_override must have one entry per mesh dim ({ndim}), got "
                f"{len(override)}: {override!r}."
            )
        return tuple(_one(v, device_type, f"[{i}]", api=api) for i, v in enumerate(override))
    raise TypeError(
        f"{api}: backend_override must be a dict keyed by mesh dim index or name, got "
        f"{override!r}. Write e.g. backend_override={{'pp': 'fake'}}."
    )


def _from_mapping(override: dict, ndim: int, names: tuple, device_type: str, *, api: str):
    out = []
    for i in range(ndim):
        name = names[i] if i < len(names) else None
        if name is not None and name in override and i in override:
            raise ValueError(
                f"{api}: backend_override names mesh dim {i} twice, as {i} and as {name!r}. "
                "Keep one key."
            )
        key = name if name is not None and name in override else i
        value = override.pop(key, None)
        out.append(_one(value, device_type, f"[{key!r}]", api=api))
    if override:
        raise ValueError(
            f"{api}: backend_override has unknown key(s) {list(override)}; keys are mesh dim "
            f"indices in [0, {ndim}) or names in {list(names)}."
        )
    return tuple(out)
