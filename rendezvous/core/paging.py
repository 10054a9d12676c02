"""Paging (AIP-158): page sizes, opaque page tokens bound to the listing they continue, byte-bounded chunks.

A page token is the id the page ended at with an HMAC-SHA256 (truncated to 16 bytes) over the listing's scope
and that id, under the deployment's page-token key (Store.page_token_key: random, made once, shared by every
replica of one store namespace). A forged or edited token, one of another listing (other filters) and one of
another deployment do not verify: PAGE_TOKEN_INVALID.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from rendezvous.protocol.errors import Reason, RendezvousError

T = TypeVar("T")


MAX_TOKEN_CHARS = 4_096
"""The longest page token decode_token reads (an issued one is far shorter: its listing's scope and one id)."""


def page_size(requested: int, default: int, maximum: int) -> int:
    """The page size to serve: the default when none was asked for, never above the maximum; a negative one is
    PAGE_SIZE_INVALID."""
    if requested < 0:
        raise RendezvousError(
            Reason.PAGE_SIZE_INVALID,
            f"page_size {requested} is negative; 0 asks for the server's default",
            field="page_size",
        )
    return min(requested or default, maximum)


_MAC_BYTES = 16


def _mac(key: bytes, scope: str, last_id: bytes) -> bytes:
    return hmac.digest(key, scope.encode() + b"\n" + last_id, hashlib.sha256)[:_MAC_BYTES]


def encode_token(key: bytes, scope: str, last_id: str) -> str:
    """A token that continues a listing after last_id. scope names the listing and its filters, so a
    token cannot continue another one; key signs it (see the module)."""
    raw = last_id.encode()
    return base64.urlsafe_b64encode(_mac(key, scope, raw) + raw).decode()


def decode_token(key: bytes, scope: str, token: str) -> str:
    """The id a token continues after ("" for no token); PAGE_TOKEN_INVALID unless this deployment issued it
    for this scope."""
    if not token:
        return ""
    if len(token) > MAX_TOKEN_CHARS:  # refused unread: decoding a huge token would be work for nothing
        raise RendezvousError(
            Reason.PAGE_TOKEN_INVALID,
            f"page_token is {len(token)} characters; this server issues at most {MAX_TOKEN_CHARS}",
            field="page_token",
            limit=MAX_TOKEN_CHARS,
        )
    try:
        raw = base64.b64decode(token.encode(), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    mac, last_id = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
    if not last_id or not hmac.compare_digest(mac, _mac(key, scope, last_id)):
        raise RendezvousError(
            Reason.PAGE_TOKEN_INVALID,
            "page_token is not one this server issued for this listing (same filters as the first page)",
            field="page_token",
        )
    return last_id.decode()


def chunks(items: Iterable[T], weigh: Callable[[T], int], budget: int) -> Iterator[list[T]]:
    """items in order, in consecutive lists that weigh at most budget in all, or of one item that alone
    weighs more. Lazy: a chunk is yielded once the item after it has been weighed, no later."""
    chunk: list[T] = []
    weight = 0
    for item in items:
        w = weigh(item)
        if chunk and weight + w > budget:
            yield chunk
            chunk, weight = [], 0
        chunk.append(item)
        weight += w
    if chunk:
        yield chunk


def cut(items: Sequence[T], size: int, weigh: Callable[[T], int], budget: int) -> list[T]:
    """A page of items: the first size, fewer if they weigh more than budget in all (one at least, if any)."""
    return next(chunks(items[:size], weigh, budget), [])


def weightless(_item: object) -> int:
    """The weight of an item whose size is not counted."""
    return 0


__all__ = ["chunks", "cut", "decode_token", "encode_token", "page_size", "weightless"]
