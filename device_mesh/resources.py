"""MeshResources: the runtime state that the layers above keep with a root mesh.

[Note: mesh resources] Some state of a layer above belongs with a mesh rather than with a
module: dtensor's dispatch caches hold sharding specs, which hold their mesh, and its
collective workspaces hold buffers for one mesh dim's collectives. Kept in module-level
tables, such state kept every mesh ever used alive, with its process groups. Kept with the
mesh, it goes when the mesh does. So every root mesh has one ``MeshResources``
(``DeviceMesh.resources``), shared by its slices and flattened meshes, in which each layer
keeps one object per class *it* owns: the class is the key, so two layers never meet in
here, and the lookup is typed (``get(Caches)`` is a ``Caches``). What is kept should name
process groups (``group.group_name``), not hold them ([Note: weak group references] in
``groups.py``). A copy of a mesh is the mesh itself; a pickle is a description, and the
mesh it rebuilds starts with empty resources.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class MeshResources:
    """One root mesh's runtime state for the layers above: one object per class, made by
    calling the class with no arguments the first time it is asked for ([Note: mesh
    resources] in ``device_mesh/resources.py``). Get it from ``mesh.resources``.

    Example:
        >>> class Counters:                    # a class of the layer that keeps the state
        ...     def __init__(self) -> None:
        ...         self.calls = 0
        >>> mesh.resources.get(Counters).calls += 1
        >>> mesh["tp"].resources.get(Counters).calls   # a slice shares its root's
        1
        >>> mesh.resources.peek(dict) is None          # peek makes nothing
        True
    """

    __slots__ = ("_by_kind",)

    def __init__(self) -> None:
        self._by_kind: dict[type, object] = {}

    def get(self, kind: type[T]) -> T:
        """The ``kind`` object of this mesh, made by ``kind()`` on first use (one per mesh
        even when two threads ask first at once).

        Example:
            >>> mesh.resources.get(Counters) is mesh.resources.get(Counters)
            True
        """
        found = self._by_kind.get(kind)
        if found is None:
            found = self._by_kind.setdefault(kind, kind())
        return found  # type: ignore[return-value]

    def peek(self, kind: type[T]) -> T | None:
        """The ``kind`` object of this mesh if one was made, else None (nothing is made).

        Example:
            >>> mesh.resources.peek(Counters) is None   # before any get(Counters)
            True
        """
        return self._by_kind.get(kind)  # type: ignore[return-value]

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k.__module__}.{k.__qualname__}" for k in self._by_kind)
        return f"MeshResources({kinds})"
