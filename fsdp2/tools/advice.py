"""What would make a layout fit when none does: the advice of ``python -m fsdp2.plan`` and of
``fsdp2.tools.search.NothingFitsError`` (so of ``fsdp2.auto_parallelize``).

Every suggestion is evaluated on the smallest layout (the one with the lowest predicted
peak), changing one thing at a time, and offered only where it is not already in use and
lowers the peak: activation checkpointing, CPU offload (with the host memory it needs),
bf16 master weights, a smaller micro-batch, and more ranks (the smallest world size that
fits, found by doubling then bisecting).

Example:
    >>> fits, too_big = rank_configs(profile, 8, budget)
    >>> if not fits:
    ...     for line in nothing_fits_advice(profile, too_big[0], budget, H100):
    ...         print(line)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from fsdp2.tools.planner import (
    _OPTIMIZER_STATES,
    Estimate,
    Hardware,
    ModelProfile,
    estimate,
)

logger = logging.getLogger(__name__)

__all__ = [
    "HostMemory",
    "offload_host_memory",
    "smallest_fitting_world_size",
    "nothing_fits_advice",
]

_GIB = 1 << 30
#: The largest world size the search for "more ranks" tries.
MAX_WORLD_SIZE = 1 << 17


@dataclass(frozen=True)
class HostMemory:
    """The host memory ``CPUOffloadPolicy`` needs for one layout: the sharded parameters,
    their gradients and the optimizer state, which leave the device.

    Attributes:
        params / grads / optimizer_state: bytes of one rank (rank 0: the largest shards).
        ranks_per_node: ranks that share one host.

    Example:
        >>> host = offload_host_memory(estimate(profile, cfg), hardware=H100)
        >>> host.per_rank / 2**30, host.per_node / 2**30
    """

    params: int
    grads: int
    optimizer_state: int
    ranks_per_node: int

    @property
    def per_rank(self) -> int:
        """Bytes one rank keeps on the host."""
        return self.params + self.grads + self.optimizer_state

    @property
    def per_node(self) -> int:
        """Bytes the host of a node keeps for all its ranks."""
        return self.per_rank * self.ranks_per_node


def offload_host_memory(est: Estimate, *, hardware: Hardware) -> HostMemory:
    """What ``est``'s layout moves to the host under CPU offload: parameter shards (in
    their dtype at rest), the gradient shards of the groups that train (the same dtype),
    and the optimizer's state (AdamW two tensors per trained element, SGD with momentum
    one, plain SGD none), per rank and per node of ``hardware.devices_per_node`` ranks
    (fewer when the world is smaller).

    Example:
        >>> host = offload_host_memory(estimate(profile, PlanConfig(world_size=8)), hardware=H100)
        >>> host.per_rank == host.params + host.grads + host.optimizer_state
        True
    """
    params = sum(g.shard_numel * g.itemsize for g in est.groups)
    trained = sum(g.trained_shard_numel * g.itemsize for g in est.groups)
    states = _OPTIMIZER_STATES[est.config.optimizer] * trained
    ranks = max(1, min(hardware.devices_per_node, est.config.world_size))
    return HostMemory(params, trained, states, ranks)


def smallest_fitting_world_size(
    profile: ModelProfile,
    cfg,
    budget: int,
    hardware: Hardware,
    *,
    limit: int = MAX_WORLD_SIZE,
    margin: float = 0.0,
) -> Estimate | None:
    """The estimate of ``cfg`` at the smallest world size above ``cfg.world_size`` whose
    peak fits ``budget``: the same tensor parallelism and replicas and the same micro-batch
    per rank (so a larger global batch), more shards. Doubles the world until a size fits,
    then bisects between the last two (in steps of ``tp * dp_replicate``); None when no size
    up to ``limit`` fits (what does not shrink with more shards - activations, the gathered
    blocks, buffers - is over the budget by itself).

    Example:
        >>> est = smallest_fitting_world_size(profile, too_big[0].config, budget, H100)
        >>> est.config.world_size if est else "no world size fits"
    """
    step = cfg.tp * cfg.dp_replicate
    budget = int((budget - hardware.allocator_overhead) / (1 + margin))  # the peak a fit may reach

    def at(world: int) -> Estimate:
        return estimate(profile, replace(cfg, world_size=world), hardware)

    lo, hi = cfg.world_size, None
    world = cfg.world_size
    while world * 2 <= limit:
        world *= 2
        est = at(world)
        if est.peak_bytes <= budget:
            hi = est
            break
        lo = world
    if hi is None:
        return None
    while hi.config.world_size - lo > step:  # fits at hi, not at lo
        mid = (lo + hi.config.world_size) // 2 // step * step
        if mid <= lo:
            break
        est = at(mid)
        if est.peak_bytes <= budget:
            hi = est
        else:
            lo = mid
    return hi


def _gib(n: float) -> str:
    """``n`` bytes in GiB, or in MiB below one GiB."""
    return f"{n / _GIB:.1f} GiB" if abs(n) >= _GIB else f"{n / (1 << 20):.1f} MiB"


#: How each change is spelled on the command line and in Python.
_SPELLING = {
    "cli": {"ac": "--ac", "offload": "--offload", "master": "--master-dtype bf16",
            "batch": "--global-batch {}"},
    "api": {"ac": "checkpointed blocks", "offload": "offload=True",
            "master": "the model in bf16: model.to(torch.bfloat16)", "batch": "batch={}"},
}  # fmt: skip


def _spell(how: str, change: str, *args) -> str:
    return _SPELLING[how][change].format(*args)


def _need(est: Estimate, margin: float) -> float:
    """The budget ``est`` needs: its peak with the margin and the allocator's overhead."""
    overhead = est.hardware.allocator_overhead if est.hardware is not None else 0
    return est.peak_bytes * (1 + margin) + overhead


