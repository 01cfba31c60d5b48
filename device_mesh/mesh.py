"""DeviceMesh: an n-D grid of ranks with named dims and one process group per mesh dim.

Vocabulary used across the project: a *mesh dim* is an axis of this grid (``"dp"``,
``"tp"``), never an axis of a tensor. Along mesh dim ``d`` every rank belongs to exactly one
1-D slice of the grid; the process group of that slice is what collectives over ``d`` use.

[Note: groups are created for every slice, on every rank]
``torch.distributed.new_group`` is collective over the default group: all ranks must call it
for every group, in the same order, including groups they are not members of. A mesh
therefore walks all slices of each mesh dim (not only its own) when it is built, through the
cache in ``device_mesh.groups``; slicing a mesh by name reuses those groups and creates none.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from device_mesh import _derive
from device_mesh import groups as _groups
from device_mesh._derive import check_dim_names as _check_dim_names
from device_mesh._override import normalize_backend_override
from device_mesh._pickle import allow_in_weights_only_load
from device_mesh.resources import MeshResources

logger = logging.getLogger(__name__)


class DeviceMesh:
    """An n-D mesh of ranks with optional names, over which collectives run per mesh dim.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
        mesh: the global ranks, as a tensor or nested list, one entry per grid cell. Its
            number of entries must equal the world size and every rank appears once.
        mesh_dim_names: one name per mesh dim, e.g. ``("dp", "tp")``.
        backend_override: the backend of some mesh dims' groups, one entry per mesh dim
            (None for the default) or a dict keyed by dim index or name; ``"fake"`` is
            honoured besides the device's own ([Note: honoured backends] in
            ``_override.py``).

    Raises:
        ValueError: the mesh size differs from the world size, a rank repeats or is out of
            range, the names are missing, repeated or of the wrong number, or a
            backend_override cannot be honoured.

    Example:
        >>> mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        >>> mesh["tp"].get_group()        # the process group of this rank's row
        >>> mesh.get_coordinate()         # (1, 0) on rank 2
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
        backend_override=None,
    ) -> None:
        backend = _groups.backend_for(device_type)
        mesh_tensor = _as_mesh_tensor(mesh)
        names = _check_dim_names(mesh_dim_names, mesh_tensor.ndim, api="DeviceMesh")
        overrides = normalize_backend_override(
            backend_override, mesh_tensor.ndim, names, device_type, api="DeviceMesh"
        )
        _groups.ensure_default_group(device_type)
        _check_ranks(mesh_tensor, dist.get_world_size())
        self._init_root(device_type, backend, mesh_tensor, names, overrides)
        # held weakly: [Note: weak group references] in groups.py
        self._dim_groups = [_groups.hold(self._create_dim_groups(d)) for d in range(self.ndim)]
        logger.info("built %r", self)

    def _init_root(self, device_type, backend, mesh_tensor, names, overrides=None) -> None:
        self._init(device_type, backend, mesh_tensor, names)
        overrides = tuple(overrides or (None,) * mesh_tensor.ndim)
        self._dim_backends = tuple(b or backend for b in overrides)
        self._root: DeviceMesh = self
        self._dims: tuple[tuple[int, ...], ...] = tuple((d,) for d in range(mesh_tensor.ndim))
        self._flattened: dict[str, DeviceMesh] = {}
        self._origin = ("root", device_type, mesh_tensor.tolist(), names)
        if any(b is not None for b in overrides):
            self._origin += (overrides,)

    # ----------------------------------------------------------------------------- building
    def _init(self, device_type, backend, mesh_tensor, names) -> None:
        self._device_type = device_type
        self._backend = backend
        self._mesh = mesh_tensor
        # Plain-Python copies of the layout: what the accessors below read, so that none of
        # them runs a tensor op (they are called while torch.compile traces with fake tensors).
        self._shape = tuple(mesh_tensor.shape)
        self._flat_ranks = tuple(mesh_tensor.reshape(-1).tolist())
        self._dim_names = names
        self._rank = dist.get_rank()
        coord = (mesh_tensor == self._rank).nonzero()
        self._coordinate = tuple(int(c) for c in coord[0]) if len(coord) else None
        self._identity = (device_type, self._shape, self._flat_ranks, names)

    def _create_dim_groups(self, mesh_dim: int):
        """Create (or fetch) the groups of every slice along ``mesh_dim``; return this rank's."""
        size = self._mesh.size(mesh_dim)
        slices = self._mesh.movedim(mesh_dim, -1).reshape(-1, size)
        mine = None
        for row in slices.tolist():
            group = _groups.get_group(tuple(row), self._dim_backends[mesh_dim])
            if self._rank in row:
                mine = group
        return mine

    def _cached_dim_group(self, mesh_dim: int):
        """This rank's group along ``mesh_dim`` from the cache (None off the mesh)."""
        if self._coordinate is None:
            return None
        ranks = self.ranks_along(mesh_dim)
        return _groups.get_group(tuple(ranks), self._dim_backends[mesh_dim], create=False)

    @classmethod
    def from_group(
        cls,
        group,
        device_type: str,
        mesh: torch.Tensor | Sequence | None = None,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
    ) -> DeviceMesh:
        """A mesh over existing process groups (no group is created).

        One group gives a 1-D mesh over its ranks (``mesh`` optional). A list of groups gives
        a mesh with one dim per group; then ``mesh`` (the global ranks) is required and group
        ``d`` must be this rank's slice along mesh dim ``d``.

        Raises:
            ValueError: the groups do not match ``mesh``, or ``mesh`` is missing for a list.

        Example:
            >>> pg = dist.new_group([0, 1])                  # every rank calls new_group
            >>> stage = DeviceMesh.from_group(pg, "cpu")     # on ranks 0 and 1
        """
        api = "DeviceMesh.from_group"
        backend = _groups.backend_for(device_type, api=api)
        groups = list(group) if isinstance(group, (list, tuple)) else [group]
        if mesh is None:
            if len(groups) != 1:
                raise ValueError(
                    f"{api}: mesh is required with {len(groups)} groups, got None. Pass the "
                    "global ranks, e.g. mesh=torch.arange(4).view(2, 2)."
                )
            mesh = dist.get_process_group_ranks(groups[0])
        mesh_tensor = _as_mesh_tensor(mesh)
        names = _check_dim_names(mesh_dim_names, mesh_tensor.ndim, api=api)
        _check_ranks(mesh_tensor, dist.get_world_size())
        if len(groups) != mesh_tensor.ndim:
            raise ValueError(
                f"{api}: one group per mesh dim ({mesh_tensor.ndim}) is needed, got "
                f"{len(groups)} group(s)."
            )
        out = cls.__new__(cls)
        out._init_root(device_type, backend, mesh_tensor, names)
        out._dim_backends = tuple(_groups.backend_of(g, backend) for g in groups)
        for d, g in enumerate(groups):
            ranks = dist.get_process_group_ranks(g)
            if out._coordinate is not None and sorted(ranks) != sorted(out.ranks_along(d)):
                raise ValueError(
                    f"{api}: group {d} holds ranks {ranks} but this rank's slice of mesh dim "
                    f"{d} is {out.ranks_along(d)}. Pass the groups in mesh-dim order."
                )
            _groups.register_group(g, out._dim_backends[d])
        out._dim_groups = [_groups.hold(g) for g in groups]
        return out

    @classmethod
    def _view(
        cls, root: DeviceMesh, mesh_tensor, names, dims, dim_groups, backends=None
    ) -> DeviceMesh:
        """A sub-mesh of ``root`` sharing its groups (no group is created). ``dims[i]`` are
        the root dims mesh dim ``i`` spans (several for a flattened dim)."""
        sub = cls.__new__(cls)
        sub._init(root._device_type, root._backend, mesh_tensor, names)
        sub._dim_backends = tuple(backends or (root._backend,) * len(dims))
        sub._root = root
        sub._dims = tuple(dims)
        sub._flattened = {}
        sub._dim_groups = list(dim_groups)
        sub._origin = ("slice", root, names)
        return sub

    @property
    def _root_dims(self) -> tuple[int, ...]:
        """Every root dim this mesh spans, in order."""
        return tuple(d for dims in self._dims for d in dims)

    # ----------------------------------------------------------------------------- queries
    @property
    def device_type(self) -> str:
        """The device type, ``"cpu"`` or ``"cuda"``."""
        return self._device_type

    @property
    def mesh(self) -> torch.Tensor:
        """The global ranks as an int64 tensor of shape ``self.shape``."""
        return self._mesh

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """The names of the mesh dims, or None."""
        return self._dim_names

    @property
    def ndim(self) -> int:
        """Number of mesh dims."""
        return len(self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of every mesh dim."""
        return self._shape

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim``.

        Example:
            >>> init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).size("tp")
            2
        """
        if mesh_dim is None:
            return len(self._flat_ranks)
        return self._shape[self._dim_index(mesh_dim, api="DeviceMesh.size")]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along every mesh dim, or None if it is not in the mesh.

        Example:
            >>> init_device_mesh("cpu", (2, 2)).get_coordinate()   # (1, 0) on rank 2
        """
        return self._coordinate

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (required when the mesh has several dims).

        Example:
            >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            >>> mesh.get_local_rank("tp")   # 1 on ranks 1 and 3
        """
        d = self._dim_or_only(mesh_dim, api="DeviceMesh.get_local_rank")
        if self._coordinate is None:
            raise RuntimeError(
                f"DeviceMesh.get_local_rank: rank {self._rank} is not in {self!r}; only "
                "member ranks have a local rank."
            )
        return self._coordinate[d]

    def get_group(self, mesh_dim: int | str | None = None):
        """The process group of this rank's slice along ``mesh_dim``.

        Example:
            >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            >>> dist.all_reduce(t, group=mesh.get_group("tp"))   # sums over this rank's row
        """
        held = self._dim_groups[self._dim_or_only(mesh_dim, api="DeviceMesh.get_group")]
        if self._coordinate is None:
            raise RuntimeError(
                f"DeviceMesh.get_group: rank {self._rank} is not in {self!r}; only member "
                "ranks have its process groups."
            )
        return _groups.resolve(held, api="DeviceMesh.get_group")

    def get_all_groups(self) -> list:
        """The process group of every mesh dim, in mesh-dim order."""
        return [_groups.resolve(h, api="DeviceMesh.get_all_groups") for h in self._dim_groups]

    def ranks_along(self, mesh_dim: int | str) -> list[int]:
        """Global ranks of this rank's slice along ``mesh_dim``, in mesh order.

        Example:
            >>> init_device_mesh("cpu", (2, 2)).ranks_along(1)   # [2, 3] on rank 2
        """
        d = self._dim_index(mesh_dim, api="DeviceMesh.ranks_along")
        if self._coordinate is None:
            raise RuntimeError(f"DeviceMesh.ranks_along: rank {self._rank} is not in {self!r}.")
        step = math.prod(self._shape[d + 1 :])
        start = sum(c * math.prod(self._shape[i + 1 :]) for i, c in enumerate(self._coordinate))
        start -= self._coordinate[d] * step
        return [self._flat_ranks[start + k * step] for k in range(self._shape[d])]

    # ----------------------------------------------------------------------------- slicing
    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """Sub-mesh over the named mesh dims (in mesh order); no process group is created.

        Names may mix this mesh's dims and dims flattened from its root (``_flatten``), as
        recipes do for HSDP over a flattened shard dim.

        Example:
            >>> mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "fs", "cp"))
            >>> mesh["fs", "cp"]._flatten("fs_cp")
            >>> mesh["dp", "fs_cp"].shape
            (2, 2)
        """
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if len(wanted) == 1 and wanted[0] in self._root._flattened:
            if self._dim_names is None or wanted[0] not in self._dim_names:
                return self._root._flattened[wanted[0]]
        parts = self._resolve_slice(wanted)
        if [dims for dims, _, _ in parts] == list(self._dims):
            return self
        if self._coordinate is None:
            raise RuntimeError(
                f"DeviceMesh.__getitem__: rank {self._rank} is not in {self!r}, so it has no "
                "slice of it. Slice the mesh only on its member ranks."
            )
        root = self._root
        selected = [d for dims, _, _ in parts for d in dims]
        others = [d for d in range(root.ndim) if d not in selected]
        coord = root.get_coordinate()
        ranks = root._mesh.permute(*others, *selected)[tuple(coord[d] for d in others)]
        shape = [math.prod(root.shape[d] for d in dims) for dims, _, _ in parts]
        return DeviceMesh._view(
            root,
            ranks.reshape(shape),
            wanted,
            [dims for dims, _, _ in parts],
            [group for _, group, _ in parts],
            [backend for _, _, backend in parts],
        )

    def _resolve_slice(self, wanted: tuple) -> list[tuple[tuple[int, ...], object, str]]:
        """``(root dims, process group, backend)`` for every wanted name, validated."""
        api = "DeviceMesh.__getitem__"
        if self._dim_names is None:
            raise RuntimeError(
                f"{api}: this mesh has no mesh_dim_names, so it cannot be sliced by name. "
                "Pass mesh_dim_names=... when building it."
            )
        if not wanted or not all(isinstance(n, str) for n in wanted):
            raise TypeError(
                f"{api}: mesh dim names must be one or more str, got {wanted!r}. "
                f"Valid names: {self._dim_names}."
            )
        flats = {
            name: flat
            for name, flat in self._root._flattened.items()
            if set(flat._flat_of) <= set(self._root_dims)
        }
        unknown = [n for n in wanted if n not in self._dim_names and n not in flats]
        if unknown:
            valid = list(self._dim_names) + sorted(flats)
            raise ValueError(f"{api}: unknown mesh dim name(s) {unknown!r}. Valid names: {valid}.")
        repeated = sorted({n for n in wanted if wanted.count(n) > 1})
        if repeated:
            raise ValueError(
                f"{api}: mesh dim name(s) {repeated!r} repeated in {wanted!r}. "
                "Name each mesh dim once."
            )
        parts = []
        for n in wanted:
            if n in self._dim_names:
                d = self._dim_names.index(n)
                parts.append((self._dims[d], self._dim_groups[d], self._dim_backends[d]))
            else:
                flat = flats[n]
                parts.append((flat._flat_of, flat._dim_groups[0], flat._dim_backends[0]))
        selected = [d for dims, _, _ in parts for d in dims]
        if selected != sorted(set(selected)):
            in_order = tuple(n for n in self._dim_names if n in wanted)
            hint = f" Use mesh[{in_order!r}] instead." if len(in_order) == len(wanted) else ""
            raise ValueError(
                f"{api}: mesh dim names must be in mesh order {self._dim_names} and cover "
                f"each dim once, got {wanted!r}.{hint}"
            )
        return parts

    def flatten(self, name: str | None = None) -> DeviceMesh:
        """A 1-D mesh over all ranks of this mesh, row-major; its groups are created once.

        The result can later be fetched from the root mesh by name: ``root[name]``.

        Example:
            >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            >>> mesh.flatten("dp_tp").size()
            4
        """
        return self._flatten_with(name, None)

    def _flatten_with(self, name: str | None, backend: str | None) -> DeviceMesh:
        """``flatten(name)`` whose groups use ``backend`` (None: the mesh's)."""
        if self.ndim == 1 and (name is None or name == (self._dim_names or (None,))[0]):
            return self
        if name is None:
            name = "_".join(self._dim_names) if self._dim_names else None
        root = self._root
        if name is not None:
            if not isinstance(name, str):
                raise TypeError(f"DeviceMesh.flatten: name must be a str, got {name!r}.")
            if name in root._flattened:
                cached = root._flattened[name]
                if cached._flat_of == self._root_dims:
                    return cached
                raise ValueError(
                    f"DeviceMesh.flatten: name {name!r} already names a flattening of other "
                    "mesh dims. Choose another name."
                )
            if root._dim_names and name in root._dim_names:
                raise ValueError(
                    f"DeviceMesh.flatten: name {name!r} is already a mesh dim name of "
                    f"{root!r}. Choose another name."
                )
        flat = self._build_flat(name, backend=backend)
        if name is not None:
            root._flattened[name] = flat
        return flat

    def _flatten(self, mesh_dim_name: str | None = None, backend_override=None) -> DeviceMesh:
        """PyTorch's spelling of ``flatten`` (recipes call it): the same mesh, same cache.

        ``backend_override`` (a backend name, or ``(name, None)``) makes the flattened dim's
        groups with that backend, ``"fake"`` or the device's own ([Note: honoured backends]
        in ``_override.py``); anything else raises before any group is made.

        Example:
            >>> mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
            >>> mesh["dp", "cp"]._flatten("dp_cp").size()
            2
        """
        api = "DeviceMesh._flatten"
        (backend,) = normalize_backend_override(
            [backend_override], 1, None, self._device_type, api=api
        )
        if self._dim_names is None:
            raise RuntimeError(
                f"{api}: this mesh has no mesh_dim_names; pass mesh_dim_names "
                "when building it, or call flatten(name) instead."
            )
        return self._flatten_with(mesh_dim_name or None, backend)

    def _unflatten(
        self,
        dim: int | str,
        mesh_sizes: tuple[int, ...],
        mesh_dim_names: tuple[str, ...],
        backend_override: dict | None = None,
    ) -> DeviceMesh:
        """This mesh with mesh dim ``dim`` split into dims of ``mesh_sizes`` named
        ``mesh_dim_names`` (PyTorch's private API, which torchtitan's ``ParallelDims`` builds
        its meshes with). The result reports this mesh's root as its root and can be sliced,
        flattened and concatenated with other meshes of that root ([Note: unflattened
        meshes] in ``_derive.py``). Collective: every rank calls it.

        ``backend_override`` maps new dims (index among them, or name) to a backend name:
        ``"fake"`` or the device's own ([Note: honoured backends] in ``_override.py``).

        Raises:
            ValueError: ``dim`` names no dim, the sizes do not multiply to its size, the
                names are wrong or clash, or a backend cannot be honoured.

        Example:
            >>> world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
            >>> m = world._unflatten(0, (2, 2), ("dp", "tp"), backend_override={"dp": "fake"})
            >>> m["tp"].ranks_along(0), m._get_root_mesh() is world   # on rank 2
            ([2, 3], True)
        """
        return _derive.unflatten(self, dim, mesh_sizes, mesh_dim_names, backend_override)

    def _build_flat(
        self, name: str | None, *, create: bool = True, backend: str | None = None
    ) -> DeviceMesh:
        backend = backend or self._backend
        root = self._root
        others = [d for d in range(root.ndim) if d not in self._root_dims]
        rows = root._mesh.permute(*others, *self._root_dims).reshape(-1, self.size())
        mine = None
        for row in rows.tolist():
            if not create and self._rank not in row:
                continue
            group = _groups.get_group(tuple(row), backend, create=create)
            if self._rank in row:
                mine = group
        flat_ranks = self._mesh.reshape(-1)
        names = None if name is None else (name,)
        flat = DeviceMesh._view(root, flat_ranks, names, [()], [_groups.hold(mine)], [backend])
        flat._root = flat
        flat._dims = ((0,),)
        flat._flat_of = self._root_dims
        flat._origin = (
            ("flat", self, name) if backend == self._backend else ("flat", self, name, backend)
        )
        # Slicing the root by the flat name must find this mesh.
        flat._flattened = root._flattened
        return flat

    # ----------------------------------------------------------------------------- helpers
    def _dim_index(self, mesh_dim: int | str, *, api: str) -> int:
        if isinstance(mesh_dim, str):
            if self._dim_names is None or mesh_dim not in self._dim_names:
                raise ValueError(
                    f"{api}: unknown mesh dim name {mesh_dim!r}. Valid names: "
                    f"{list(self._dim_names or [])} (or an int below {self.ndim})."
                )
            return self._dim_names.index(mesh_dim)
        if isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool):
            if -self.ndim <= mesh_dim < self.ndim:
                return mesh_dim % self.ndim
            raise ValueError(
                f"{api}: mesh_dim must be in [{-self.ndim}, {self.ndim}), got {mesh_dim}. "
                f"The mesh has shape {self.shape}."
            )
        raise TypeError(f"{api}: mesh_dim must be an int or a str, got {mesh_dim!r}.")

    def _dim_or_only(self, mesh_dim, *, api: str) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"{api}: mesh_dim is required on a {self.ndim}-D mesh {self!r}, got None. "
                    f"Pass one of {list(self._dim_names or range(self.ndim))}."
                )
            return 0
        return self._dim_index(mesh_dim, api=api)

    def _key(self):
        return self._identity

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self._dim_names}" if self._dim_names else ""
        return f"DeviceMesh({self._device_type!r}, {_nested(self._flat_ranks, self._shape)}{names})"

    @staticmethod
    def _concatenate(meshes) -> DeviceMesh:
        """One mesh over the dims of several slices of one root mesh, in root order (the
        mesh a 2-D FSDP + tensor-parallel parameter lives on). No process group is created.

        Meshes converted from PyTorch's that share a PyTorch root concatenate as PyTorch's
        do, in any order ([Note: converted mesh families] in ``_interop.py``): the conversion
        leaves that concatenation on the root it makes (``_family_concatenate``), so this
        module, which ``_interop`` builds on, needs no import of it.

        Raises:
            ValueError: a mesh has no dim names, the meshes come from different roots, or
                their dims overlap or are out of root order.

        Example:
            >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            >>> DeviceMesh._concatenate([mesh["dp"], mesh["tp"]]) == mesh
            True
        """
        api = "DeviceMesh._concatenate"
        roots = [m._get_root_mesh() for m in meshes]
        joins = [r.__dict__.get("_family_concatenate") for r in roots]
        join = next((j for j in joins if j is not None), None)
        if join is not None:  # a converted family's ([Note: converted mesh families])
            return join(meshes)
        if any(r != roots[0] for r in roots[1:]):
            listing = ", ".join(repr(m) for m in meshes)
            raise ValueError(
                f"{api}: the meshes {listing} are not slices of one root mesh. Build one mesh "
                "with init_device_mesh(..., mesh_dim_names=(...)) and slice every part from it."
            )
        unnamed = [m for m in meshes if m.mesh_dim_names is None]
        if unnamed:
            raise ValueError(
                f"{api}: mesh {unnamed[0]!r} has no mesh_dim_names; slice it by name from a "
                "root mesh built with mesh_dim_names."
            )
        names = tuple(n for m in meshes for n in m.mesh_dim_names)
        naming = [_derive.naming_root(m) for m in meshes]
        if any(r is not naming[0] for r in naming[1:]):  # [Note: unflattened meshes]
            return _derive.concatenate_by_index(meshes, api=api)
        return naming[0][names]

    def _get_root_mesh(self) -> DeviceMesh:
        """The mesh this one was sliced or flattened from (itself for a root). A mesh
        converted from PyTorch's answers the conversion of the PyTorch root ([Note: converted
        mesh families] in ``_interop.py``).

        Example:
            >>> mesh["tp"]._get_root_mesh() is mesh
            True
        """
        if self._origin[0] == "flat":
            return self._origin[1]._get_root_mesh()
        return self._root.__dict__.get("_family_root", self._root)

    @functools.cached_property
    def resources(self) -> MeshResources:
        """The runtime state that the layers above keep with this mesh, one
        ``MeshResources`` per root: slices and flattened meshes share their root's ([Note:
        mesh resources] in ``device_mesh/resources.py``). dtensor keeps its dispatch caches
        and collective workspaces here. A copy is the mesh itself, and a pickle is a
        description, so neither carries them.

        Example:
            >>> mesh["tp"].resources is mesh.resources
            True
            >>> class Seen(set): ...               # a class of the layer above
            >>> mesh.resources.get(Seen).add("step 1")
        """
        # Looked up on this mesh object once (dtensor's op dispatch asks on every op); after
        # that the answer is in the object's __dict__, read as a plain attribute.
        root = self._get_root_mesh()
        if root is not self:
            return root.resources
        # setdefault: one per root even when two threads ask first at once
        return self.__dict__.setdefault("resources", MeshResources())

    # ----------------------------------------------------------------------------- copies
    def __copy__(self) -> DeviceMesh:
        return self  # meshes are immutable and hold process groups: copies share them

    def __deepcopy__(self, memo) -> DeviceMesh:
        return self

    def __reduce__(self):
        """Pickle as a description (device type, ranks, names, how it was sliced or
        flattened); unpickling rebuilds it from this process's cached groups, creating none.

        Example:
            >>> pickle.loads(pickle.dumps(mesh["tp"])) == mesh["tp"]
            True
        """
        return (_rebuild_mesh, (_describe(self),))


