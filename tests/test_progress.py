"""Progress of long work as log lines (fedbip_flwr/progress.py): none more often than asked,
and a closing line with the count, the time and the rate."""

from __future__ import annotations

import logging

import pytest

from fedbip_flwr import progress
from fedbip_flwr.progress import Progress


def test_lines_come_at_most_once_per_interval_and_the_last_one_says_it_all(caplog, monkeypatch):
    clock = iter([0.0, 1.0, 20.0, 21.0, 50.0, 60.0])  # start, then one reading per call
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        work = Progress(log, "synthesis", total=40, unit="images", every_s=15.0)
        work.update(10)  # t = 1: too soon
        work.update(10, note="batch 2")  # t = 20: a line
        work.update(10)  # t = 21: too soon after it
        work.update(10)  # t = 50: the last ones, no line: the closing one says it
        seconds = work.finish("done")  # t = 60
    assert seconds == pytest.approx(60.0)
    assert [r.getMessage() for r in caplog.records] == [
        "synthesis: 20/40 images (1.0 images/s), batch 2",
        "synthesis: 40 images in 60.0 s (0.7 images/s); done",
    ]
