"""Transfer bindings: the router's signed choice of a transfer's consumer and producer.

A router that shares a key with the service signs, for each request, the tuple (transfer id, consumer
engine id, producer engine id, expiry) with HMAC-SHA256 and sends the binding in both legs'
`kv_transfer_params`; each engine presents it with its half (TargetSpec.binding, ClaimSpec.binding,
SourceReadySpec.binding) and the service admits only the engine the binding names for that half. No call
is added to the request path: the router computes one HMAC, the service checks it.

Plain Python (no protobuf import), shared by the service (which verifies) and the SDK (whose router
signs). The MAC input, documented in proto/rendezvous/v1/rendezvous.proto (TransferBinding), is::

    b"kv-rendezvous.binding.v1"
    + for transfer_id, consumer_engine_id, producer_engine_id: 4-byte big-endian length + UTF-8 bytes
    + expire_time.seconds as an 8-byte big-endian signed integer

A key file holds one key per line (blank lines and lines starting with `#` are skipped); a line's bytes,
without surrounding whitespace, are the key, at least `MIN_KEY_BYTES` long (`openssl rand -hex 32`). The
router signs with the first key; the service accepts any, so a key is rotated by adding the new one
second, restarting the service, moving it first for the routers, then removing the old one.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_KEY_BYTES = 32
"""The shortest binding key a key file may hold."""

_DOMAIN = b"kv-rendezvous.binding.v1"
MAC_BYTES = 32

PARAMS_KEY = "kv_rendezvous_binding"
"""The `kv_transfer_params` key that carries a request's binding (a JSON object, `Binding.to_params`)."""


@dataclass(frozen=True, slots=True)
class Binding:
    """A transfer bound to a consumer and a producer until `expires_at` (whole Unix seconds)."""

    consumer_engine_id: str
    producer_engine_id: str
    expires_at: int
    mac: bytes

    def to_params(self) -> dict[str, Any]:
        """The binding as JSON-friendly values, for `kv_transfer_params[PARAMS_KEY]`."""
        return {
            "consumer": self.consumer_engine_id,
            "producer": self.producer_engine_id,
            "expires": self.expires_at,
            "mac": self.mac.hex(),
        }

    @classmethod
    def from_params(cls, params: object) -> Binding | None:
        """The binding in a request's `kv_transfer_params[PARAMS_KEY]`; None when absent or malformed
        (the service then answers as for a missing binding)."""
        if not isinstance(params, Mapping):
            return None
        consumer, producer = params.get("consumer"), params.get("producer")
        expires, mac = params.get("expires"), params.get("mac")
        if not (isinstance(consumer, str) and isinstance(producer, str) and isinstance(mac, str)):
            return None
        if not isinstance(expires, int) or isinstance(expires, bool):
            return None
        try:
            raw = bytes.fromhex(mac)
        except ValueError:
            return None
        return cls(consumer, producer, expires, raw)


def mac_input(transfer_id: str, consumer_engine_id: str, producer_engine_id: str, expires_at: int) -> bytes:
    """The bytes a binding's MAC covers."""
    parts = [_DOMAIN]
    for text in (transfer_id, consumer_engine_id, producer_engine_id):
        raw = text.encode()
        parts += [struct.pack(">I", len(raw)), raw]
    parts.append(struct.pack(">q", expires_at))
    return b"".join(parts)


def compute_mac(
    key: bytes, transfer_id: str, consumer_engine_id: str, producer_engine_id: str, expires_at: int
) -> bytes:
    """HMAC-SHA256 of the binding's fields under key."""
    message = mac_input(transfer_id, consumer_engine_id, producer_engine_id, expires_at)
    return hmac.new(key, message, hashlib.sha256).digest()


def sign(key: bytes, transfer_id: str, consumer_engine_id: str, producer_engine_id: str, expires_at: int) -> Binding:
    """The router's binding of transfer_id to a consumer and a producer until expires_at (Unix seconds)."""
    mac = compute_mac(key, transfer_id, consumer_engine_id, producer_engine_id, expires_at)
    return Binding(consumer_engine_id, producer_engine_id, expires_at, mac)


def verifies(keys: Sequence[bytes], transfer_id: str, binding: Binding) -> bool:
    """Whether binding's MAC is one of keys' for transfer_id (compared in constant time)."""
    if len(binding.mac) != MAC_BYTES:
        return False
    ok = False
    for key in keys:
        expected = compute_mac(
            key, transfer_id, binding.consumer_engine_id, binding.producer_engine_id, binding.expires_at
        )
        ok |= hmac.compare_digest(expected, binding.mac)
    return ok


def parse_keys(text: str, source: str = "binding key file") -> tuple[bytes, ...]:
    """The keys of a key file's text: one a line; raises ValueError if there is none or one is too short."""
    keys: list[bytes] = []
    for n, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        raw = key.encode()
        if len(raw) < MIN_KEY_BYTES:
            # The key is a secret: say which line, not what it is.
            raise ValueError(f"{source}: the key on line {n} is {len(raw)} bytes, shorter than {MIN_KEY_BYTES}")
        keys.append(raw)
    if not keys:
        raise ValueError(f"{source}: no key (one key a line, at least {MIN_KEY_BYTES} bytes)")
    return tuple(keys)


def load_keys(path: str) -> tuple[bytes, ...]:
    """The keys of a key file (`parse_keys`)."""
    with open(path, encoding="utf-8") as f:
        return parse_keys(f.read(), f"binding key file {path}")
