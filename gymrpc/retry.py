"""Retry policy: bounded by an overall deadline, exponential backoff with full jitter."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import ClassVar


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a call is retried after a retryable failure.

    Retries are bounded by time, not count: a server that restarts in 2 s should not
    exhaust a count meant for one that restarts in 50 ms.
    """

    deadline: float = 60.0
    """Seconds from the first attempt after which the call fails with DEADLINE_EXCEEDED."""
    initial_backoff: float = 0.05
    """First sleep bound, in seconds."""
    max_backoff: float = 1.0
    """Upper bound of any one sleep, in seconds."""
    multiplier: float = 2.0
    """Growth of the sleep bound per retry."""
    registry_grace: float = 20.0
    """Seconds the registry may stay silent while a call needs it before the call fails with
    `RegistryUnavailable` (the stack is gone); a supervised registry is back well within it."""

    default: ClassVar[RetryPolicy]

    def with_deadline(self, deadline: float) -> RetryPolicy:
        return replace(self, deadline=deadline)

    def delays(self) -> Iterator[float]:
        """Sleeps to take between attempts: uniform in [0, bound] (full jitter), bound growing."""
        bound = self.initial_backoff
        while True:
            yield random.uniform(0, bound)
            bound = min(bound * self.multiplier, self.max_backoff)


RetryPolicy.default = RetryPolicy()
