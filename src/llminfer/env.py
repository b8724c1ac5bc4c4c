"""On/off switches read from the environment, one rule for all of llminfer's ``LLMINFER_*`` flags."""

from __future__ import annotations

import os

__all__ = ["env_flag"]

_OFF = frozenset({"0", "false", "off", "no"})


def env_flag(name: str, default: bool = True) -> bool:
    """Whether the switch ``$name`` is on: False for ``0`` / ``false`` / ``off`` / ``no`` (any case, spaces
    ignored), True for any other value, ``default`` where it is unset. Raises nothing."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _OFF
