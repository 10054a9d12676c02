"""Server TLS and mTLS: certificates from files or PEM text, re-read from disk when they change.

gRPC asks `CertificateReloader` for a new configuration on every handshake; it answers with one
only when a file's modification time changed, so rotating a certificate (cert-manager, a renewed
Kubernetes Secret) takes effect for new connections without a restart. Open connections keep the
certificate they were established with.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
from dataclasses import dataclass

import grpc

from rendezvous.server.settings import SettingError

log = logging.getLogger(__name__)

_PEM_MARK = "-----BEGIN"


@dataclass(frozen=True)
class TLSConfig:
    """The server's certificate chain and key, and for mTLS the CA bundle that signs client certificates.

    Each of `cert`, `key` and `client_ca` is a file path or PEM text. `require_client_cert` refuses
    clients without a certificate signed by `client_ca` (mTLS). gRPC's Python server either requires
    and verifies client certificates or does not ask for them, so `client_ca` and
    `require_client_cert` go together.
    """

    cert: str
    key: str
    client_ca: str | None = None
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if self.require_client_cert and not self.client_ca:
            raise ValueError("require_client_cert needs client_ca (the CA that signs client certificates)")
        if self.client_ca and not self.require_client_cert:
            raise ValueError("client_ca is only used with require_client_cert (mTLS)")


def is_pem(value: str) -> bool:
    """Whether value is PEM text rather than a file path."""
    return _PEM_MARK in value


class _Source:
    """One PEM input: fixed text, or a file whose content is re-read when its mtime changes."""

    def __init__(self, value: str, setting: str) -> None:
        self.setting = setting
        self.path = None if is_pem(value) else value
        self._text = value.encode() if self.path is None else b""
        self.mtime: int | None = None

    def changed(self) -> bool:
        return self.path is not None and os.stat(self.path).st_mtime_ns != self.mtime

    def read(self) -> bytes:
        if self.path is None:
            return self._text
        try:
            self.mtime = os.stat(self.path).st_mtime_ns
            with open(self.path, "rb") as f:
                return f.read()
        except OSError as err:
            raise SettingError(self.setting, self.path, err.strerror or str(err)) from None


def _named(value: str) -> str:
    return "(PEM text)" if is_pem(value) else value


def _check(cert: bytes, key: bytes, ca: bytes | None, config: TLSConfig) -> None:
    """ValueError unless cert is PEM whose key is key, and ca PEM certificates: gRPC takes anything here and then
    fails to bind ('Failed to bind to address'), or reports only TSI_INVALID_ARGUMENT on its log."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="kv-rendezvous-tls-") as folder:  # load_cert_chain reads files only
        cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(data)
        try:
            # An encrypted key would prompt on the terminal: gRPC cannot use one, so no password.
            context.load_cert_chain(cert_path, key_path, password=lambda: b"")
        except ssl.SSLError as err:
            raise ValueError(
                f"TLS certificate {_named(config.cert)} and key {_named(config.key)} are not a PEM certificate chain "
                f"and its unencrypted private key: {err.reason or err}"
            ) from None
    if ca is not None and config.client_ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except ssl.SSLError as err:
            raise ValueError(
                f"TLS client CA {_named(config.client_ca)} is not PEM certificates: {err.reason or err}"
            ) from None


class CertificateReloader:
    """Builds the server credentials and answers gRPC's per-handshake request for fresh certificates."""

    def __init__(self, config: TLSConfig) -> None:
        self.config = config
        self._cert = _Source(config.cert, "tls_cert")
        self._key = _Source(config.key, "tls_key")
        self._ca = _Source(config.client_ca, "tls_client_ca") if config.client_ca else None
        self._lock = threading.Lock()
        self.loads = 0

    def _sources(self) -> list[_Source]:
        return [s for s in (self._cert, self._key, self._ca) if s is not None]

    def _load(self) -> grpc.ServerCertificateConfiguration:
        ca = self._ca.read() if self._ca is not None else None
        pair = (self._key.read(), self._cert.read())
        _check(pair[1], pair[0], ca, self.config)
        self.loads += 1
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when a file changed since the last load, else None (keep the current one).

        A file caught half-written or unreadable keeps the current configuration; the next handshake
        tries again.
        """
        with self._lock:
            try:
                if not any(s.changed() for s in self._sources()):
                    return None
                config = self._load()
            except (OSError, ValueError) as err:
                log.warning("TLS certificate reload failed; keeping the current certificate: %s", err)
                return None
            log.info("TLS certificates reloaded", extra={"cert": self._cert.path or "pem"})
            return config

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that ask `fetch` for changes on every handshake."""
        with self._lock:
            initial = self._load()
        return grpc.dynamic_ssl_server_credentials(
            initial, self.fetch, require_client_authentication=self.config.require_client_cert
        )
