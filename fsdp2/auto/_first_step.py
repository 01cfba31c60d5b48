"""The check after the first real step: the measured peak against the plan's prediction.

[Note: the first-step check] The planner predicts the steady state: optimizer state
present, gradients set to None by ``zero_grad``. The first step has no optimizer state
until its ``step()``, so the check measures the *second* one: from the first forward after
the first ``optimizer.step()`` that updates the model's parameters to the end of the next
one (``zero_grad``, the forwards and backwards of any accumulation, the step). The window
is opened by a forward pre-hook of the root and closed by a step post-hook of that
optimizer, found by a global optimizer pre-hook; no thread, nothing between steps.

The measurement is the peak of live tensor bytes, what the planner predicts:

* on CUDA, ``torch.cuda.max_memory_allocated`` (everything allocated on the device counts:
  the batch, any other model). The check does not reset your peak counters: it records the
  peak at the start of the window, and when the window's peak exceeds it (the usual case:
  the first step with optimizer state is the largest yet), that is the measurement. When
  an earlier, larger peak hides the window's (a checkpoint loaded on the device, say), it
  measures the next step instead, after ``torch.cuda.reset_peak_memory_stats()`` - the one
  case it resets them (logged);
* on CPU, ``fsdp2.tools.memory.MemoryTracker`` over the model and the optimizer (a
  dispatch mode that sees every operator: that step runs a few times slower; don't enter
  other dispatch modes around it that outlive the step).

A measured peak further from the prediction than the plan's margin (10% without one) is
reported once with ``logging.warning``; the measurement is stored as
``plan.measured_peak`` either way.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp2.auto._render import fmt_bytes

logger = logging.getLogger("fsdp2.auto")


class FirstStepCheck:
    """Measure the first steady-state step of ``model`` and compare it with ``plan``
    ([Note: the first-step check]). Installed by ``auto_parallelize(...,
    check_first_step=True)`` as ``plan.first_step_check``; ``remove()`` takes it off early.

    Attributes:
        state: ``"waiting"`` (for the first optimizer step), ``"armed"``, ``"measuring"``,
            ``"done"``.

    Example:
        >>> check = FirstStepCheck(plan, model, "cpu")
        >>> for step in range(2): train_step()
        >>> plan.measured_peak is not None
        True
    """

    def __init__(self, plan, model: torch.nn.Module, device_type: str) -> None:
        self.plan = plan
        self.state = "waiting"
        self._model = weakref.ref(model)
        self._device_type = device_type
        self._tracker = None
        self._baseline: int | None = None  # CUDA: the peak counter at the window's start
        self._reset_next = False
        self._optimizer = None
        self._attached: set[int] = set()
        self._pre_handle = register_optimizer_step_pre_hook(self._on_pre_step)
        self._fwd_handle = model.register_forward_pre_hook(self._on_forward, prepend=True)

    # ------------------------------------------------------------------ hooks
    def _on_pre_step(self, opt, args, kwargs) -> None:
        if self.state == "done" or id(opt) in self._attached:
            return
        model = self._model()
        if model is None:
            return
        mine = {id(p) for p in model.parameters()}
        if not any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            return
        if self._optimizer is not None and self._optimizer() is not None:
            return  # the first optimizer of the model's parameters is the one followed
        self._optimizer = weakref.ref(opt)
        self._attached.add(id(opt))
        # a hook of this optimizer: its post-hooks run before the global ones, so closing
        # the window there may remove the tracker's global hooks (not yet iterated)
        opt.register_step_post_hook(self._on_post_step)

    def _on_post_step(self, opt, args, kwargs) -> None:
        if self.state == "waiting":
            self.state = "armed"
        elif self.state == "measuring":
            self._finish()

    def _on_forward(self, module, args) -> None:
        if self.state != "armed":
            return
        try:
            self._start()
            self.state = "measuring"
        except Exception as e:  # noqa: BLE001 - a failed measurement must not stop training
            logger.warning("auto_parallelize: the first-step memory check could not start "
                           "(%s: %s); skipped.", type(e).__name__, e)  # fmt: skip
            self._cleanup()

    # ------------------------------------------------------------------ measurement
    def _start(self) -> None:
        if self._device_type == "cuda" and torch.cuda.is_available():
            if self._reset_next:
                torch.cuda.reset_peak_memory_stats()
                self._baseline = -1  # whatever the counter reads at the end is the window's
            else:
                self._baseline = int(torch.cuda.max_memory_allocated())
            return
        from fsdp2.tools.memory import MemoryTracker

        opt = self._optimizer() if self._optimizer is not None else None
        tracker = MemoryTracker(*(x for x in (self._model(), opt) if x is not None))
        tracker.__enter__()
        self._tracker = tracker

    def _finish(self) -> None:
        try:
            if self._tracker is not None:
                measured = int(self._tracker.peak)
            else:
                measured = int(torch.cuda.max_memory_allocated())
                if measured <= self._baseline:  # an earlier peak hides the window's
                    self._reset_next = True
                    self.state = "armed"
                    logger.info("auto_parallelize: an earlier peak (%s) hides the second "
                                "step's; the first-step check measures the next step after "
                                "torch.cuda.reset_peak_memory_stats().",
                                fmt_bytes(measured))  # fmt: skip
                    return
        except Exception as e:  # noqa: BLE001 - a failed measurement must not stop training
            logger.warning("auto_parallelize: the first-step memory check failed (%s: %s).",
                           type(e).__name__, e)  # fmt: skip
            self._cleanup()
            return
        self._cleanup()
        self.report(measured)

    def report(self, measured: int) -> None:
        """Store ``measured`` on the plan and warn (once) when it is further from the
        prediction than the margin.

        Example:
            >>> check.report(torch.cuda.max_memory_allocated())
        """
        plan = self.plan
        plan.measured_peak = measured
        predicted = plan.predicted_peak
        tolerance = plan.margin if plan.margin else 0.10
        off = (measured - predicted) / predicted if predicted else float("inf")
        if abs(off) > tolerance:
            logger.warning(
                "auto_parallelize: the second training step (the first with optimizer "
                "state) peaked at %s of live tensors on this rank; the plan predicted %s "
                "(%+.0f%%, beyond the %.0f%% margin). The plan assumed %d sequences of %d "
                "tokens per data-parallel rank and the %s optimizer; a different batch, "
                "sequence length or optimizer, or tensors kept between steps, change the peak.",
                fmt_bytes(measured), fmt_bytes(predicted), 100 * off, 100 * tolerance,
                plan.batch_size, plan.seq_len, plan.config.optimizer,
            )  # fmt: skip
        else:
            logger.info("auto_parallelize: measured peak %s, predicted %s (%+.0f%%).",
                        fmt_bytes(measured), fmt_bytes(predicted), 100 * off)  # fmt: skip

    def _cleanup(self) -> None:
        """Close the tracker and remove the hooks (the optimizer's own post-hook stays,
        inert: it may be running now, and its dict cannot change while it runs)."""
        self.remove()

    def remove(self) -> None:
        """Take the check off (no measurement unless it finished).

        Example:
            >>> check.remove()
        """
        self.state = "done"
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
        for h in (self._pre_handle, self._fwd_handle):
            h.remove()
