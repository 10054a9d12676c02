"""The protocol's enums print by name and still compare, format and travel as their wire numbers."""

from __future__ import annotations

import json
from enum import IntEnum

import pytest

from rendezvous.protocol import enums

WIRE_ENUMS = [
    enums.EngineRole,
    enums.MemoryKind,
    enums.TransferState,
    enums.TransferMode,
    enums.AbortReason,
    enums.EventType,
    enums.CompletionOutcome,
]


@pytest.mark.parametrize("enum", WIRE_ENUMS, ids=lambda e: e.__name__)
def test_str_and_format_print_the_name(enum: type[IntEnum]) -> None:
    for member in enum:
        assert str(member) == member.name
        assert f"{member}" == member.name
        assert f"state {member}!" == f"state {member.name}!"


def test_a_format_spec_pads_the_name_and_a_number_type_asks_for_the_number() -> None:
    state = enums.TransferState.COMMITTED
    assert f"{state:>10}" == " COMMITTED"
    assert f"{state:d}" == "4" and f"{state:x}" == "4"


def test_members_still_equal_their_wire_numbers() -> None:
    state = enums.TransferState.COMMITTED
    assert state == 4 and int(state) == 4 and format(state, "d") == "4"
    assert json.dumps([state, enums.AbortReason.PEER_LOST]) == "[4, 3]"
    assert str(enums.AbortReason(99)) == "UNSPECIFIED"
