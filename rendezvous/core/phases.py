"""The phases of a transfer, from the times its record keeps: named once for the service's phase
histograms and for `kv-rendezvous transfers --timeline`.

A phase runs from one recorded moment to a later one and has a duration once both happened. A phase
whose end came first (a pull source ready before the match) lasted 0: nothing on the path waited for it.
"""

from __future__ import annotations

from rendezvous.core.model import TransferTimes

PHASES: dict[str, tuple[str, str]] = {
    "target_to_match": ("target", "match"),
    "claim_to_match": ("claim", "match"),
    "match_to_source_ready": ("match", "source_ready"),
    "match_to_commit": ("match", "commit"),
    "source_ready_to_commit": ("source_ready", "commit"),
    "commit_to_release": ("commit", "release"),
    "total": ("first", "release"),
}
"""Each phase's name and the moments it runs between: a field of `TransferTimes`, `release` (the end of a
released transfer; an aborted one has none) or `first` (the earlier of target and claim)."""


def _moments(times: TransferTimes, released: bool) -> dict[str, float]:
    """The moments a transfer has reached, by name (see `PHASES`); those not reached are left out."""
    named = {
        "target": times.target,
        "claim": times.claim,
        "match": times.match,
        "source_ready": times.source_ready,
        "commit": times.commit,
        "release": times.end if released else 0.0,
        "first": min((t for t in (times.target, times.claim) if t), default=0.0),
    }
    return {name: t for name, t in named.items() if t}


def durations(times: TransferTimes, released: bool) -> dict[str, float]:
    """The duration in seconds of every phase whose two moments have happened, in `PHASES` order."""
    reached = _moments(times, released)
    return {
        phase: max(0.0, reached[end] - reached[start])
        for phase, (start, end) in PHASES.items()
        if start in reached and end in reached
    }
