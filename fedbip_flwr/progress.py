"""Progress of long work as log lines, never as a redrawn bar.

A run's output reaches a person through Flower's log stream (``flwr run --stream``, ``flwr
log``), which carries whole lines: a terminal bar's carriage returns arrive glued to the next
log line, and from a simulation's ClientApp actors every redraw becomes a line of its own. So
long work reports itself as lines: at most one every ``every_s`` seconds while it runs, then
one when it ends, with its count, time and rate.
"""

from __future__ import annotations

import logging
import time


class Progress:
    """``done`` of ``total`` ``unit`` of the work named ``what``, logged as it goes."""

    def __init__(
        self, log: logging.Logger, what: str, total: int, unit: str, every_s: float = 15.0
    ) -> None:
        self.log, self.what, self.total, self.unit, self.every_s = log, what, total, unit, every_s
        self.done = 0
        self.started = self.last = time.perf_counter()

    def update(self, n: int = 1, note: str = "") -> None:
        """``n`` more done; a line where ``every_s`` has passed since the last one."""
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            self.log.info(
                "%s: %d/%d %s (%s)%s",
                self.what,
                self.done,
                self.total,
                self.unit,
                self._rate(now),
                f", {note}" if note else "",
            )

    def _rate(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        return f"{self.done / elapsed:.1f} {self.unit}/s"

    def finish(self, note: str = "") -> float:
        """The closing line: what was done, in how long; the seconds it took."""
        now = time.perf_counter()
        self.log.info(
            "%s: %d %s in %.1f s (%s)%s",
            self.what,
            self.done,
            self.unit,
            now - self.started,
            self._rate(now),
            f"; {note}" if note else "",
        )
        return now - self.started
