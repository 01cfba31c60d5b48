"""Meshes derived from a mesh by unflattening a dim, and the concatenation of such meshes.

[Note: unflattened meshes] PyTorch's ``DeviceMesh._unflatten(dim, mesh_sizes,
mesh_dim_names)`` splits one mesh dim into several (torchtitan's ``ParallelDims`` builds
every mesh it uses from the world mesh this way, several times over). Here the result is a
mesh of its own (sliced and flattened by name like any root) that reports the mesh it came
from's root as its root (``_get_root_mesh``), as PyTorch's does, and shares that root's
resources. The dims that were not split keep their groups; the new dims' groups come from
the group cache, so unflattening the same world twice into the same sizes creates nothing
the second time.

Meshes of one root that are not slices of one mesh (a tensor-parallel dim from one
unflattening, a data-parallel dim from another) concatenate by index arithmetic on the
root's ranks: every mesh derived here is a linear map from coordinates to positions in the
root's rank list, so the concatenation's position for a coordinate is this rank's position
plus each dim's step from this rank's coordinate. The result holds the inputs' groups.
"""

from __future__ import annotations

import math

import torch

from device_mesh import groups as _groups
from device_mesh._override import normalize_backend_override


def check_dim_names(names, ndim: int, *, api: str) -> tuple[str, ...] | None:
    """``names`` as a tuple when it is one str per mesh dim, all different; None stays None."""
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{api}: mesh_dim_names must be a tuple of str, got {names!r}. "
            "Write e.g. mesh_dim_names=('dp', 'tp')."
        )
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(
            f"{api}: mesh_dim_names must have one name per mesh dim ({ndim}), got {names!r}."
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"{api}: mesh_dim_names must be unique, got {names!r} (repeated: {repeated}). "
            "Give every mesh dim its own name."
        )
    return names


def _check_sizes(mesh, dim: int, mesh_sizes, mesh_dim_names, *, api: str):
    sizes = (mesh_sizes,) if isinstance(mesh_sizes, int) else tuple(mesh_sizes)
    if not sizes or not all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes
    ):
        raise ValueError(f"{api}: mesh_sizes must be positive ints, got {mesh_sizes!r}.")
    if math.prod(sizes) != mesh.shape[dim]:
        raise ValueError(
            f"{api}: mesh_sizes {sizes} hold {math.prod(sizes)} ranks but mesh dim {dim} has "
            f"{mesh.shape[dim]}. Pick sizes whose product is {mesh.shape[dim]}."
        )
    names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else mesh_dim_names
    if names is None or len(tuple(names)) != len(sizes):
        raise ValueError(
            f"{api}: mesh_dim_names must give one name per entry of mesh_sizes {sizes}, got "
            f"{mesh_dim_names!r}."
        )
    return sizes, tuple(names)


def _dim_of(mesh, dim, *, api: str) -> int:
    if isinstance(dim, str) or (isinstance(dim, int) and not isinstance(dim, bool)):
        if isinstance(dim, int) and not 0 <= dim < mesh.ndim:
            raise ValueError(
                f"{api}: dim must be in [0, {mesh.ndim}) for {mesh!r}, got {dim}. Pass a mesh "
                "dim index or name."
            )
        return mesh._dim_index(dim, api=api)
    raise TypeError(f"{api}: dim must be an int or a mesh dim name, got {dim!r}.")


def unflatten(mesh, dim, mesh_sizes, mesh_dim_names, backend_override=None, *, create=True):
    """``mesh`` with mesh dim ``dim`` split into ``mesh_sizes`` named ``mesh_dim_names``
    ([Note: unflattened meshes]). Collective: every rank calls it, in the same order.
    ``create=False`` (unpickling) takes every group from the cache and makes none."""
    api = "DeviceMesh._unflatten"
    if mesh.mesh_dim_names is None:
        raise RuntimeError(
            f"{api}: {mesh!r} has no mesh_dim_names; build it with mesh_dim_names=(...)."
        )
    d = _dim_of(mesh, dim, api=api)
    sizes, new_names = _check_sizes(mesh, d, mesh_sizes, mesh_dim_names, api=api)
    names = mesh.mesh_dim_names[:d] + new_names + mesh.mesh_dim_names[d + 1 :]
    # names are checked (unique, str) before any group is made
    check_dim_names(names, len(names), api=api)
    overrides = normalize_backend_override(
        dict(backend_override) if backend_override is not None else None,
        len(sizes),
        new_names,
        mesh.device_type,
        api=api,
    )
    shape = mesh.shape[:d] + sizes + mesh.shape[d + 1 :]
    tensor = mesh.mesh.reshape(shape)
    backends = mesh._dim_backends[:d] + tuple(o or mesh._backend for o in overrides)
    backends += mesh._dim_backends[d + 1 :]
    out = type(mesh).__new__(type(mesh))
    out._init_root(mesh.device_type, mesh._backend, tensor, names)
    out._dim_backends = backends
    held = [None] * len(shape)
    for i in range(len(shape)):
        if d <= i < d + len(sizes):
            made = out._create_dim_groups(i) if create else out._cached_dim_group(i)
            held[i] = _groups.hold(made)
        else:
            held[i] = mesh._dim_groups[i if i < d else i - len(sizes) + 1]
    out._dim_groups = held
    out._family_root = mesh._get_root_mesh()
    out._origin = ("unflat", mesh, d, sizes, new_names, overrides)
    return out


def naming_root(mesh):
    """The mesh whose dim names ``mesh``'s names index: its root, or for a flattened mesh
    the root of the mesh it flattened."""
    if mesh._origin[0] == "flat":
        return naming_root(mesh._origin[1])
    return mesh._root


def concatenate_by_index(meshes, *, api: str):
    """One mesh over the dims of ``meshes``, which share a root but not a naming root
    ([Note: unflattened meshes]). No process group is created."""
    root = meshes[0]._get_root_mesh()
    strangers = [m for m in meshes if m._coordinate is None]
    if strangers:
        raise RuntimeError(
            f"{api}: rank {root.get_rank()} is not in {strangers[0]!r}; concatenate meshes "
            "only on ranks that belong to all of them."
        )
    position = {r: i for i, r in enumerate(root._flat_ranks)}
    me = position[root.get_rank()]
    steps, groups, backends, names = [], [], [], []
    for m in meshes:
        for d in range(m.ndim):
            along = [position[r] for r in m.ranks_along(d)]
            steps.append([p - along[m._coordinate[d]] for p in along])
            groups.append(m._dim_groups[d])
            backends.append(m._dim_backends[d])
            names.append(m.mesh_dim_names[d])
    grid = torch.full([len(s) for s in steps], me, dtype=torch.int64)
    for i, s in enumerate(steps):
        view = [1] * len(steps)
        view[i] = len(s)
        grid = grid + torch.tensor(s, dtype=torch.int64).view(view)
    flat = grid.reshape(-1).tolist()
    if len(set(flat)) != len(flat) or not all(0 <= p < len(position) for p in flat):
        listing = ", ".join(repr(m) for m in meshes)
        raise ValueError(
            f"{api}: the meshes {listing} overlap (they share a mesh dim's ranks), so they "
            "do not concatenate. Concatenate meshes over different dims of one root."
        )
    ranks = torch.tensor([root._flat_ranks[p] for p in flat]).view(grid.shape)
    out = type(root).__new__(type(root))
    out._init_root(root.device_type, root._backend, ranks, tuple(names))
    out._dim_backends = tuple(backends)
    out._dim_groups = groups
    out._family_root = root
    out._origin = ("concat", tuple(meshes))
    return out
