"""torch's fake-tensor mode logs, at ERROR and with a traceback, every op whose meta kernel raises, before the error
propagates. distcore runs model code on fake tensors or DTensors (whose sharding propagation runs ops on fake
tensors) to find out whether it can: the block check's tensor-parallel copies, the pipeline's probe forward. There a
failure is an expected answer, reported once and by name by the caller; torch's tracebacks, one per rank and run,
read like a crash of the user's training. `expected_failures_unlogged` raises that logger to CRITICAL for the
duration and restores its level."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def expected_failures_unlogged():
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
