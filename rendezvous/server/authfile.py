"""The auth file: identities by bearer token digest and by client-certificate name.

    {
      "tokens": {
        "s3cret-decode-0-8c1f": {"name": "decode-0", "engines": ["decode-0", "decode-0-*"],
                                 "engine_roles": ["consumer"], "engine_pools": ["decode"]},
        "sha256:9f86d08...": {"name": "prefill-pool", "pools": ["prefill"]},
        "s3cret-router-77a2e0": {"name": "router", "roles": ["router"]}
      },
      "certificates": {
        "decode-1.kv.svc": {"engines": ["decode-1", "decode-1-*"]},
        "ops": {"roles": ["admin"]}
      }
    }

A token key is the token itself (at least `min_token_bytes` long) or `sha256:<64 hex digits>` of it,
so the file need not hold secrets. `engines` are engine ids or shell-style globs; `pools` admit every
engine registered in those pools. `engine_roles` (producer, consumer) and `engine_pools`, when given,
bind the identity: its engines may only be registered, and acted for, with those roles and in those
pools. `roles` are call permissions: `router` reads and aborts as the router, `admin` does everything.
The file is re-read when its modification time changes (or on `reload()`); a broken new file keeps the old
identities. Each re-read that changes the identities moves the policy's `generation`, which open streams
compare on every message (rendezvous.server.auth).

An identity that may register engines (it has `engines` or `pools`) without `engine_roles` (and, for
`engines`, without `engine_pools`) may register them with any role (or in any pool): the policy logs a
warning for each such identity, or, when strict, refuses the file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rendezvous.core.model import Role
from rendezvous.protocol.errors import Reason, RendezvousError

log = logging.getLogger(__name__)

ROUTER = "router"
ADMIN = "admin"
_ROLES = frozenset({ROUTER, ADMIN})
_ENGINE_ROLES = {"producer": Role.PRODUCER, "consumer": Role.CONSUMER}
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")

DEFAULT_MIN_TOKEN_BYTES = 16
"""The shortest token an auth file may name in the clear."""

# Re-check the auth file's modification time at most this often (seconds).
RELOAD_CHECK = 1.0


@dataclass(frozen=True)
class Caller:
    """Who a unary call was admitted as: what the auth guard hands the servicer with the request (a servicer
    served without the guard, or a call without auth, gets `ANONYMOUS`)."""

    key: str = ""
    """The identity's key (Identity.key; "" without auth): owner of the engines it registers (the memory
    budget) and of the answers kept for its request ids."""
    exempt: bool = False
    """It may take a transfer's half without the router's binding when bindings are required (admin)."""
    hides_non_participation: bool = False
    """Its NOT_PARTICIPANT items are answered as the call answers an unknown id (rendezvous.server.disclosure):
    every identity but admin."""
    acts_for: Callable[[str], Awaitable[bool]] | None = None
    """Whether it may act for an engine (by id), where that bounds what it reads: an engine identity's GetTransfer
    answers only a transfer one of whose halves it acts for (rendezvous.server.disclosure). None: it reads every
    transfer (no auth, the router role, admin)."""


ANONYMOUS = Caller()


@dataclass(frozen=True)
class Identity:
    """A caller: a name for logs, the engines it may act for, its roles, and what binds its engines."""

    name: str
    engines: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    roles: frozenset[str] = frozenset()
    engine_roles: frozenset[Role] = frozenset()
    engine_pools: tuple[str, ...] = ()
    key: str = ""
    """What the identity is charged under (its rate bucket, its memory budget): `token:` and the first 32
    hex digits of its token's sha256, or `certificate:` and its certificate name. A rename keeps it."""

    def has_role(self, role: str) -> bool:
        """Whether the identity holds role (admin holds every role)."""
        return role in self.roles or ADMIN in self.roles

    def names_engine(self, engine_id: str) -> bool:
        """Whether engine_id is one of the identity's engines (an id or a glob)."""
        return any(fnmatch.fnmatchcase(engine_id, pattern) for pattern in self.engines)

    @property
    def bound(self) -> bool:
        """Whether the identity's engines are bound to roles or pools."""
        return bool(self.engine_roles or self.engine_pools)

    def unbound(self) -> tuple[str, ...]:
        """The binding keys an identity that may register engines lacks: engine_roles, and engine_pools
        unless its `pools` bound where it registers."""
        if not (self.engines or self.pools) or ADMIN in self.roles:
            return ()
        missing = () if self.engine_roles else ("engine_roles",)
        return missing if self.engine_pools or not self.engines else (*missing, "engine_pools")

    def check_binding(self, engine_id: str, role: Role, pool: str) -> None:
        """Refuse an engine of this identity with a role or in a pool the identity is not bound to."""
        if self.engine_roles and role and role not in self.engine_roles:
            raise RendezvousError(
                Reason.IDENTITY_MISMATCH,
                f"identity {self.name} may not hold engine {engine_id} as a {role.name}",
                engine_id=engine_id,
                field="role",
            )
        if self.engine_pools and pool not in self.engine_pools:
            raise RendezvousError(
                Reason.IDENTITY_MISMATCH,
                f"identity {self.name} may not hold engine {engine_id} in pool {pool}",
                engine_id=engine_id,
                field="pool",
            )


