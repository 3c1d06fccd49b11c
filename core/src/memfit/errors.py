"""Exceptions and warnings raised by memfit.

Every error names what is wrong and how to fix it; nothing is silently ignored
unless SPEC §1 says "warn and ignore", and then it is a :class:`MemfitWarning`
emitted once per model.
"""

from __future__ import annotations


class MemfitError(RuntimeError):
    """Base class of every error memfit raises."""


class ConfigError(MemfitError, ValueError):
    """A configuration key has a bad value, or the key itself is unknown."""


class UnsupportedBoundaryError(MemfitError):
    """A scope was requested that the model family has not declared safe.

    Example: ``torch-ffn`` on a family without an FFN boundary.
    """


class NotAvailableError(MemfitError):
    """A feature that exists in the config schema but cannot run here."""


class HostMemoryError(MemfitError):
    """The offload pool cannot get the host memory a parked tensor needs (host RAM, its cap, or pinning)."""


class DeviceMemoryError(MemfitError):
    """The part of the model that stays on the device does not fit there (``memfit.apply(..., device=)``)."""


class MemfitWarning(UserWarning):
    """A setting was ignored or disabled on purpose (e.g. interval on a family without interval support)."""


class BudgetError(MemfitError):
    """The ``auto`` backend's memory budget is below the smallest peak any plan reaches.

    Attributes:
        smallest_peak_bytes: the smallest predicted peak.
        suggested_budget_bytes: the budget to set: a little above the smallest peak, since a later profile can see
            a few MiB more allocated (default: the smallest peak itself).
    """

    def __init__(
        self, message: str, *, smallest_peak_bytes: int, suggested_budget_bytes: int | None = None
    ) -> None:
        super().__init__(message)
        self.smallest_peak_bytes = smallest_peak_bytes
        self.suggested_budget_bytes = (
            smallest_peak_bytes if suggested_budget_bytes is None else suggested_budget_bytes
        )
