"""Process-group creation and caching.

Every rank must create every process group in the same order: ``new_group`` is a collective
over the default group, even for ranks that are not members. Meshes therefore enumerate all
the rank sets of a mesh dim (not only the one this rank belongs to) and ask this module for
each, in a deterministic order. A rank set is created once per backend and then served from
the cache, so slicing a mesh or building a second mesh of the same shape creates nothing.

[Note: weak group references] The cache and the meshes hold process groups weakly (``hold``,
``resolve``), as PyTorch's DeviceMesh holds only their names. ``torch.distributed`` keeps
every group alive until ``destroy_process_group()``, which then lets it go: a gloo group's
destructor joins its worker threads while Python still runs. Held strongly here, a group
outlived that call into interpreter shutdown, where a worker thread releasing a finished
collective's tensor needs the GIL and aborted the process ("terminate called without an
active exception", SIGABRT at exit: about 1 run in 40 of a two-rank torchrun script that
ends right after a collective; PyTorch's pull request 179291 describes the same crash). A
mesh used after ``destroy_process_group()`` raises instead of reaching a destroyed group.
"""

from __future__ import annotations

import importlib
import logging
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# (backend, ranks) -> hold(ProcessGroup) (or GroupMember.NON_GROUP_MEMBER on non-members);
# (backend, ranks, purpose) -> hold(ProcessGroup) for get_side_group
_GROUP_CACHE: dict[tuple, object] = {}


def hold(group):
    """What a mesh or the cache keeps for ``group``: a weak reference to a process group
    ([Note: weak group references]); None and the non-member sentinel as they are.

    Example:
        >>> resolve(hold(dist.group.WORLD)) is dist.group.WORLD
        True
    """
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        return group
    return weakref.ref(group)


def _alive(held):
    """The process group ``held`` refers to, or None once it was destroyed."""
    return held() if isinstance(held, weakref.ref) else held


def resolve(held, *, api: str = "DeviceMesh"):
    """The process group ``held`` refers to; a clear error once it was destroyed.

    Example:
        >>> resolve(hold(group)) is group
        True
    """
    group = _alive(held)
    if group is None and held is not None:
        raise RuntimeError(
            f"{api}: this mesh's process group was destroyed (destroy_process_group() was "
            "called). Build a new mesh after init_process_group()."
        )
    return group


# Backend per device type. A device type absent here has no usable backend.
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def backend_for(device_type: str, *, api: str = "DeviceMesh") -> str:
    """Return the collective backend used for ``device_type``, or raise a clear error.

    Example:
        >>> backend_for("cpu")
        'gloo'
    """
    if not isinstance(device_type, str):
        raise TypeError(
            f"{api}: device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}."
        )
    backend = _BACKENDS.get(device_type)
    if backend is None:
        raise ValueError(
            f"{api}: device_type must be one of {sorted(_BACKENDS)}, got {device_type!r}. "
            "Use 'cpu' (gloo) or 'cuda' (NCCL)."
        )
    if device_type == "cuda" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError(
            f"{api}: device_type 'cuda' has no usable backend on this machine "
            f"(cuda available: {torch.cuda.is_available()}, NCCL available: "
            f"{dist.is_nccl_available()}). Use device_type='cpu' to run on gloo."
        )
    if device_type == "cpu" and not dist.is_gloo_available():
        raise ValueError(
            f"{api}: device_type 'cpu' needs the gloo backend, which this torch build lacks. "
            "Install a torch build with gloo support."
        )
    return backend


DEFAULT_TIMEOUT = timedelta(seconds=600)
TIMEOUT_ENV = "DEVICE_MESH_TIMEOUT_S"


def ensure_default_group(device_type: str, *, timeout: timedelta | None = None) -> None:
    """Initialize the default process group if none exists; otherwise do nothing.

    Under ``torchrun`` (``RANK`` or ``WORLD_SIZE`` set) it is read from the environment
    (``init_method='env://'``). A lone process with neither gets a world of one on an
    in-process store, so scripts and notebooks run unchanged; the environment is only read,
    never written. To choose the backend, the store or the timeout yourself, call
    ``torch.distributed.init_process_group`` before building a mesh, as with PyTorch.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
        timeout: how long a collective of the default group may wait. ``None`` takes
            ``DEVICE_MESH_TIMEOUT_S`` (seconds) from the environment when set, else 600 s.

    Raises:
        ValueError: ``DEVICE_MESH_TIMEOUT_S`` is not a positive number.

    Example:
        >>> ensure_default_group("cpu", timeout=timedelta(minutes=2))
        >>> dist.get_world_size()          # 1 in a lone process, WORLD_SIZE under torchrun
        1
    """
    if dist.is_initialized():
        return
    backend = backend_for(device_type)
    timeout = default_timeout() if timeout is None else timeout
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    else:
        # A world of one needs no rendezvous: an in-process store instead of MASTER_ADDR/PORT
        # (which would have to be written into this process's environment).
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    logger.info(
        "initialized the default process group (%s): rank %d of %d, timeout %s",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
        timeout,
    )