def digest(token: str) -> str:
    """The sha256 hex digest an auth file may list a token by."""
    return hashlib.sha256(token.encode()).hexdigest()


def _identity(name: str, entry: Any, charged_as: str) -> Identity:
    if not isinstance(entry, Mapping):
        raise ValueError(f"auth file: identity {name!r} must be an object")
    keys = ("engines", "pools", "roles", "engine_roles", "engine_pools")
    if unknown := set(entry) - {"name", *keys}:
        raise ValueError(f"auth file: identity {name!r} has unknown keys {sorted(unknown)}")
    if not isinstance(entry.get("name", name), str) or not entry.get("name", name):
        raise ValueError(f"auth file: the name of identity {name!r} must be a non-empty string")
    lists = {k: entry.get(k, []) for k in keys}
    for key, value in lists.items():
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"auth file: {key} of identity {name!r} must be a list of non-empty strings")
    if bad := set(lists["roles"]) - _ROLES:
        raise ValueError(f"auth file: identity {name!r} has unknown roles {sorted(bad)}; known: router, admin")
    if bad := set(lists["engine_roles"]) - set(_ENGINE_ROLES):
        raise ValueError(
            f"auth file: identity {name!r} has unknown engine_roles {sorted(bad)}; known: producer, consumer"
        )
    return Identity(
        name=str(entry.get("name", name)),
        engines=tuple(lists["engines"]),
        pools=tuple(lists["pools"]),
        roles=frozenset(lists["roles"]),
        engine_roles=frozenset(_ENGINE_ROLES[r] for r in lists["engine_roles"]),
        engine_pools=tuple(lists["engine_pools"]),
        key=charged_as,
    )


_PUBLIC_KEYS = frozenset(
    {"tokens", "certificates", "name", "engines", "pools", "roles", "engine_roles", "engine_pools"}
)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a key given twice (json keeps the last one silently)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            # A token in the clear is a secret: say how long, not what it is.
            shown = repr(key[:24]) if key in _PUBLIC_KEYS or key.startswith("sha256:") else f"({len(key)} bytes)"
            raise ValueError(f"a key {shown} is given twice in one object; JSON would keep only the last")
        seen[key] = value
    return seen


def _members(doc: Mapping[str, Any], section: str, path: str) -> Mapping[str, Any]:
    value = doc.get(section, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"auth file {path}: {section!r} must be an object")
    return value


def _token_digest(key: str, min_token_bytes: int) -> str:
    if key.startswith("sha256:"):
        hex_digest = key.removeprefix("sha256:")
        if not _SHA256_HEX.fullmatch(hex_digest):
            raise ValueError(f"auth file: token key {key[:16]!r}... is not sha256: and 64 hex digits")
        return hex_digest.lower()
    if len(key.encode()) < min_token_bytes:
        # The key is a secret: say which entry, not what it is.
        raise ValueError(f"auth file: a token is {len(key.encode())} bytes, shorter than {min_token_bytes}")
    return digest(key)