def _describe(mesh: DeviceMesh) -> tuple:
    """A picklable description of ``mesh``: nested tuples of str, int and lists."""
    kind = mesh._origin[0]
    if kind == "root":
        return mesh._origin
    if kind == "slice":
        _, root, names = mesh._origin
        flats = tuple(
            (n, root._flattened[n]._flat_of, root._flattened[n]._dim_backends[0])
            for n in names
            if n in root._flattened and (root._dim_names is None or n not in root._dim_names)
        )
        return ("slice", _describe(root), names, flats)
    if kind == "unflat":
        return ("unflat", _describe(mesh._origin[1]), *mesh._origin[2:])
    if kind == "concat":
        return ("concat", tuple(_describe(m) for m in mesh._origin[1]))
    return ("flat", _describe(mesh._origin[1]), *mesh._origin[2:])


def _rebuild_root(description: tuple) -> DeviceMesh:
    device_type, ranks, names, *overrides = description[1:]
    mesh = DeviceMesh.__new__(DeviceMesh)
    backend = _groups.backend_for(device_type)
    mesh._init_root(device_type, backend, _as_mesh_tensor(ranks), names, *overrides)
    mesh._dim_groups = [_groups.hold(mesh._cached_dim_group(d)) for d in range(mesh.ndim)]
    return mesh


