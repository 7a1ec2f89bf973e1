"""The one retry/backoff policy: bounded tries, exponential delay with a cap and jitter."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3  # tries after the first; 0 = try once
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def __post_init__(self):
        if self.max_retries < 0 or self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError(f"invalid retry policy {self}")

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based): base * 2^(attempt-1), capped, +-25% jitter."""
        delay = min(self.max_delay_s, self.base_delay_s * 2.0 ** min(max(0, attempt - 1), 64))
        return delay * (0.75 + 0.5 * (rng or random).random())