def _verdict(est: Estimate, budget: int, margin: float = 0.0) -> str:
    need = _need(est, margin)
    if need <= budget:
        return f"fits ({_gib(est.peak_bytes)})"
    return f"still {_gib(est.peak_bytes)}, {_gib(need - budget)} over"


def _bf16_master(profile: ModelProfile) -> ModelProfile:
    """``profile`` with bf16 parameters (its traces shared: they depend on the compute
    dtype only)."""
    params = [
        replace(p, dtype=torch.bfloat16) if p.dtype.is_floating_point else p for p in profile.params
    ]
    return replace(profile, params=params, cache={})  # the cached layouts have fp32 sizes


def nothing_fits_advice(
    profile: ModelProfile,
    smallest: Estimate,
    budget: int,
    hardware: Hardware,
    *,
    max_world_size: int = MAX_WORLD_SIZE,
    margin: float = 0.0,
    how: str = "cli",
) -> list[str]:
    """Lines of advice when no layout fits: for the smallest layout ``smallest`` (the
    lowest peak of ``rank_configs``' ``too_big``), each change it does not already use,
    evaluated, with whether it then fits: activation checkpointing; CPU offload (on a
    GPU), with the host memory it takes per rank and per node
    (:func:`offload_host_memory`); bf16 master weights (when they are wider); one sequence
    per rank (when it has more); those together; and the smallest world size that fits
    (:func:`smallest_fitting_world_size`), as is or with the changes. A change that does
    not lower the peak is not suggested; one already in use is said to be. A layout fits
    when ``peak * (1 + margin) <= budget``. ``how`` names each change as the command line
    spells it (``"cli"``: ``--offload``) or as Python code does (``"api"``:
    ``offload=True``).

    Example:
        >>> for line in nothing_fits_advice(profile, too_big[0], 20 * 2**30, H100):
        ...     print(line)
        the smallest peak, 43.4 GiB (fsdp 8 ac bf16, at backward start), is 23.4 GiB over ...
        activation checkpointing is already on in this layout
        CPU offload (--offload): still 32.2 GiB, 12.2 GiB over; the host holds 15.0 GiB a rank, ...
    """
    advisor = _Advisor(profile, smallest, budget, hardware, margin, how)
    advisor.checkpointing()
    advisor.offload()
    advisor.bf16_master()
    advisor.one_sequence()
    together_fits = advisor.together()
    advisor.more_ranks(max_world_size, together_fits)
    logger.debug("nothing fits: %s", advisor.lines)
    return advisor.lines


