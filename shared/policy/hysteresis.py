"""Confirmation on consecutive checks: a decision is acted on only once it has held for a
while, because acting costs (a moved server downloads its new stage's state).

Pure logic, no I/O, no clock: a "check" is one call of :meth:`Confirmation.observe`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Confirmation(Generic[T]):
    """Counts the consecutive checks that found a candidate worth acting on.

    :meth:`observe` takes each check's candidate (``None``: nothing worth acting on). A
    candidate that is not ``same`` as the previous one starts the count again as its own
    first confirmation; ``None`` resets it. Once ``confirmations`` consecutive candidates
    were seen, :meth:`observe` returns them (oldest first) and the count starts again.
    """

    def __init__(self, confirmations: int, same: Callable[[T, T], bool] = lambda earlier, later: True):
        if confirmations < 1:
            raise ValueError(f"confirmations must be >= 1, got {confirmations}")
        self.confirmations = confirmations
        self._same = same
        self._streak: list[T] = []

    @property
    def seen(self) -> int:
        """Consecutive checks so far whose candidate is not yet confirmed."""
        return len(self._streak)

    def reset(self) -> None:
        self._streak = []

    def observe(self, candidate: T | None) -> list[T] | None:
        """This check's candidate; the confirmed streak (``confirmations`` candidates), or ``None``."""
        if candidate is None:
            self._streak = []
            return None
        if self._streak and not self._same(self._streak[-1], candidate):
            self._streak = []
        self._streak.append(candidate)
        if len(self._streak) < self.confirmations:
            return None
        confirmed, self._streak = self._streak, []
        return confirmed
