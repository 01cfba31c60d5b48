"""Our ``DeviceMesh`` in ``torch.load(weights_only=True)``.

A mesh pickles as a call of ``device_mesh.mesh._rebuild_mesh`` on a description made of
str, int, tuples and lists (``DeviceMesh.__reduce__``). PyTorch's weights-only unpickler
calls only functions and classes on its allowlist, so a checkpoint holding our DTensors
(whose spec holds their mesh) would be refused. ``_rebuild_mesh`` is safe to allow: it
builds the mesh from the process groups this process already has, creates none, runs no
collective, and raises on a description that does not match them. PyTorch allowlists its
own ``DeviceMesh`` the same way (``torch/distributed/tensor/__init__.py``).
"""

from __future__ import annotations

import torch


def allow_in_weights_only_load(mesh_class: type, rebuild) -> None:
    """Add ``mesh_class`` (``DeviceMesh``) and ``rebuild`` (the function its
    ``__reduce__`` names, ``_rebuild_mesh``) to ``torch.load(weights_only=True)``'s
    allowlist. ``device_mesh/mesh.py`` calls this once both are defined; again does nothing.

    Example:
        >>> allow_in_weights_only_load(DeviceMesh, _rebuild_mesh)   # end of mesh.py
        >>> torch.save(mesh, "m.pt"); torch.load("m.pt", weights_only=True) == mesh
        True
    """
    torch.serialization.add_safe_globals([mesh_class, rebuild])
