"""Pages of the listing calls (ListEngines, ListTransfers, AIP-158), for the service's records and the SDK's views.

The service pages its `Engine` and `Transfer` records, the SDK the `EngineInfo` and `TransferInfo` it reads back:
one page type each, over what it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rendezvous.protocol.incarnation import Incarnation
from rendezvous.protocol.transfer import TransferRecord

E = TypeVar("E", bound=Incarnation)
T = TypeVar("T", bound=TransferRecord)


@dataclass(frozen=True, slots=True)
class EnginePage(Generic[E]):
    """One page of ListEngines; pass next_page_token back for the next ("" on the last page)."""

    engines: Sequence[E]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class TransferPage(Generic[T]):
    """One page of ListTransfers; pass next_page_token back for the next ("" on the last page)."""

    transfers: Sequence[T]
    next_page_token: str
