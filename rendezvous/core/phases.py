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
_NOT_YET = (0.0,) * len(_MOMENTS)


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
    new = _moments(after, released)
    old = _NOT_YET if before is None else _moments(before, was_released)
    key = (tuple(map(bool, old)), tuple(map(bool, new)))
    spans = _ENDED.get(key)
    if spans is None:  # which moments have happened decides which phases end: worked out once per pattern
        reached_before, reached = key
        spans = _ENDED[key] = tuple(
            span
            for span in _SPANS
            if reached[span[1]] and reached[span[2]] and not (reached_before[span[1]] and reached_before[span[2]])
        )
    return [(phase, max(0.0, new[end] - new[start])) for phase, start, end in spans]


_ENDED: dict[tuple[tuple[bool, ...], tuple[bool, ...]], tuple[tuple[str, int, int], ...]] = {}
"""The phases that end between two patterns of moments reached (at most 2^7 x 2^7 entries; a few dozen occur)."""
