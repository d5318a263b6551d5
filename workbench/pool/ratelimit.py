"""Warnings about strangers, at a bounded rate: a flood of bad frames must not become a flood of log lines.

Every dropped message is still counted (`pool.rejected_messages`); only the
lines are limited: the first `burst` of each period are logged, the rest
are summed up in one line when the next period begins.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most `burst` lines per `period_s` through `logger.warning`; what was held back is reported as a count."""

    def __init__(self, logger: logging.Logger, burst: int = 5, period_s: float = 10.0) -> None:
        self.logger, self.burst, self.period_s = logger, burst, period_s
        self.period_start = float("-inf")
        self.in_period = 0
        self.suppressed = 0
        self.total = 0

    def warning(self, fmt: str, *args: object) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self.period_start >= self.period_s:
            if self.suppressed:
                self.logger.warning("workbench pool: %d more such warnings in the last %.0f s were not shown "
                                    "(every dropped message is counted in pool.rejected_messages)",
                                    self.suppressed, now - self.period_start)
            self.period_start, self.in_period, self.suppressed = now, 0, 0
        if self.in_period < self.burst:
            self.in_period += 1
            self.logger.warning(fmt, *args)
        else:
            self.suppressed += 1
