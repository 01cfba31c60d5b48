"""The one exception type checkpoint code raises for bad checkpoints and bad state dicts."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint or a state dict that cannot be saved or loaded; the message says why.

    Raised on every rank together: ranks share what each found before anyone raises.

    Example::

        >>> raise CheckpointError("rank-00001.safetensors: 12 bytes, expected 4096")
        Traceback (most recent call last):
        ...
        dtensor.checkpoint.errors.CheckpointError: rank-00001.safetensors: 12 bytes, expected 4096
    """
