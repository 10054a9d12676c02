"""The SDK's Reason enum names exactly the reasons the server can send."""

from __future__ import annotations

from clients import Reason as ClientReason
from rendezvous.core.errors import REASON_CODES
from rendezvous.core.errors import Reason as ServerReason


def test_client_and_server_reasons_match() -> None:
    assert {r.value for r in ClientReason} == {r.value for r in ServerReason}


def test_every_server_reason_has_a_code() -> None:
    assert set(REASON_CODES) == set(ServerReason)
