"""On/off switches read from the environment, one reading for the whole library.

Every switch reads ``1``, ``true``, ``yes`` and ``on`` as on and ``0``, ``false``, ``no`` and
``off`` as off, in any case and with spaces around; an unset or empty variable leaves the
default; anything else is an error that names the variable, its value and what it accepts
(a typo must not silently pick a side).

Example:
    >>> env_switch("FSDP2_CHECK_FREED")     # run as FSDP2_CHECK_FREED=false python train.py
    False
    >>> env_switch("UNSET_VARIABLE", default=None) is None
    True
"""

from __future__ import annotations

import os

__all__ = ["env_switch", "ON", "OFF"]

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: bool | None = False) -> bool | None:
    """The switch ``name`` from the environment, or ``default`` when it is unset or empty.

    Raises:
        ValueError: a value that is neither on nor off, naming the variable and its value.

    Example:
        >>> env_switch("DTENSOR_CHECK_SHARDS")      # unset: the default, off
        False
    """
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ON:
        return True
    if raw in OFF:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected on ({', '.join(ON)}) or off "
        f"({', '.join(OFF)}), or unset for the default."
    )
