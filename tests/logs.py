"""The spmd_compiler log, captured: ``with spmd_log() as records: ...``."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def spmd_log(level: int = logging.INFO) -> Iterator[list[logging.LogRecord]]:
    """The records the ``spmd_compiler`` logger writes inside the block, at ``level`` and above
    (the logger is set to ``level`` meanwhile, then put back)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append
    logger = logging.getLogger("spmd_compiler")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def messages(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records]
