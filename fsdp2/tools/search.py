"""Layout search: the fastest layout that fits a memory budget, over every knob the planner
models (``fsdp2.tools.planner``), block by block where it matters.

``search_layouts(profile, world_size, budget)`` walks the layouts of a world size - the
tensor-parallel and HSDP degrees, how many blocks share one ``fully_shard`` call, which
block groups keep their gathered parameters from forward to backward - and for each finds
the fewest checkpointed blocks that make it fit (checkpointing only costs compute, so the
fewest is the fastest). Tiers come after that, each only when no layout of the tiers before
fits: lower-precision parameters (a dtype ladder, most precise first on CPU), then CPU
offload, the last resort. Of the layouts that fit, the fastest wins; of equally fast ones
the one that uses less memory.

[Note: fitting with a margin] A layout fits when its predicted live peak times ``1 +
margin``, plus the hardware's ``allocator_overhead``, is within the budget. The default
margin is the hardware's measured ``allocator_factor - 1``: what the CUDA caching allocator
reserves (or the CPU process's resident set grows) beyond the live tensor bytes the planner
predicts; the overhead is what it holds whatever the model (8 MiB on this CPU, none on a
GPU).

Example:
    >>> profile = profile_model(model, seq_len=2048)
    >>> result = search_layouts(profile, 64, parse_bytes("79GiB"), hardware=H100)
    >>> result.best.config.describe(), f"{result.best.peak_gib:.1f} GiB"
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from fsdp2.tools.planner import (
    H100,
    Estimate,
    GiB,
    Hardware,
    ModelProfile,
    PlanConfig,
    _divisors,
    estimate,
    peak_bytes,
    speed_then_memory,
    tp_splits,
)

logger = logging.getLogger(__name__)

__all__ = [
    "NothingFitsError",
    "SearchResult",
    "search_layouts",
    "default_margin",
    "host_bytes",
    "fmt_bytes",
]


class NothingFitsError(ValueError):
    """No layout the search considered fits the budget.

    Attributes:
        smallest: the layout with the smallest predicted peak.
        budget: the budget in bytes; ``margin`` the margin it was held to.
        advice: what would make it fit, one line each.

    Example:
        >>> try:
        ...     search_layouts(profile, 8, parse_bytes("1GiB"))
        ... except NothingFitsError as e:
        ...     print(e.smallest.config.describe(), e.advice)
    """

    def __init__(self, smallest: Estimate, budget: int, margin: float, advice: list[str]):
        self.smallest, self.budget, self.margin, self.advice = smallest, budget, margin, advice
        need = _need(smallest.peak_bytes, smallest.hardware, margin)
        overhead = smallest.hardware.allocator_overhead if smallest.hardware else 0
        lines = "".join(f"\n  - {a}" for a in advice)
        super().__init__(
            f"nothing fits: the smallest predicted peak is {fmt_bytes(smallest.peak_bytes)} "
            f"({smallest.config.describe()}), {fmt_bytes(need)} with the {margin:.0%} margin"
            + (f" and the allocator's {fmt_bytes(overhead)}" if overhead else "")
            + ", "
            f"over the budget of {fmt_bytes(budget)} a rank. "
            f"What each change would do:{lines or ' nothing the planner models helps.'}"
        )


    def __reduce__(self):  # an exception is pickled by its args: rebuild from the fields
        return (type(self), (self.smallest, self.budget, self.margin, self.advice))


def fmt_bytes(n: float) -> str:
    """``n`` bytes in GiB, or MiB below one GiB.

    Example:
        >>> fmt_bytes(3 << 30), fmt_bytes(5 << 20)
        ('3.00 GiB', '5.0 MiB')
    """
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


@dataclass
class SearchResult:
    """What ``search_layouts`` found.

    Attributes:
        best: the chosen layout (fastest that fits; of equal ones the smallest).
        considered: every layout estimated at its fewest checkpointed blocks, those that
            fit first (fastest first), then the others (smallest first).
        budget / margin: as searched.
        tier: what the chosen layout needed beyond the first tier (``""``, ``"bf16"``,
            ``"offload"``...).

    Example:
        >>> result.best.config.describe(), len(result.fits)
    """

    best: Estimate
    considered: list[Estimate]
    budget: int
    margin: float
    tier: str = ""
    fits: list[Estimate] = field(default_factory=list)


def default_margin(hardware: Hardware, *, offload: bool = False) -> float:
    """The margin the search holds a layout to by default ([Note: fitting with a margin]):
    the allocator's measured overhead, larger under CPU offload (its staging copies).

    Example:
        >>> default_margin(H100), default_margin(H100, offload=True)
        (0.35, 0.55)
    """
    factor = hardware.allocator_factor
    if offload and hardware.offload_allocator_factor is not None:
        factor = hardware.offload_allocator_factor
    return round(max(factor - 1.0, 0.0), 4)


def search_layouts(
    profile: ModelProfile,
    world_size: int,
    budget_bytes: int,
    *,
    hardware: Hardware = H100,
    global_batch: int | None = None,
    margin: float | None = None,
    tp_degrees=None,
    replicate_degrees=None,
    blocks_per_group=(1, 2, 0),
    param_dtypes=None,
    offload: bool | str = "last-resort",
    optimizer: str = "adamw",
) -> SearchResult:
    """Search the layouts of ``world_size`` ranks for the fastest that fits ``budget_bytes``.

    Args:
        profile: from ``profile_model`` (with ``tp_plan`` for tensor-parallel layouts).
        world_size: ranks in all.
        budget_bytes: live bytes one rank may hold (a device's memory, say).
        hardware: the step-cost and allocator model (``H100``, ``CPU``).
        global_batch: sequences per step, held fixed across layouts (default: one per rank).
        margin: fit ``peak * (1 + margin) <= budget`` (default ``default_margin``).
        tp_degrees / replicate_degrees: the degrees allowed (default: 1, 2, 4, 8 within a
            node dividing the heads; HSDP replicas whose shard groups fill whole nodes).
        blocks_per_group: blocks per ``fully_shard`` call to try (0: the root alone).
        param_dtypes: the ladder of ``(param_dtype, reduce_dtype)`` pairs (or dtypes: the
            reduction then in fp32) tried in order, the next only when nothing fits (default:
            bf16 compute on a GPU; fp32, then bf16 on a CPU).
        offload: ``"last-resort"`` (only when nothing fits on the device), True, False.
        optimizer: ``"adamw"``, ``"sgd"``, ``"sgd-nomomentum"``.

    Raises:
        NothingFitsError: no layout fits; it carries the smallest and what would fit.
        ValueError: bad arguments (before any search).

    Example:
        >>> result = search_layouts(profile, 8, 6 * 2**30, hardware=CPU)
        >>> result.best.config.checkpointed_blocks       # the fewest blocks checkpointed
        (0, 1)
    """
    _check_args(world_size, budget_bytes, margin, offload)
    global_batch = global_batch or world_size
    considered: list[Estimate] = []
    for label, base in _tiers(hardware, param_dtypes, offload):
        base = replace(base, world_size=world_size, optimizer=optimizer)
        tier_margin = default_margin(hardware, offload=base.offload) if margin is None else margin
        layouts = _layouts(profile, base, hardware, global_batch, tp_degrees, replicate_degrees,
                           blocks_per_group)  # fmt: skip
        found = [
            _fewest_checkpointed(profile, cfg, hardware, budget_bytes, tier_margin)
            for cfg in layouts
        ]
        considered += found
        fits = [e for e in found if _fits(e, budget_bytes, tier_margin)]
        if fits:
            return _result(considered, fits, budget_bytes, tier_margin, label)
    _nothing_fits(profile, considered, world_size, global_batch, budget_bytes, margin, hardware)


def _result(considered, fits, budget: int, margin: float, label: str) -> SearchResult:
    """The fitting layouts fastest first (of equal ones the smaller), then the others."""
    fits = sorted(fits, key=speed_then_memory)
    rest = sorted((e for e in considered if e not in fits), key=lambda e: e.peak_bytes)
    best = fits[0]
    logger.info(
        "search: %d layouts, %d fit; best %s (%.2f GiB, %.3f s)",
        len(considered), len(fits), best.config.describe(), best.peak_gib, best.step_s,
    )  # fmt: skip
    return SearchResult(best, fits + rest, budget, float(margin), label, fits)


def _nothing_fits(profile, considered, world, global_batch, budget, margin, hardware):
    """Raise why nothing was found: no layout at all, or none that fits."""
    if not considered:
        raise ValueError(
            f"search_layouts: no layout of {world} ranks holds the global batch "
            f"{global_batch} (no data-parallel size divides it); pass global_batch=."
        )
    smallest = min(considered, key=lambda e: e.peak_bytes)
    if margin is None:
        margin = default_margin(hardware, offload=smallest.config.offload)
    advice = _advice(profile, smallest, budget, margin, hardware)
    raise NothingFitsError(smallest, budget, margin, advice)


def _check_args(world_size, budget_bytes, margin, offload) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"search_layouts: world_size must be a positive int, got {world_size!r}.")
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(
            f"search_layouts: budget_bytes must be a positive int, got {budget_bytes!r} "
            "(parse '80GiB' with fsdp2.tools.planner.parse_bytes)."
        )
    if margin is not None and not (isinstance(margin, (int, float)) and 0 <= margin < 10):
        raise ValueError(f"search_layouts: margin must be a fraction >= 0, got {margin!r}.")
    if offload not in (True, False, "last-resort"):
        raise ValueError(
            f"search_layouts: offload must be True, False or 'last-resort', got {offload!r}."
        )


def _fits(est: Estimate, budget: int, margin: float) -> bool:
    return _need(est.peak_bytes, est.hardware, margin) <= budget


def _need(peak: int, hardware: Hardware | None, margin: float) -> float:
    """The budget a layout of live peak ``peak`` needs ([Note: fitting with a margin])."""
    return peak * (1 + margin) + (hardware.allocator_overhead if hardware else 0)


def _dtype_pair(entry):
    if isinstance(entry, tuple):
        return entry
    return entry, (torch.float32 if entry not in (None, torch.float32) else None)


def _tiers(hardware: Hardware, param_dtypes, offload) -> list[tuple[str, PlanConfig]]:
    """``(label, base config)`` of each tier, in the order they are tried."""
    if param_dtypes is None:
        param_dtypes = (torch.bfloat16,) if hardware.device != "cpu" else (None, torch.bfloat16)
    pairs = [_dtype_pair(d) for d in param_dtypes]
    offloads = {True: [True], False: [False], "last-resort": [False, True]}[offload]
    if hardware.device == "cpu":
        offloads = [False]  # a CPU compute device has nowhere to offload to
    tiers = []
    for off in offloads:
        for i, (pd, rd) in enumerate(pairs):
            label = " ".join(
                x
                for x in (
                    _name(pd) if i else "",
                    "offload" if off and offload == "last-resort" else "",
                )
                if x
            )
            tiers.append(
                (label, PlanConfig(world_size=1, param_dtype=pd, reduce_dtype=rd, offload=off))
            )
    return tiers


def _name(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype)
    )


def _layouts(profile, base, hardware, global_batch, tp_degrees, replicate_degrees, groupings):
    """Every ``PlanConfig`` of the tier ``base`` (checkpointing decided later)."""
    world = base.world_size
    tps = tp_degrees or [t for t in (1, 2, 4, 8) if t <= hardware.devices_per_node]
    for tp in tps:
        if world % tp or not tp_splits(profile, tp):
            continue
        dp = world // tp
        if global_batch % dp:
            continue
        for rep in replicate_degrees or _replicas(dp, tp, hardware):
            if dp % rep or (rep > 1 and dp // rep < 2):
                continue
            trivial = dp // rep == 1  # nothing sharded: grouping and resharding change nothing
            for k in groupings[:1] if trivial else groupings:
                if k > profile.n_blocks:
                    continue
                modes = _reshard_modes(k, profile.n_blocks)
                for raf, keep in modes[:1] if trivial else modes:
                    yield replace(
                        base,
                        tp=tp,
                        dp_replicate=rep,
                        blocks_per_group=k,
                        reshard_after_forward=raf,
                        keep_last_groups=keep,
                        batch_size=global_batch // dp,
                        checkpointed_blocks=(),
                    )


def _replicas(dp: int, tp: int, hardware: Hardware) -> list[int]:
    """HSDP replica counts worth trying: none, and those whose shard groups fill whole
    nodes (a replica per node or per few nodes: the reductions across them are the only
    traffic between nodes)."""
    node = hardware.devices_per_node
    out = [1]
    for rep in _divisors(dp)[1:]:
        span = tp * dp // rep
        if dp // rep >= 2 and span % node == 0 and span < tp * dp:
            out.append(rep)
    return out


def _reshard_modes(k: int, n_blocks: int) -> list[tuple[bool, int]]:
    """``(reshard_after_forward, keep_last_groups)`` to try: every group resharded, all but
    the last (its backward comes right after forward), none."""
    if k == 0:
        return [(True, 0)]
    n_groups = -(-n_blocks // k)
    modes = [(True, 0), (False, 0)]
    if n_groups > 1:
        modes.insert(1, (True, 1))
    return modes


def _fewest_checkpointed(profile, cfg, hardware, budget, margin) -> Estimate:
    """``cfg`` with the fewest checkpointed blocks that fit (the first ones), estimated; all
    of them when even that does not fit (the smallest this layout gets). Memory falls as
    blocks are checkpointed, so a bisection finds the count."""
    n = profile.n_blocks

    def with_ac(c: int) -> PlanConfig:
        return replace(cfg, checkpointed_blocks=tuple(range(c)))

    def fits(c: int) -> bool:
        return _need(peak_bytes(profile, with_ac(c), hardware), hardware, margin) <= budget

    if fits(0):
        return estimate(profile, with_ac(0), hardware)
    if not fits(n):
        return estimate(profile, with_ac(n), hardware)
    lo, hi = 0, n  # lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return estimate(profile, with_ac(hi), hardware)


def _advice(profile, smallest: Estimate, budget: int, margin: float, hw: Hardware) -> list[str]:
    """What would make the smallest layout fit (``fsdp2.tools.advice``), without its first
    line, which the error's message says already."""
    from fsdp2.tools.advice import nothing_fits_advice

    return nothing_fits_advice(profile, smallest, budget, hw, margin=margin, how="api")[1:]


def host_bytes(est: Estimate) -> int:
    """Host memory one rank needs under CPU offload: its parameter and gradient shards and
    the optimizer state (``fsdp2.tools.advice.offload_host_memory``, per rank).

    Example:
        >>> host_bytes(estimate(profile, PlanConfig(world_size=64, offload=True))) / 2**30
    """
    from fsdp2.tools.advice import offload_host_memory

    return offload_host_memory(est, hardware=est.hardware or H100).per_rank
