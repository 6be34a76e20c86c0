"""The `sparsekv` logger, and messages said at most once per process (a chat app must not fill its log)."""

from __future__ import annotations

import logging
from typing import Hashable

logger = logging.getLogger("sparsekv")
_said: set[Hashable] = set()


def say_once(key: Hashable, message: str) -> None:
    """Log `message` as a warning the first time `key` is seen in this process; later calls say nothing."""
    if key not in _said:
        _said.add(key)
        logger.warning(message)