def _rebuild_flat(description: tuple) -> DeviceMesh:
    _, source, name, *backend = description
    source = _rebuild_mesh(source)
    if name is not None and name in source._root._flattened:
        return source._root._flattened[name]
    flat = source._build_flat(name, create=False, backend=(backend or [None])[0])
    if name is not None:
        source._root._flattened[name] = flat
    return flat


def _rebuild_mesh(description: tuple) -> DeviceMesh:
    """Inverse of ``_describe``: the mesh again, from the process groups this process has
    cached (a missing group is an error, never a new collective)."""
    kind = description[0]
    try:
        if kind == "root":
            return _rebuild_root(description)
        if kind == "slice":
            _, root_description, names, flats = description
            root = _rebuild_mesh(root_description)
            for name, dims, backend in flats:
                if name not in root._flattened:
                    source = root[tuple(root._dim_names[d] for d in dims)]
                    flat = source._build_flat(name, create=False, backend=backend)
                    root._flattened[name] = flat
            return root[names]
        if kind == "unflat":
            _, source, dim, sizes, names, overrides = description
            override = {i: b for i, b in enumerate(overrides) if b is not None}
            source = _rebuild_mesh(source)
            return _derive.unflatten(source, dim, sizes, names, override, create=False)
        if kind == "concat":
            return DeviceMesh._concatenate([_rebuild_mesh(d) for d in description[1]])
        return _rebuild_flat(description)
    except LookupError as e:
        raise RuntimeError(
            f"DeviceMesh: cannot unpickle {description!r} in this process: {e}. A mesh is "
            "rebuilt from the process groups this process already has; build the same mesh "
            "with init_device_mesh (on every rank) before unpickling."
        ) from None


