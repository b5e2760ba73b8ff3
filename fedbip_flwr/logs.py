"""Log lines from the library reach the Flower log stream (``flwr run --stream`` / ``flwr log``);
an exception quoted in one of them, or in an error for a person, stays one bounded line."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: int = logging.INFO) -> None:
    """Attach one stderr handler to the library's logger (idempotent), and keep off the console
    what the user can do nothing about: Ray's notice, in a simulation, that a future release
    will stop overriding accelerator variables when no GPU is asked for (this project asks for
    none: the future behaviour is the one it wants)."""
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    logger = logging.getLogger("fedbip_flwr")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def short_reason(err: BaseException) -> str:
    """First line of an exception, bounded: messages end up in logs and terminals."""
    lines = str(err).splitlines() or [type(err).__name__]
    return lines[0][:200]
