"""The core's record builders: `evolve` is `dataclasses.replace`, and `positional` and `keywords` are the class's own
`__init__`, for records of one layer (TransferTimes, Event) and for `Transfer`, which extends the protocol's record."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rendezvous.core.model import (
    Event,
    EventType,
    Mode,
    State,
    Transfer,
    TransferTimes,
    evolve,
    keywords,
    positional,
)

TRANSFER = Transfer("t", State.MATCHED, 10.0, Mode.PULL, 2, "c", 1, "p", 3, (1, 2), (3, 4), 32)

changes = st.fixed_dictionaries(
    {},
    optional={
        "state": st.sampled_from(State),
        "deadline": st.floats(0, 1e10),
        "generation": st.integers(0, 9),
        "source_block_ids": st.none() | st.lists(st.integers(0, 9)).map(tuple),
        "reported_ranks": st.lists(st.integers(0, 9)).map(tuple),
        "progressive": st.booleans(),
        "assigned_generation": st.integers(0, 9),
        "block_digests": st.text(max_size=4),
    },
)


@given(changes)
def test_evolve_is_replace(change: dict[str, Any]) -> None:
    copy = evolve(TRANSFER, **change)
    assert type(copy) is Transfer and copy == dataclasses.replace(TRANSFER, **change)
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.state = State.ABORTED  # type: ignore[misc]


@pytest.mark.parametrize(
    "record", [TRANSFER, TransferTimes(1.0, 2.0, 3.0, 4.0, 5.0, 6.0), Event(EventType.TRANSFER_ASSIGNED, 1.0, TRANSFER)]
)
def test_positional_is_the_classes_init(record: Any) -> None:
    values = [getattr(record, f.name) for f in dataclasses.fields(record)]
    built = positional(type(record))(*values)
    assert type(built) is type(record) and built == type(record)(*values) == record
    assert not hasattr(built, "__dict__")


@given(changes)
def test_keywords_is_the_classes_init(change: dict[str, Any]) -> None:
    given_ = {"transfer_id": "t", "state": State.TARGETED, "deadline": 1.0, **change}
    built = keywords(Transfer)(**given_)
    assert type(built) is Transfer and built == Transfer(**given_)
    assert built.times == TransferTimes() and built.times is not keywords(Transfer)(**given_).times  # a factory's
    assert not hasattr(built, "__dict__")
    with pytest.raises(TypeError):
        keywords(Transfer)(state=State.TARGETED, deadline=1.0)  # transfer_id has no default


def test_evolve_refuses_a_field_the_record_lacks() -> None:
    with pytest.raises(TypeError):
        evolve(TRANSFER, nonexistent=1)
