"""`--auth`: the service as docs/deploy.md configures it, TLS aside (docs/engines.md, "A secured service").

Each engine gets a token of its own, listed in the auth file by its sha256 only and bound to the engine's id, role
and pool (`--strict-identities` refuses an identity that is not bound); `--binding-key-file` makes the service
require, on each target and claim, the router's binding of the transfer to the two engines it chose, which the
router signs with the same key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Secured:
    """What `kv-rendezvous serve` is started with, and what the engines and the router hold."""

    serve_flags: tuple[str, ...]
    tokens: dict[str, str]
    """Each engine's bearer token, by engine id."""
    binding_key: bytes
    """The first (here the only) key of the service's binding key file: the router signs with it."""


def secure(folder: Path, engines: dict[str, tuple[str, str]]) -> Secured:
    """An auth file and a binding key in folder for `engines` (engine id -> (role, pool); role "producer" or
    "consumer"), and the serve flags that use them."""
    tokens = {engine_id: secrets.token_hex(16) for engine_id in engines}
    identities = {
        "sha256:" + hashlib.sha256(tokens[engine_id].encode()).hexdigest(): {
            "name": engine_id,
            "engines": [engine_id],
            "engine_roles": [role],
            "engine_pools": [pool],
        }
        for engine_id, (role, pool) in engines.items()
    }
    auth_file, key_file = folder / "auth.json", folder / "binding.key"
    auth_file.write_text(json.dumps({"tokens": identities}, indent=2))
    key = secrets.token_hex(32).encode()  # as `openssl rand -hex 32` makes it
    key_file.write_bytes(key + b"\n")
    flags = ("--auth-file", str(auth_file), "--strict-identities", "--binding-key-file", str(key_file))
    return Secured(flags, tokens, key)
