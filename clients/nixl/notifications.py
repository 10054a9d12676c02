"""The NIXL notifications that accompany a transfer's bytes (data-plane version 3).

A notification is "<version> <entry>[ <entry>...]" in UTF-8, one entry per transfer whose bytes the WRITE it came
with carried (the parts of several transfers may go in one WRITE). An entry is either

- whole: "<transfer_id>:<generation>[/<writers>]", the producer rank wrote its whole share of the generation
  (with this WRITE, or this one was its last), or
- parts: "<transfer_id>:<generation>/<writers>@<layers>=<part>[,<part>...]", this WRITE carried these
  rectangles of a target written in parts (progressive push). `<layers>` is the share of the consumer rank that
  this producer rank writes, "<first>-<stop>" (model layers [first, stop)) or "*" (every layer the consumer
  rank holds); a part is "<first_token>+<num_tokens>" (all of those layers) or
  "<first_token>+<num_tokens>x<first_layer>+<num_layers>", in the target's tokens (0 = its first).

Either may end in "#<digest>,<digest>,...": per region of the consumer rank, the 16-hex-digit xxh3-64 of all of
the target's blocks, in its order (end-to-end integrity, `rendezvous.clients.nixl.integrity`): with a whole entry,
what the write carried; with a parts entry, the final's, what the parts carried together. A producer rank that
writes only some of the consumer rank's bytes (other head counts, block sizes or layers: data-plane version 4)
says which: "#<first>-<stop>/<head>+<heads>/<tokens>=<digest>,...", per consumer region of [first, stop), the
xxh3-64 of the bytes of heads [head, head + heads) (the consumer rank's own numbering) of the target's first
`tokens` tokens, in ascending address order (`DigestScope`).

`<version>` is the data-plane version that wrote it (rendezvous.protocol.dataplane); transfer ids hold no
whitespace and the generation is what follows an entry's last ':', so ids may contain ':' and the untagged form
of version 1 ("<transfer_id>:<generation>[/<writers>]") reads too. Versions 1 and 2 have whole entries only.

NIXL delivers a notification only after the WRITE posted with it landed, so a consumer learns from it which of
its blocks hold the bytes: all of a generation's once every one of `writers` senders (0 = unknown: wait for
TRANSFER_COMMITTED) sent a whole entry, and for a progressive target once each sender's parts tile its share
(`rendezvous.clients.nixl.arrival`). A notification for a generation no longer expected is ignored (fencing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rendezvous.protocol.dataplane import DATA_PLANE_VERSION, READS
from rendezvous.protocol.records import WrittenPart

__all__ = [
    "DigestScope",
    "PartsEntry",
    "TransferNotification",
    "encode_notification",
    "encode_parts",
    "parse_notification",
]


@dataclass(frozen=True, slots=True)
class DigestScope:
    """What a producer rank's digests cover of a consumer rank's target: regions `regions` (one digest each),
    heads [first_head, first_head + num_heads) of the consumer rank, the target's first `tokens` tokens."""

    regions: range
    first_head: int
    num_heads: int
    tokens: int

    def __str__(self) -> str:
        return f"{self.regions.start}-{self.regions.stop}/{self.first_head}+{self.num_heads}/{self.tokens}"


@dataclass(frozen=True, slots=True)
class TransferNotification:
    """One entry of a notification received from agent `sender`."""

    sender: str
    transfer_id: str
    generation: int
    writers: int = 1
    """Producer ranks whose notifications together say the consumer rank's blocks have landed (0 = unknown)."""
    layers: range | None = None
    """Parts only: the model layers of the consumer rank this sender writes (None: every one it holds)."""
    parts: tuple[WrittenPart, ...] | None = None
    """The rectangles this WRITE carried (`num_layers` 0: all of `layers`); None for a whole entry."""
    digests: tuple[int, ...] = ()
    """Integrity: per region, the xxh3-64 of all the target's blocks as written (() when the producer sent none)."""
    scope: DigestScope | None = None
    """Integrity: what `digests` cover, when the sender wrote only some of the rank's bytes (None: all of them)."""


@dataclass(frozen=True, slots=True)
class PartsEntry:
    """What one WRITE carried of one transfer written in parts, to encode (`encode_parts`)."""

    transfer_id: str
    generation: int
    writers: int
    layers: range | None
    parts: tuple[WrittenPart, ...]
    digests: tuple[int, ...] = ()
    scope: DigestScope | None = None


_TAG = f"{DATA_PLANE_VERSION} "


def encode_notification(
    transfer_id: str,
    generation: int,
    writers: int = 1,
    digests: tuple[int, ...] = (),
    scope: DigestScope | None = None,
) -> bytes:
    """The whole-entry notification for one generation of a transfer, written by `writers` producer ranks."""
    suffix = "" if writers == 1 else f"/{writers}"
    return f"{_TAG}{transfer_id}:{generation}{suffix}{_digests(digests, scope)}".encode()