def _nested(flat: tuple[int, ...], shape: tuple[int, ...]) -> list:
    """``flat`` laid out as nested lists of ``shape`` (what ``tensor.tolist()`` prints)."""
    if len(shape) == 1:
        return list(flat)
    n = len(flat) // shape[0]
    return [_nested(flat[i * n : (i + 1) * n], shape[1:]) for i in range(shape[0])]


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    backend_override: dict | None = None,
) -> DeviceMesh:
    """Build a mesh of ``mesh_shape`` over all ranks, row-major (rank r at cell r).

    Initializes the default process group from the environment (``torchrun``) if needed.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
        mesh_shape: size of every mesh dim; the product must equal the world size.
        mesh_dim_names: one unique name per mesh dim.
        backend_override: ``{dim index or name: backend}`` for the dims whose groups use
            another backend than the device's: ``"fake"`` (groups that move no data), or the
            device's own ([Note: honoured backends] in ``_override.py``).

    Raises:
        ValueError: the product of ``mesh_shape`` differs from the world size, a size is not
            positive, the names are wrong, or a backend_override cannot be honoured.

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> mesh["tp"].size()
        2
    """
    api = "init_device_mesh"
    _groups.backend_for(device_type, api=api)
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    shape = tuple(mesh_shape)
    if not shape or not all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape
    ):
        raise ValueError(
            f"{api}: mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape!r}."
        )
    _check_dim_names(mesh_dim_names, len(shape), api=api)
    overrides = normalize_backend_override(
        None if backend_override is None else dict(backend_override),
        len(shape),
        mesh_dim_names,
        device_type,
        api=api,
    )
    _groups.ensure_default_group(device_type)
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(
            f"{api}: mesh_shape {shape} holds {math.prod(shape)} ranks but the world size is "
            f"{world}. Pick a mesh_shape whose product is {world}."
        )
    return DeviceMesh(
        device_type,
        torch.arange(world).view(shape),
        mesh_dim_names=mesh_dim_names,
        backend_override=overrides,
    )