class _Advisor:
    """The advice of ``nothing_fits_advice``, one change at a time: ``lines`` so far, the
    ``PlanConfig`` fields of the changes that lower the peak, their labels."""

    def __init__(self, profile, smallest: Estimate, budget: int, hw, margin: float, how: str):
        self.profile, self.smallest, self.budget, self.hw = profile, smallest, budget, hw
        self.margin, self.how, self.cfg = margin, how, smallest.config
        self.changes: dict = {}
        self.helped: list[str] = []
        self.changed = profile  # with bf16 parameters, once that helps
        over = _gib(_need(smallest, margin) - budget)
        by_category = ", ".join(
            f"{k} {_gib(v)}"
            for k, v in sorted(smallest.categories.items(), key=lambda kv: -kv[1])
            if v >= 0.05 * _GIB
        )
        self.lines = [
            f"the smallest peak, {_gib(smallest.peak_bytes)} ({self.cfg.describe()}, at "
            f"{smallest.peak_phase}), is {over} over the budget of {_gib(budget)}"
            + (f" with the {margin:.0%} margin" if margin else "")
            + f"; by category: {by_category}"
        ]

    def _consider(self, label: str, est: Estimate, fields: dict, note: str = "") -> bool:
        lowers = est.peak_bytes < self.smallest.peak_bytes
        if lowers or note:
            self.lines.append(f"{label}: {_verdict(est, self.budget, self.margin)}{note}")
        if lowers:
            self.changes.update(fields)
            self.helped.append(label.split(" (")[0])
        return lowers

    def checkpointing(self) -> None:
        cfg, n = self.cfg, self.profile.n_blocks
        if len(cfg.checkpointed(n)) == n:
            self.lines.append("activation checkpointing is already on in this layout")
            return
        fields = {"activation_checkpointing": True, "checkpointed_blocks": None}
        est = estimate(self.profile, replace(cfg, **fields), self.hw)
        self._consider(f"activation checkpointing ({_spell(self.how, 'ac')})", est, fields)

    def offload(self) -> None:
        if self.hw.device == "cpu":  # a CPU compute device ignores offload
            return
        cfg = self.cfg
        host = offload_host_memory(self.smallest, hardware=self.hw)
        held = (
            f"the host holds {_gib(host.per_rank)} a rank, {_gib(host.per_node)} a node of "
            f"{host.ranks_per_node} ranks (parameter shards {_gib(host.params)}, gradients "
            f"{_gib(host.grads)}, {cfg.optimizer} state {_gib(host.optimizer_state)})"
        )
        if cfg.offload:
            self.lines.append(f"CPU offload is already on: {held}")
            return
        est = estimate(self.profile, replace(cfg, offload=True), self.hw)
        label = f"CPU offload ({_spell(self.how, 'offload')})"
        self._consider(label, est, {"offload": True}, f"; {held}")

    def bf16_master(self) -> None:
        params = self.profile.params
        if not any(p.dtype.itemsize > 2 for p in params if p.dtype.is_floating_point):
            return
        cfg = self.cfg
        bf16 = _bf16_master(self.profile)
        fields = {"param_dtype": None if cfg.param_dtype == torch.bfloat16 else cfg.param_dtype}
        est = estimate(bf16, replace(cfg, **fields), self.hw)
        label = (
            f"bf16 master weights ({_spell(self.how, 'master')}: weights, gradients and "
            "optimizer state in bf16, no fp32 copy)"
        )
        if self._consider(label, est, fields):
            self.changed = bf16

    def one_sequence(self) -> None:
        cfg = self.cfg
        if cfg.batch_size > 1:
            est = estimate(self.profile, replace(cfg, batch_size=1), self.hw)
            how = _spell(self.how, "batch", cfg.dp)
            label = f"one sequence a rank instead of {cfg.batch_size} ({how})"
            self._consider(label, est, {"batch_size": 1})

    def together(self) -> bool:
        """All the helpful changes at once; whether they fit."""
        if not self.helped:
            return False
        est = estimate(self.changed, replace(self.cfg, **self.changes), self.hw)
        if len(self.helped) > 1:
            verdict = _verdict(est, self.budget, self.margin)
            self.lines.append(f"all of these together ({', '.join(self.helped)}): {verdict}")
        return _need(est, self.margin) <= self.budget

    def more_ranks(self, limit: int, together_fits: bool) -> None:
        cfg, budget, margin = self.cfg, self.budget, self.margin
        more = smallest_fitting_world_size(
            self.profile, cfg, budget, self.hw, limit=limit, margin=margin
        )
        if more is not None:
            self.lines.append(
                f"more ranks: {more.config.world_size} ranks fit ({more.config.describe()}, "
                f"{cfg.batch_size} sequence(s) a rank, {_gib(more.peak_bytes)})"
            )
            return
        line = (
            f"more ranks alone do not help: no world size up to {limit} fits this "
            "layout (what does not shrink with more shards is over the budget)"
        )
        if self.helped and not together_fits:
            together = replace(cfg, **self.changes)
            more = smallest_fitting_world_size(
                self.changed, together, budget, self.hw, limit=limit, margin=margin
            )
            if more is not None:
                line += (
                    f"; with {', '.join(self.helped)}: {more.config.world_size} ranks fit "
                    f"({more.config.describe()}, {_gib(more.peak_bytes)})"
                )
        self.lines.append(line)
