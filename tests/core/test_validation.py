"""check_id's rule (non-empty, bounded, printable, no whitespace) over every code point this Python knows."""

from __future__ import annotations

import sys

import pytest

from rendezvous.core.limits import Limits
from rendezvous.core.validation import check_id
from rendezvous.protocol.errors import Reason, RendezvousError

LIMITS = Limits()


def refused(value: str) -> str | None:
    try:
        check_id("transfer_id", value, LIMITS)
    except RendezvousError as err:
        return err.reason
    return None


def test_every_code_point_is_judged_as_printable_and_not_whitespace() -> None:
    # The rule as the docstring states it, one code point at a time, against the check's answer for "t" + it.
    wrong = [
        hex(i)
        for i in range(sys.maxunicode + 1)
        if (refused(f"t{chr(i)}") is None) != (chr(i).isprintable() and not chr(i).isspace())
    ]
    assert wrong == []


@pytest.mark.parametrize("value", ["a b", "a\tb", "a\u00a0b", "a\u3000b", "a\u2028b", "a\nb", "\x00"])
def test_ids_with_whitespace_or_unprintables_are_invalid(value: str) -> None:
    assert refused(value) is Reason.ID_INVALID


def test_plain_and_unicode_ids_pass() -> None:
    assert refused("req-1:prefill/0") is None and refused("zürich-日本") is None