# --------------------------------------------------------------------------- validation
def _as_mesh_tensor(mesh) -> torch.Tensor:
    try:
        t = mesh.detach().cpu() if isinstance(mesh, torch.Tensor) else torch.tensor(mesh)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"DeviceMesh: mesh must be a tensor or nested list of ints, got {mesh!r} ({e})."
        ) from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"DeviceMesh: mesh must hold integer ranks, got dtype {t.dtype}.")
    if t.ndim == 0 or t.numel() == 0:
        raise ValueError(
            f"DeviceMesh: mesh must have at least one dim and one rank, got {t.tolist()!r}."
        )
    return t.to(torch.int64).contiguous()


def _check_ranks(mesh: torch.Tensor, world: int) -> None:
    flat = mesh.reshape(-1).tolist()
    dupes = sorted({r for r in flat if flat.count(r) > 1})
    if dupes:
        raise ValueError(
            f"DeviceMesh: mesh must list every rank once, got duplicate rank(s) {dupes} in "
            f"{mesh.tolist()}. Give each rank exactly one cell."
        )
    if len(flat) > world:
        raise ValueError(
            f"DeviceMesh: mesh_shape {tuple(mesh.shape)} holds {len(flat)} ranks but the "
            f"world size is {world}. Use a mesh of at most {world} ranks."
        )
    bad = [r for r in flat if not 0 <= r < world]
    if bad:
        raise ValueError(
            f"DeviceMesh: mesh ranks must lie in [0, {world}), got {bad}. Use ranks 0..{world - 1}."
        )
    # A process group orders its members by global rank; collectives rely on that order
    # matching the mesh coordinate, so every slice must list its ranks in increasing order.
    for d in range(mesh.ndim):
        rows = mesh.movedim(d, -1).reshape(-1, mesh.size(d))
        for row in rows.tolist():
            if row != sorted(row):
                raise NotImplementedError(
                    f"DeviceMesh: ranks along mesh dim {d} must increase, got slice {row} in "
                    f"{mesh.tolist()}. Reorder the mesh so that every slice is ascending "
                    "(a transposed arange, e.g. torch.arange(n).view(a, b).T, is fine)."
                )


def concatenate_meshes(meshes) -> DeviceMesh:
    """One mesh over the dims of several slices of one root mesh, in root order: the public
    name of ``DeviceMesh._concatenate`` (PyTorch's private spelling, kept for ports), for
    code built on this package such as fsdp2's 2-D parameters.

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> concatenate_meshes([mesh["dp"], mesh["tp"]]) == mesh
        True
    """
    return DeviceMesh._concatenate(meshes)


# torch.load(weights_only=True) may rebuild a mesh (from this process's groups only)
allow_in_weights_only_load(DeviceMesh, _rebuild_mesh)