class AuthPolicy:
    """The identities of an auth file, by token digest and by certificate name; reloaded when it changes.

    `strict` refuses a file with an identity that may register engines unbound (Identity.unbound); otherwise
    each such identity is logged as a warning."""

    def __init__(
        self,
        path: str,
        clock: Callable[[], float] = time.monotonic,
        min_token_bytes: int = DEFAULT_MIN_TOKEN_BYTES,
        strict: bool = False,
    ) -> None:
        if min_token_bytes < 1:
            raise ValueError(f"min_token_bytes must be at least 1, not {min_token_bytes}")
        self.path = path
        self.min_token_bytes = min_token_bytes
        self.strict = strict
        self._clock = clock
        self._lock = threading.Lock()
        self._mtime = 0
        self._checked = clock()
        self._tokens: dict[str, Identity] = {}
        self._certificates: dict[str, Identity] = {}
        self._known: frozenset[Identity] = frozenset()
        self._generation = 0
        self._load()

    def _load(self) -> bool:
        """Read the file; whether its identities differ from the current ones (then the generation moves)."""
        mtime = os.stat(self.path).st_mtime_ns
        with open(self.path, encoding="utf-8") as f:
            try:
                doc = json.load(f, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as err:
                raise ValueError(f"auth file {self.path} is not JSON: {err.msg} at line {err.lineno}") from None
            except UnicodeDecodeError:
                raise ValueError(f"auth file {self.path} is not UTF-8 text") from None
            except ValueError as err:
                raise ValueError(f"auth file {self.path}: {err}") from None
        if not isinstance(doc, Mapping) or set(doc) - {"tokens", "certificates"}:
            raise ValueError(f"auth file {self.path}: expected an object with 'tokens' and/or 'certificates'")
        tokens: dict[str, Identity] = {}
        for n, (key, entry) in enumerate(_members(doc, "tokens", self.path).items()):
            hex_digest = _token_digest(key, self.min_token_bytes)
            identity = _identity(f"token-{n}", entry, "token:" + hex_digest[:32])
            if hex_digest in tokens:
                # The same token in the clear and as sha256: (or in two cases of hex): one would silently win.
                raise ValueError(
                    f"auth file {self.path}: identities {tokens[hex_digest].name!r} and {identity.name!r} have the "
                    "same token"
                )
            tokens[hex_digest] = identity
        certificates = {
            name: _identity(name, entry, "certificate:" + name)
            for name, entry in _members(doc, "certificates", self.path).items()
        }
        self._check_bound([*tokens.values(), *certificates.values()])
        changed = (tokens, certificates) != (self._tokens, self._certificates)
        self._tokens, self._certificates, self._mtime = tokens, certificates, mtime
        if changed:
            self._known = frozenset([*tokens.values(), *certificates.values()])
            self._generation += 1
        return changed

    def _check_bound(self, identities: list[Identity]) -> None:
        unbound = [(identity.name, missing) for identity in identities if (missing := identity.unbound())]
        if unbound and self.strict:
            names = ", ".join(f"{name} (no {' or '.join(missing)})" for name, missing in unbound)
            raise ValueError(
                f"auth file {self.path}: identities may register engines of any role or pool: {names}; "
                "bind them (engine_roles, engine_pools, docs/security.md) or serve without --strict-identities"
            )
        for name, missing in unbound:
            log.warning(
                "identity %s may register engines of any %s (no %s): bind it (docs/security.md)",
                name,
                " or ".join(m.removeprefix("engine_").removesuffix("s") for m in missing),
                " or ".join(missing),
            )

    def _reread(self, force: bool) -> bool:
        """Under the lock: re-read the file if forced or its modification time moved; whether the identities
        changed. A file that cannot be read or is broken keeps the current identities (logged)."""
        try:
            if not force and os.stat(self.path).st_mtime_ns == self._mtime:
                return False
            changed = self._load()
        except (OSError, ValueError) as err:
            log.warning("auth file reload failed; keeping the current identities: %s", err)
            return False
        if changed:
            log.info("auth file reloaded", extra={"path": self.path, "generation": self._generation})
        return changed

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked < RELOAD_CHECK:
            return
        with self._lock:
            self._checked = now
            self._reread(force=False)

    def reload(self) -> bool:
        """Re-read the file now, whatever its modification time (SIGHUP; tests); whether its identities
        changed. A broken file keeps the current identities."""
        with self._lock:
            self._checked = self._clock()
            return self._reread(force=True)

    @property
    def generation(self) -> int:
        """A number that moves on every reload that changes the identities (re-read first if due)."""
        self._maybe_reload()
        return self._generation

    def by_token(self, token: str) -> Identity | None:
        """The identity a bearer token stands for, if any."""
        self._maybe_reload()
        return self._tokens.get(digest(token))

    def by_certificate(self, names: Iterable[str]) -> Identity | None:
        """The identity of the first certificate name (CN or SAN) the file knows, if any."""
        self._maybe_reload()
        return next((self._certificates[n] for n in names if n in self._certificates), None)

    def recheck(self, identity: Identity, seen: int) -> int:
        """The current generation, once identity is found unchanged in it (compared only when it moved from
        `seen`): raises UNAUTHENTICATED_TOKEN if the file (re-read if due) no longer holds identity as it was."""
        generation = self.generation
        if generation != seen and identity not in self._known:
            raise RendezvousError(
                Reason.UNAUTHENTICATED_TOKEN,
                f"identity {identity.name} was removed from the auth file or changed; reconnect",
            )
        return generation
