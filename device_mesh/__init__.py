"""device_mesh: an n-D grid of ranks with named dims and a process group per mesh dim.

Example:
    >>> from device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    >>> mesh["tp"].get_group()
"""

from device_mesh._interop import as_device_mesh
from device_mesh.mesh import DeviceMesh, concatenate_meshes, init_device_mesh
from device_mesh.resources import MeshResources

__all__ = [
    "DeviceMesh",
    "init_device_mesh",
    "as_device_mesh",
    "concatenate_meshes",
    "MeshResources",
]
