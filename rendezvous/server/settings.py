"""The error of a setting the server cannot start with, shared by the server and the TLS files' reader."""

from __future__ import annotations


class SettingError(ValueError):
    """A setting the server cannot start with: a store URL it cannot use, a file it cannot read or use. `setting`
    names its ServerConfig field (store, auth_file, binding_key_file) or TLS file (tls_cert, tls_key,
    tls_client_ca), so that the CLI can name the flag."""

    def __init__(self, setting: str, value: str, reason: str) -> None:
        super().__init__(f"{setting} {value}: {reason}")
        self.setting = setting
        self.value = value
        self.reason = reason
