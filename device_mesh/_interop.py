"""Accepting PyTorch's own ``DeviceMesh`` where ours is expected.

Recipes written for ``torch.distributed`` port by changing imports, but a half-ported script
(or a library that builds its own meshes, as torchtitan's ``ParallelDims`` does) may still
hand us a ``torch.distributed.device_mesh.DeviceMesh``. Its process groups are real
``torch.distributed`` groups, the same kind ours are, so it converts without creating any
group. Anything else is refused with a message that names the object's module and the
import to use instead.

[Note: converted mesh families] PyTorch derives meshes from one root by slicing,
flattening, unflattening and concatenating; all of them index the root's ranks, so any two
can be concatenated into the 2-D mesh of an FSDP + tensor-parallel parameter. Converting
each PyTorch mesh on its own gave unrelated roots of ours, and ``fully_shard`` then refused
a tensor-parallel parameter ("not slices of one root mesh"). So the conversions of one
PyTorch root form a *family*, kept on that root (``_TorchFamily``): the same PyTorch mesh
always converts to the same mesh of ours, every member reports the conversion of the
PyTorch root as its root (``DeviceMesh._get_root_mesh``), and concatenating members is
PyTorch's own layout arithmetic on their sources, converted back (``concatenate``). No
process group is created on the way: every group comes from the PyTorch meshes.
"""

from __future__ import annotations

import sys

from device_mesh.mesh import DeviceMesh

# the attribute of a PyTorch root mesh that holds its family ([Note: converted mesh families])
_FAMILY_ATTR = "_fsdp2_lite_family"


