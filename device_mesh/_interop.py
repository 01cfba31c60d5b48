"""Accepting PyTorch's own ``DeviceMesh`` where ours is expected.

Recipes written for ``torch.distributed`` port by changing imports, but a half-ported script
(or a library that builds its own mesh) may still hand us a
``torch.distributed.device_mesh.DeviceMesh``. Its process groups are real ``torch.distributed``
groups, the same kind ours are, so it converts without creating any group. Anything else is
refused with a message that names the object's module and the import to use instead.
"""

from __future__ import annotations

from device_mesh.mesh import DeviceMesh


def qualified_name(obj) -> str:
    """``module.Class`` of ``obj``, for errors that must tell look-alike classes apart."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_torch_device_mesh(obj) -> bool:
    cls = type(obj)
    return cls.__name__ == "DeviceMesh" and cls.__module__.startswith("torch.distributed")


def as_device_mesh(mesh, *, api: str, argument: str = "mesh") -> DeviceMesh:
    """``mesh`` as our ``DeviceMesh``: ours unchanged, PyTorch's converted over its groups.

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
        return DeviceMesh.from_group(
            mesh.get_all_groups(),
            mesh.device_type,
            mesh.mesh,
            mesh_dim_names=mesh.mesh_dim_names,
        )
    raise TypeError(
        f"{api}: {argument} must be a device_mesh.DeviceMesh (or PyTorch's), got "
        f"{qualified_name(mesh)}. Build it with `from device_mesh import init_device_mesh`."
    )
