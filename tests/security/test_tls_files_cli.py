"""`serve --tls-cert/--tls-key/--tls-client-ca` with files that do not go together: one line naming the files,
exit 2. gRPC took them and then failed to bind ("Failed to bind to address", a traceback), its log saying only
TSI_INVALID_ARGUMENT; after the listen fix that read as an address in use."""

from __future__ import annotations

from pathlib import Path

from tests.security.certs import CertificateAuthority, Pair
from tests.service.test_cli_listen import refused


def test_a_certificate_with_another_certificates_key_is_refused(
    ca: CertificateAuthority, server_pair: Pair, tmp_path: Path
) -> None:
    cert, _ = server_pair.write(tmp_path, "server")
    _, other_key = ca.issue("other", server=True).write(tmp_path, "other")
    line = refused("--tls-cert", cert, "--tls-key", other_key)
    assert f"TLS certificate {cert} and key {other_key}" in line and "KEY_VALUES_MISMATCH" in line


def test_files_that_are_not_pem_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert f"TLS certificate {junk} and key {junk} are not a PEM" in refused(
        "--tls-cert", str(junk), "--tls-key", str(junk)
    )


def test_a_client_ca_that_is_not_pem_is_refused(server_pair: Pair, tmp_path: Path) -> None:
    cert, key = server_pair.write(tmp_path, "server")
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    flags = ("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", str(junk), "--tls-require-client-cert")
    assert f"TLS client CA {junk} is not PEM certificates" in refused(*flags)


def test_a_tls_file_that_cannot_be_read_is_named_by_its_flag(server_pair: Pair, tmp_path: Path) -> None:
    """Before, "kv-rendezvous: [Errno 2] No such file or directory: '...'": the path, not the flag."""
    cert, key = server_pair.write(tmp_path, "server")
    missing = str(tmp_path / "missing.pem")
    assert refused("--tls-cert", cert, "--tls-key", missing).startswith(f"kv-rendezvous: --tls-key {missing}: No such")
    assert refused("--tls-cert", missing, "--tls-key", key).startswith(f"kv-rendezvous: --tls-cert {missing}: No such")
    flags = ("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", missing, "--tls-require-client-cert")
    assert refused(*flags).startswith(f"kv-rendezvous: --tls-client-ca {missing}: No such")