def qualified_name(obj) -> str:
    """``module.Class`` of ``obj``, for errors that must tell look-alike classes apart."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_torch_device_mesh(obj) -> bool:
    """Whether ``obj`` is PyTorch's ``DeviceMesh`` (or a subclass of it).

    Example:
        >>> is_torch_device_mesh(init_device_mesh("cpu", (2,)))   # ours
        False
    """
    module = sys.modules.get("torch.distributed.device_mesh")
    torch_mesh = getattr(module, "DeviceMesh", None)
    # a port that rebinds PyTorch's name to ours must not make ours look like PyTorch's
    return (
        isinstance(torch_mesh, type)
        and torch_mesh.__module__.startswith("torch.")
        and isinstance(obj, torch_mesh)
    )


def describe_mesh(mesh) -> str:
    """``repr(mesh)`` and the library it comes from, for errors about mixed meshes (ours and
    PyTorch's print alike).

    Example:
        >>> describe_mesh(init_device_mesh("cpu", (2,)))
        "DeviceMesh('cpu', [0, 1]) (ours: device_mesh.DeviceMesh)"
    """
    if is_torch_device_mesh(mesh):
        return f"{mesh!r} (PyTorch's: {qualified_name(mesh)})"
    source = torch_source(mesh) if isinstance(mesh, DeviceMesh) else None
    if source is not None:
        return f"{mesh!r} (ours, converted from PyTorch's {source!r})"
    if isinstance(mesh, DeviceMesh):
        return f"{mesh!r} (ours: device_mesh.DeviceMesh)"
    return f"{mesh!r} ({qualified_name(mesh)})"


class _TorchFamily:
    """Our meshes for one PyTorch root mesh and the meshes derived from it.

    ``members`` maps each converted PyTorch mesh (PyTorch meshes hash and compare by
    layout) to ours; ``root`` is the conversion of the PyTorch root. A copy or a pickle of
    the PyTorch root carries an empty family: conversions hold process groups.
    """

    def __init__(self) -> None:
        self.root: DeviceMesh | None = None
        self.members: dict = {}

    def __reduce__(self):
        return (_TorchFamily, ())

    def __deepcopy__(self, memo):
        return _TorchFamily()


def _family(torch_mesh) -> _TorchFamily:
    root = torch_mesh._get_root_mesh()
    family = root.__dict__.get(_FAMILY_ATTR)
    if family is None:
        family = _TorchFamily()
        setattr(root, _FAMILY_ATTR, family)
    if family.root is None:
        family.root = _convert(root, family_root=None)
    return family


def _convert(torch_mesh, *, family_root: DeviceMesh | None) -> DeviceMesh:
    """Our mesh over ``torch_mesh``'s ranks and process groups (none is created)."""
    mesh = DeviceMesh.from_group(
        torch_mesh.get_all_groups(),
        torch_mesh.device_type,
        torch_mesh.mesh,
        mesh_dim_names=torch_mesh.mesh_dim_names,
    )
    mesh._torch_source = torch_mesh
    mesh._family_root = mesh if family_root is None else family_root
    # DeviceMesh._concatenate of family members calls this: mesh.py does not import us
    mesh._family_concatenate = concatenate
    return mesh


def from_torch_mesh(torch_mesh) -> DeviceMesh:
    """Our mesh for PyTorch's ``torch_mesh``, the same object every time it is asked for;
    meshes derived from one PyTorch root share one root of ours ([Note: converted mesh
    families]).

    Example:
        >>> world = torch_init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
        >>> m = world._unflatten(0, (2, 2), ("dp", "tp"))
        >>> from_torch_mesh(m["tp"])._get_root_mesh() is from_torch_mesh(world)
        True
    """
    family = _family(torch_mesh)
    if torch_mesh is torch_mesh._get_root_mesh():
        return family.root
    mesh = family.members.get(torch_mesh)
    if mesh is None:
        mesh = family.members[torch_mesh] = _convert(torch_mesh, family_root=family.root)
    return mesh


def torch_source(mesh: DeviceMesh):
    """The PyTorch mesh ``mesh`` was converted from (a slice of a converted mesh: that slice
    of its source), or None for a mesh of ours."""
    source = mesh.__dict__.get("_torch_source")
    if source is not None:
        return source
    root_source = mesh._root.__dict__.get("_torch_source")
    if root_source is None or mesh._origin[0] != "slice" or mesh.mesh_dim_names is None:
        return None
    return root_source[mesh.mesh_dim_names]


def concatenate(meshes) -> DeviceMesh:
    """``DeviceMesh._concatenate`` for members of one converted family: PyTorch concatenates
    their sources (its layouts index the root's ranks), and the result is converted.

    Raises:
        ValueError: a mesh has no PyTorch source (a mesh of ours mixed in), or PyTorch
            refuses the concatenation; the message says where each mesh comes from.
    """
    api = "DeviceMesh._concatenate"
    sources = [torch_source(m) for m in meshes]
    listing = ", ".join(describe_mesh(m) for m in meshes)
    if any(s is None for s in sources):
        raise ValueError(
            f"{api}: the meshes {listing} are not slices of one root mesh: some come from "
            "PyTorch's DeviceMesh and some are ours. Build every mesh with one library "
            "(from device_mesh import init_device_mesh), or all of them with PyTorch's."
        )
    try:
        joined = type(sources[0])._concatenate(sources)
    except RuntimeError as e:
        raise ValueError(f"{api}: PyTorch cannot concatenate {listing}: {e}") from None
    return from_torch_mesh(joined)


def as_device_mesh(mesh, *, api: str, argument: str = "mesh") -> DeviceMesh:
    """``mesh`` as our ``DeviceMesh``: ours unchanged, PyTorch's converted over its groups
    (the same conversion every time; [Note: converted mesh families]).

    Raises:
        TypeError: anything else, naming its module and the import to use.

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh as torch_init
        >>> as_device_mesh(torch_init("cpu", (2,)), api="fully_shard").size()
        2
    """
    if isinstance(mesh, DeviceMesh):
        return mesh
    if is_torch_device_mesh(mesh):
        return from_torch_mesh(mesh)
    raise TypeError(
        f"{api}: {argument} must be a device_mesh.DeviceMesh (or PyTorch's), got "
        f"{qualified_name(mesh)}. Build it with `from device_mesh import init_device_mesh`."
    )
