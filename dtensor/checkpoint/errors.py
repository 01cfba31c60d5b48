"""The exceptions checkpoint code raises: :class:`CheckpointError` (ours) and
:class:`CheckpointException` (PyTorch's name, for code that catches that).

Every :class:`CheckpointError` is also a :class:`CheckpointException`, so both
``except CheckpointError`` and ``except dcp.CheckpointException`` (code written for
``torch.distributed.checkpoint``) catch a failed save or load. ``CheckpointError`` stays a
``ValueError`` (so ``except Exception`` catches it too, unlike PyTorch's, which derives from
``BaseException`` only).
"""

from __future__ import annotations

import re
import traceback

_RANKS = re.compile(r"^(?P<msg>.*) \[rank (?P<ranks>\d+(?:, \d+)*)\]$")


class CheckpointException(BaseException):
    """PyTorch's checkpoint failure: a message and ``failures``, ``{rank: (exception, trace)}``.

    Derives from ``BaseException`` as PyTorch's does. This library raises
    :class:`CheckpointError`, a subclass of this one, so code that catches
    ``CheckpointException`` keeps working; construct one yourself only to mimic PyTorch.

    Example::

        >>> from dtensor import checkpoint as dcp
        >>> try:
        ...     dcp.load(sd, checkpoint_id="ckpt/missing")
        ... except dcp.CheckpointException as e:
        ...     print(sorted(e.failures))      # the ranks that reported a problem
        [0, 1]
    """

    def __init__(self, msg: str, failures: dict) -> None:
        super().__init__(msg, failures)
        self._failures = dict(failures)

    @property
    def failures(self) -> dict:
        """``{rank: (exception, traceback.StackSummary or None)}`` for each failing rank."""
        return self._failures

    def __str__(self) -> str:
        lines = [f"CheckpointException ranks:{sorted(self._failures)}"]
        for rank, (exc, trace) in sorted(self._failures.items()):
            lines.append(f"rank {rank}:")
            if trace is not None:
                lines.append("".join(traceback.format_list(trace)).rstrip())
            lines.append("".join(traceback.format_exception_only(type(exc), exc)).rstrip())
        return "\n".join(lines)


class CheckpointError(ValueError, CheckpointException):
    """A checkpoint or a state dict that cannot be saved or loaded; the message says why.

    Raised on every rank together: ranks share what each found before anyone raises, and
    each line of the message ends with the ranks that found it (``[rank 0, 1]``) when more
    than one process takes part. ``failures`` (PyTorch's ``CheckpointException`` field)
    maps each of those ranks to a ``CheckpointError`` holding its own lines.

    Example::

        >>> raise CheckpointError("rank-00001.safetensors: 12 bytes, expected 4096")
        Traceback (most recent call last):
        ...
        dtensor.checkpoint.errors.CheckpointError: rank-00001.safetensors: 12 bytes, expected 4096
    """

    def __init__(self, msg: str = "", failures: dict | None = None) -> None:
        ValueError.__init__(self, msg)
        self._failures = dict(failures) if failures is not None else None

    def __str__(self) -> str:
        return ValueError.__str__(self)

    @property
    def failures(self) -> dict:
        """``{rank: (CheckpointError, None)}``: the lines of the message each rank reported.

        Built from the ``[rank ...]`` suffixes of the message when not given; a line without
        one (a single-process run, or a problem found before any exchange) counts for this
        process's rank (0 without a process group).
        """
        if self._failures is not None:
            return self._failures
        per_rank: dict[int, list[str]] = {}
        for line in str(self).splitlines():
            m = _RANKS.match(line)
            ranks = [int(r) for r in m["ranks"].split(", ")] if m else [_this_rank()]
            for r in ranks:
                per_rank.setdefault(r, []).append(m["msg"] if m else line)
        return {r: (CheckpointError("\n".join(lines), {}), None) for r, lines in per_rank.items()}


def _this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