def default_timeout() -> timedelta:
    """The default group's timeout when none is given: ``DEVICE_MESH_TIMEOUT_S`` or 600 s.

    Example:
        >>> default_timeout()              # DEVICE_MESH_TIMEOUT_S unset
        datetime.timedelta(seconds=600)
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"DeviceMesh: {TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}. "
            "Set it to e.g. 600, or unset it."
        )
    return timedelta(seconds=seconds)


def simulated_world() -> bool:
    """Whether the default group is PyTorch's fake process group: a dry run of one process
    standing for every rank of a large world, where collectives move no data.

    Every group a mesh asks for is then a fake group too (a real gloo group cannot be built
    over the fake store), as PyTorch's DeviceMesh, which creates its groups with the default
    group's backend, does.

    Example:
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
        >>> simulated_world()
        True
    """
    return dist.is_initialized() and str(dist.get_backend()).lower() == "fake"


def _world_backend_serves(backend: str) -> bool:
    world_backend = str(dist.get_backend()).lower()
    return backend in world_backend or world_backend == "fake"


def get_group(ranks: tuple[int, ...], backend: str, *, create: bool = True):
    """Return the process group over ``ranks`` (sorted by global rank), creating it once.

    Must be called by every rank of the default group, in the same order, the first time a
    given rank set is requested; later requests are served from the cache without
    communication. Returns ``GroupMember.NON_GROUP_MEMBER`` on ranks outside ``ranks``.
    With ``create=False`` a group missing from the cache is a ``LookupError`` (rebuilding an
    unpickled mesh must never start a collective that only this rank joins).
    """
    _drop_stale_cache()
    key = (backend, tuple(sorted(ranks)))
    group = _alive(_GROUP_CACHE.get(key))
    if group is not None:
        return group
    if not create:
        raise LookupError(f"no cached {backend} process group over ranks {key[1]}")
    world = dist.get_world_size()
    if key[1] == tuple(range(world)) and _world_backend_serves(backend):
        group = dist.group.WORLD
    else:
        real = "fake" if simulated_world() else backend
        if real == "fake":
            ensure_fake_backend()
        group = dist.new_group(ranks=list(key[1]), backend=real)
        logger.debug("created %s process group over ranks %s", real, key[1])
    _GROUP_CACHE[key] = hold(group)
    return group


def get_side_group(ranks: tuple[int, ...], backend: str, *, purpose: str):
    """A process group over ``ranks`` of its own, apart from the meshes' groups, created once
    per ``purpose`` (``"checkpoint-background"``: async checkpointing talks over it from a
    thread, so its messages never interleave with the training's collectives).

    Only the members call it (``use_local_synchronization``). Held weakly in the same cache as
    the meshes' groups ([Note: weak group references]): ``destroy_process_group()`` frees it,
    and after a re-initialization a new one is created instead of the destroyed one reused.

    Example:
        >>> pg = get_side_group((0, 1), "gloo", purpose="checkpoint-background")
        >>> pg is get_side_group((0, 1), "gloo", purpose="checkpoint-background")
        True
    """
    _drop_stale_cache()
    key = (backend, tuple(sorted(ranks)), purpose)
    group = _alive(_GROUP_CACHE.get(key))
    if group is None:
        real = "fake" if simulated_world() else backend
        group = dist.new_group(list(key[1]), backend=real, use_local_synchronization=True)
        logger.debug("created %s process group over ranks %s for %s", backend, key[1], purpose)
        _GROUP_CACHE[key] = hold(group)
    return group


_CACHE_WORLD: list[object] = [None]  # hold() of the default group the cache belongs to


def _drop_stale_cache() -> None:
    # A destroyed and re-initialized default group invalidates every cached subgroup.
    world = _alive(_CACHE_WORLD[0])
    if world is None or world is not dist.group.WORLD:
        _GROUP_CACHE.clear()
        _CACHE_WORLD[0] = hold(dist.group.WORLD)


def register_group(group, backend: str) -> None:
    """Cache an existing process group (``DeviceMesh.from_group``) under its rank set, so
    meshes built from it can be sliced, compared and unpickled without creating groups."""
    _drop_stale_cache()
    ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    _GROUP_CACHE.setdefault((backend, ranks), hold(group))


def backend_of(group, default: str) -> str:
    """The backend to cache ``group`` under: ``"fake"`` for a fake group in a real world
    (a ``backend_override`` of PyTorch's mesh), else ``default``.

    Example:
        >>> backend_of(dist.new_group([0, 1], backend="fake"), "gloo")
        'fake'
    """
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or simulated_world():
        return default
    try:
        name = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return default
    return "fake" if name == "fake" else default


def ensure_fake_backend() -> None:
    """Register PyTorch's ``"fake"`` backend (groups that move no data) if it is not yet:
    ``torch.distributed`` knows its name but makes groups of it only once
    ``torch.testing._internal.distributed.fake_pg`` registered it, as PyTorch's dry runs and
    torchtitan's ``ParallelDims`` (a ``backend_override`` of ``"fake"``) expect.

    Example:
        >>> ensure_fake_backend()
        >>> dist.new_group([0, 1], backend="fake")
    """
    if "FAKE" not in getattr(dist.Backend, "_plugins", {}):
        importlib.import_module("torch.testing._internal.distributed.fake_pg")
