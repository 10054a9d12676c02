"""The phases of a transfer, from the times its record keeps: named once for the service's phase
histograms and for `kv-rendezvous transfers --timeline`.

A phase runs from one recorded moment to a later one and has a duration once both happened. A phase
whose end came first (a pull source ready before the match) lasted 0: nothing on the path waited for it.
"""

from __future__ import annotations

from rendezvous.protocol.records import TransferTimes

PHASES: dict[str, tuple[str, str]] = {
    "target_to_match": ("target", "match"),
    "claim_to_match": ("claim", "match"),
    "match_to_source_ready": ("match", "source_ready"),
    "match_to_commit": ("match", "commit"),
    "source_ready_to_commit": ("source_ready", "commit"),
    "commit_to_release": ("commit", "release"),
    "total": ("first", "release"),
}
"""Each phase's name and the moments it runs between: a field of `TransferTimes` (less `_time`), `release` (the end of a
released transfer; an aborted one has none) or `first` (the earlier of target and claim)."""


_MOMENTS = ("target", "claim", "match", "source_ready", "commit", "release", "first")
_SPANS = tuple((phase, _MOMENTS.index(start), _MOMENTS.index(end)) for phase, (start, end) in PHASES.items())


def _moments(times: TransferTimes, released: bool) -> tuple[float, ...]:
    """The transfer's moments in `_MOMENTS` order (0.0: not reached). Cheap: the service computes them on
    every transition."""
    target, claim = times.target_time, times.claim_time
    first = min(target, claim) if target and claim else target or claim
    end = times.end_time if released else 0.0
    return (target, claim, times.match_time, times.source_ready_time, times.commit_time, end, first)


def durations(times: TransferTimes, released: bool) -> dict[str, float]:
    """The duration in seconds of every phase whose two moments have happened, in `PHASES` order."""
    m = _moments(times, released)
    return {phase: max(0.0, m[end] - m[start]) for phase, start, end in _SPANS if m[start] and m[end]}


def ended(
    before: TransferTimes | None, was_released: bool, after: TransferTimes, released: bool
) -> list[tuple[str, float]]:
    """The phases a transition from `before` (None: a new transfer) to `after` completed, with their durations:
    those whose two moments have both happened now and had not both happened before."""
    if before is after and was_released == released:  # the transition left the times alone
        return []
    reached = _reached(after, released)
    key = (_reached(before, was_released) if before is not None else 0) << len(_MOMENTS) | reached
    spans = _ENDED.get(key)
    if spans is None:  # which moments have happened decides which phases end: worked out once per pattern
        spans = _ENDED[key] = tuple(
            span for span in _SPANS if _both(reached, span) and not _both(key >> len(_MOMENTS), span)
        )
    if not spans:
        return []
    new = _moments(after, released)
    return [(phase, max(0.0, new[end] - new[start])) for phase, start, end in spans]


def _reached(times: TransferTimes, released: bool) -> int:
    """The moments reached, as bits in `_MOMENTS` order (bit 0: target)."""
    bits = (
        (times.target_time > 0)
        | (times.claim_time > 0) << 1
        | (times.match_time > 0) << 2
        | (times.source_ready_time > 0) << 3
        | (times.commit_time > 0) << 4
        | (released and times.end_time > 0) << 5
    )
    return bits | 64 if bits & 3 else bits  # first: target or claim


def _both(reached: int, span: tuple[str, int, int]) -> bool:
    return bool(reached >> span[1] & 1 and reached >> span[2] & 1)


_ENDED: dict[int, tuple[tuple[str, int, int], ...]] = {}
"""The phases that end between two patterns of moments reached, keyed by the patterns' bits (before, after; at
most 2^14 entries, a few dozen occur)."""
