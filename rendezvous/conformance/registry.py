"""The checks of the suite: each a named coroutine in a group, registered by the `check` decorator."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rendezvous.conformance.driver import Scenario

GROUPS = ("lifecycle", "arrival", "aborts", "lease_loss", "revocation", "watch", "errors")
"""Report order."""

CheckFn = Callable[["Scenario"], Awaitable[None]]


@dataclass(frozen=True)
class Check:
    """One check: it passes when its coroutine returns, fails when it raises."""

    group: str
    name: str
    summary: str
    fn: CheckFn

    @property
    def full_name(self) -> str:
        """`group.name`, what `--only` matches and the report prints."""
        return f"{self.group}.{self.name}"


CHECKS: list[Check] = []
"""Every check, in report order (filled as the check modules are imported)."""


def check(group: str) -> Callable[[CheckFn], CheckFn]:
    """Register a check in a group; its name is the function's, its summary the docstring's first line."""
    if group not in GROUPS:
        raise ValueError(f"unknown check group {group!r}")

    def register(fn: CheckFn) -> CheckFn:
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        CHECKS.append(Check(group, fn.__name__, summary, fn))
        CHECKS.sort(key=lambda c: GROUPS.index(c.group))
        return fn

    return register
