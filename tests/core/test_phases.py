"""`phases.ended` against its definition: a phase ends at the transition after which both its moments have
happened and before which they had not, lasting what `phases.durations` says."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rendezvous.core import phases
from rendezvous.protocol.records import TransferTimes

_FIELDS = ("target_time", "claim_time", "match_time", "source_ready_time", "commit_time", "end_time")
_moment = st.sampled_from([0.0, 1.0, 2.5, 4.0])


@st.composite
def transitions(draw: st.DrawFn) -> tuple[TransferTimes | None, bool, TransferTimes, bool]:
    """Times before (None: a new transfer) and after a transition; after keeps every moment before had."""
    before = None if draw(st.booleans()) else TransferTimes(**{f: draw(_moment) for f in _FIELDS})
    after = TransferTimes(**{f: getattr(before, f, 0.0) or draw(_moment) for f in _FIELDS})
    was_released = before is not None and draw(st.booleans())
    return before, was_released, after, was_released or draw(st.booleans())


@given(transitions())
def test_ended_is_what_durations_gained(transition: tuple[TransferTimes | None, bool, TransferTimes, bool]) -> None:
    before, was_released, after, released = transition
    had = phases.durations(before, was_released) if before is not None else {}
    expected = [(phase, seconds) for phase, seconds in phases.durations(after, released).items() if phase not in had]
    assert phases.ended(before, was_released, after, released) == expected


def test_a_transition_that_leaves_the_times_alone_ends_nothing() -> None:
    times = TransferTimes(target_time=1.0, claim_time=2.0, match_time=2.0)
    assert phases.ended(times, False, times, False) == []
    assert phases.ended(None, False, times, False) == [("target_to_match", 1.0), ("claim_to_match", 0.0)]