def encode_parts(entries: Sequence[PartsEntry]) -> bytes:
    """The notification of a WRITE that carried these parts (of one or several transfers)."""
    return (_TAG + " ".join(_entry(e) for e in entries)).encode()


def _entry(e: PartsEntry) -> str:
    layers = "*" if e.layers is None else f"{e.layers.start}-{e.layers.stop}"
    parts = ",".join(
        f"{p.first_token}+{p.num_tokens}" + (f"x{p.first_layer}+{p.num_layers}" if p.num_layers else "")
        for p in e.parts
    )
    return f"{e.transfer_id}:{e.generation}/{e.writers}@{layers}={parts}{_digests(e.digests, e.scope)}"


def _digests(digests: tuple[int, ...], scope: DigestScope | None) -> str:
    if not digests:
        return ""
    return "#" + (f"{scope}=" if scope is not None else "") + ",".join(f"{d:016x}" for d in digests)


def parse_notification(sender: str, payload: bytes) -> tuple[TransferNotification, ...] | None:
    """The entries in `payload`, or None when it is not a notification of a version this data plane reads."""
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return None
    version, space, rest = text.partition(" ")
    if space:
        if not _number(version) or int(version) not in READS[DATA_PLANE_VERSION]:
            return None
        entries = rest.split(" ") if int(version) >= 3 else [rest]
    else:
        entries = [text]
    parsed = tuple(_parse_entry(sender, entry) for entry in entries)
    return None if any(n is None for n in parsed) else tuple(n for n in parsed if n is not None)


def _parse_entry(sender: str, entry: str) -> TransferNotification | None:
    transfer_id, sep, tail = entry.rpartition(":")
    tail, hashed, listed_digests = tail.partition("#")
    scope: DigestScope | None = None
    if "=" in listed_digests:
        described_scope, _, listed_digests = listed_digests.partition("=")
        scope = _scope(described_scope)
        if scope is None:
            return None
    digests = tuple(int(d, 16) for d in listed_digests.split(",") if _hex(d)) if hashed else ()
    if hashed and len(digests) != len(listed_digests.split(",")):
        return None
    if scope is not None and len(digests) != len(scope.regions):
        return None
    head, at, described = tail.partition("@")
    generation, slash, writers = head.partition("/")
    if not sep or not transfer_id or not _number(generation) or (slash and not _number(writers)):
        return None
    count = int(writers) if slash else 1
    if not at:
        return TransferNotification(sender, transfer_id, int(generation), count, digests=digests, scope=scope)
    span, equals, listed = described.partition("=")
    layers = _layers(span)
    parts = [_part(p) for p in listed.split(",")] if equals and listed else []
    if not slash or layers is False or not parts or any(p is None for p in parts):
        return None
    return TransferNotification(
        sender,
        transfer_id,
        int(generation),
        count,
        layers if isinstance(layers, range) else None,
        tuple(p for p in parts if p is not None),
        digests,
        scope,
    )


def _scope(text: str) -> DigestScope | None:
    """ "<first>-<stop>/<head>+<heads>/<tokens>" -> DigestScope; None when malformed."""
    span, slash, rest = text.partition("/")
    heads, slash_2, tokens = rest.partition("/")
    regions, (head, plus, count) = _layers(span), heads.partition("+")
    if not slash or not slash_2 or not plus or not isinstance(regions, range):
        return None
    if not (_number(head) and _number(count) and _number(tokens)) or not int(count) or not int(tokens):
        return None
    return DigestScope(regions, int(head), int(count), int(tokens))


_MAX_SPAN = 1 << 16
"""The most layers or regions a span may name (no engine rank holds more): a longer one is malformed, not a range
whose `len()` overflows."""


def _layers(text: str) -> range | bool | None:
    """ "*" -> None, "<first>-<stop>" -> range; False when malformed."""
    if text == "*":
        return None
    first, dash, stop = text.partition("-")
    if not dash or not _number(first) or not _number(stop) or not 0 < int(stop) - int(first) <= _MAX_SPAN:
        return False
    return range(int(first), int(stop))


def _part(text: str) -> WrittenPart | None:
    tokens, x, layers = text.partition("x")
    first_token, plus, num_tokens = tokens.partition("+")
    if not plus or not _number(first_token) or not _number(num_tokens):
        return None
    if not x:
        return WrittenPart(int(first_token), int(num_tokens), 0, 0)
    first_layer, plus, num_layers = layers.partition("+")
    if not plus or not _number(first_layer) or not _number(num_layers) or not int(num_layers):
        return None
    return WrittenPart(int(first_token), int(num_tokens), int(first_layer), int(num_layers))


def _hex(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def _number(text: str) -> bool:
    """A decimal of at most 20 digits (a uint64): longer ones are malformed, not a slow or failing `int()`."""
    return 0 < len(text) <= 20 and text.isdigit() and text.isascii()
