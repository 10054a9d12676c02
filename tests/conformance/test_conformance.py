"""The shipped conformance suite (`kv-rendezvous conformance`) against real `kv-rendezvous serve` processes:
a memory store, a Redis store, and two replicas sharing one Redis with engines spread across them.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from rendezvous.conformance import CHECKS, main
from rendezvous.conformance.runner import add_arguments, options_from
from tests.redis_fixtures import fresh_prefix, with_prefix
from tests.replicas.harness import Replica
from tests.security.certs import CertificateAuthority

# Short sweeps so lapsed leases and deadlines are noticed at once; the suite's own leases are 2 s.
SERVE_ARGS = ("--sweep-interval", "0.02")
SUITE_TIMEOUT_S = 90
PACKAGE = Path(__file__).resolve().parents[2] / "rendezvous" / "conformance"


def conformance(*args: str, timeout: float = SUITE_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`kv-rendezvous conformance ARGS` as a process."""
    return subprocess.run(
        [sys.executable, "-m", "rendezvous.cli", "conformance", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_all(targets: Sequence[str], tmp_path: Path) -> None:
    """Run every check against targets; each must pass and be named in the report and the JSON."""
    report = tmp_path / "conformance.json"
    args = [part for t in targets for part in ("--address", t)]
    done = conformance(*args, "--json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    names = [c.full_name for c in CHECKS]
    for name in names:
        assert f"PASS  {name}  (" in done.stdout, done.stdout
    results = json.loads(report.read_text())
    assert [c["name"] for c in results["checks"]] == names
    assert {c["result"] for c in results["checks"]} == {"PASS"}
    assert (results["passed"], results["failed"], results["total"]) == (len(names), 0, len(names))
    assert results["targets"] == list(targets)


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    """Replicas started by the test, closed after it."""
    started: list[Replica] = []
    yield started
    for replica in started:
        replica.close()


def start_with(replicas: list[Replica], store_url: str, name: str, *extra: str) -> Replica:
    """A started `kv-rendezvous serve` with short sweeps and extra flags."""
    replica = Replica(store_url, name, (*SERVE_ARGS, *extra))
    replicas.append(replica)
    replica.start()
    return replica


def start(replicas: list[Replica], store_url: str, name: str) -> Replica:
    """A started `kv-rendezvous serve` with short sweeps."""
    return start_with(replicas, store_url, name)


@pytest.mark.timeout(SUITE_TIMEOUT_S + 30)
def test_every_check_passes_against_a_memory_store(replicas: list[Replica], tmp_path: Path) -> None:
    server = start(replicas, "memory", "memory")
    run_all([server.address], tmp_path)


@pytest.mark.redis
@pytest.mark.timeout(SUITE_TIMEOUT_S + 30)
def test_every_check_passes_against_a_redis_store(replicas: list[Replica], redis_url: str, tmp_path: Path) -> None:
    server = start(replicas, with_prefix(redis_url, fresh_prefix()), "redis")
    run_all([server.address], tmp_path)


@pytest.mark.redis
@pytest.mark.timeout(SUITE_TIMEOUT_S + 30)
def test_every_check_passes_across_two_replicas_of_one_redis(
    replicas: list[Replica], redis_url: str, tmp_path: Path
) -> None:
    url = with_prefix(redis_url, fresh_prefix())
    a, b = start(replicas, url, "a"), start(replicas, url, "b")
    run_all([a.address, b.address], tmp_path)


def test_a_check_against_a_stopped_server_is_reported_as_failed_with_exit_code_1(
    replicas: list[Replica], tmp_path: Path
) -> None:
    server = start(replicas, "memory", "stopped")
    address = server.address
    server.kill()
    report = tmp_path / "conformance.json"
    done = conformance("--address", address, "--only", "lifecycle.push_target_first", "--json", str(report))
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "lifecycle.push_target_first" in line]
    assert line.startswith("FAIL  lifecycle.push_target_first  (") and "UNAVAILABLE" in line, line
    assert "0 passed, 1 failed, 1 total" in done.stdout
    results = json.loads(report.read_text())
    (check,) = results["checks"]
    assert (check["name"], check["result"], results["failed"]) == ("lifecycle.push_target_first", "FAIL", 1)
    assert "UNAVAILABLE" in check["reason"]


def test_tls_and_an_admin_token_are_used_and_without_the_token_checks_fail(
    replicas: list[Replica], tmp_path: Path
) -> None:
    ca = CertificateAuthority("conformance-test-ca")
    cert, key = ca.issue("kv-rendezvous", server=True).write(tmp_path, "server")
    ca_file = tmp_path / "ca.pem"
    ca_file.write_text(ca.pem)
    token = "conformance-admin-token"
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"tokens": {token: {"name": "ops", "roles": ["admin"]}}}))
    server = start_with(replicas, "memory", "secure", "--tls-cert", cert, "--tls-key", key, "--auth-file", str(auth))
    only = ("--only", "lifecycle.push_target_first", "--only", "errors.stale_incarnation")
    secure = ("--address", server.address, "--ca", str(ca_file), *only)
    done = conformance(*secure, "--token", token)
    assert done.returncode == 0, done.stdout + done.stderr
    refused = conformance(*secure)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stdout.count("UNAUTHENTICATED/UNAUTHENTICATED_TOKEN") == 2, refused.stdout


def test_the_old_target_flag_still_names_servers_with_a_deprecation_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--target", "rdv-0:50051", "--address", "rdv-1:50051"])
    assert options_from(args).targets == ("rdv-0:50051", "rdv-1:50051")
    assert "--target is deprecated, use --address" in capsys.readouterr().err


def test_list_names_every_check_and_only_filters_by_substring() -> None:
    out = io.StringIO()
    assert main(["--list"], out=out) == 0
    assert [line.split()[0] for line in out.getvalue().splitlines()] == [c.full_name for c in CHECKS]
    out = io.StringIO()
    assert main(["--list", "--only", "lease_loss."], out=out) == 0
    assert {line.split()[0].split(".")[0] for line in out.getvalue().splitlines()} == {"lease_loss"}


def test_only_matching_no_check_is_a_usage_error() -> None:
    assert main(["--only", "no-such-check"], out=io.StringIO()) == 2


def test_every_group_has_checks_and_names_are_unique() -> None:
    from rendezvous.conformance.registry import GROUPS

    assert {c.group for c in CHECKS} == set(GROUPS)
    names = [c.full_name for c in CHECKS]
    assert len(set(names)) == len(names)
    assert all(c.summary for c in CHECKS)


def test_the_suite_speaks_only_the_wire() -> None:
    """An independent client: gRPC, the generated stubs and google.rpc; never the SDK or the service's code."""
    allowed_rendezvous = ("rendezvous.v1", "rendezvous.conformance")
    forbidden_roots = {"clients", "connector"}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                root = module.split(".")[0]
                assert root not in forbidden_roots, f"{path.name} imports {module}"
                if root == "rendezvous":
                    assert module.startswith(allowed_rendezvous), f"{path.name} imports {module}"
