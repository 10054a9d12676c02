"""scripts/netlab.sh: a lab is exactly two namespaces joined by a tbf-shaped veth pair with link-local addresses,
nothing routes out of it, and nothing it made outlives `down`, a failed `up` or an interrupted `run`.

These tests make real namespaces (root and CAP_NET_ADMIN: CI runs as root). Where that is impossible they skip
with the script's reason; under CI (the `netns` suite, tests/ci.py) such a skip is a failure. Other labs may come
and go on the same machine while they run (their names carry other ids), so before/after comparisons leave
those out.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from netlab import EXIT_REFUSED, SCRIPT, Lab, down, parse_variables, up, why_not

pytestmark = pytest.mark.netns
RATE = "1gbit"
TIMEOUT_S = 60.0
OTHER_LAB = re.compile(r"^kvl-?([0-9a-f]{6})-?[pd]$")


@pytest.fixture(scope="module", autouse=True)
def _can_make_namespaces() -> None:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)


@dataclass(frozen=True)
class HostNetwork:
    """The machine's namespaces and this namespace's links."""

    namespaces: frozenset[str]
    links: frozenset[str]


def names(lines: str, pattern: str) -> set[str]:
    return {m.group(1) for line in lines.splitlines() if (m := re.match(pattern, line))}


def snapshot(mine: str = "") -> HostNetwork:
    """The host's network now, less what belongs to labs other than `mine` (run by others meanwhile)."""

    def ours_or_not_a_lab(name: str) -> bool:
        match = OTHER_LAB.match(name)
        return match is None or match.group(1) == mine

    namespaces = names(sh("ip", "netns", "list"), r"^(\S+)")
    links = names(sh("ip", "-o", "link", "show"), r"^\d+: ([^:@]+)")
    return HostNetwork(frozenset(filter(ours_or_not_a_lab, namespaces)), frozenset(filter(ours_or_not_a_lab, links)))


def sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=True).stdout


def in_lab(lab: Lab, role: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), "exec", lab.id, role, *argv], capture_output=True, text=True, timeout=TIMEOUT_S, check=check
    )


def lab_id() -> str:
    return os.urandom(3).hex()


@pytest.fixture
def lab() -> Iterator[Lab]:
    made = up(RATE)
    try:
        yield made
    finally:
        down(made.id)


@pytest.mark.parametrize(("rate", "shown"), [("1gbit", "1Gbit"), ("25gbit", "25Gbit")])
def test_up_makes_two_namespaces_joined_by_a_shaped_veth_pair(rate: str, shown: str) -> None:
    chosen = lab_id()
    before = snapshot(chosen)
    made = up(rate, lab_id=chosen)
    try:
        after = snapshot(chosen)
        assert after.namespaces - before.namespaces == {made.prefill_ns, made.decode_ns}
        assert after.links == before.links  # both ends of the pair went into the namespaces
        for role in ("prefill", "decode"):
            ns, dev = made.namespace(role), made.device(role)
            assert names(sh("ip", "-n", ns, "-o", "link", "show"), r"^\d+: ([^:@]+)") == {"lo", dev}
            assert re.search(r"<\S*\bUP\b", sh("ip", "-n", ns, "link", "show", "lo"))
            addresses = names(sh("ip", "-n", ns, "-o", "addr", "show"), r"^\d+: \S+\s+inet6? (\S+)")
            ucx_address = {"prefill": "198.18.77.1/30", "decode": "198.18.77.2/30"}[role]
            assert addresses == {"127.0.0.1/8", "::1/128", f"{made.address(role)}/30", ucx_address}
            routes = sorted(sh("ip", "-n", ns, "route", "show").strip().splitlines())
            assert [r.split(" proto")[0] for r in routes] == [f"169.254.77.0/30 dev {dev}", f"198.18.77.0/30 dev {dev}"]
            qdisc = sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev)
            assert re.search(rf"qdisc tbf \S+ root .* rate {shown} ", qdisc), qdisc
    finally:
        down(made.id)
    assert snapshot(chosen) == before


def test_a_command_runs_with_ucx_on_its_side_of_the_link(lab: Lab) -> None:
    env = parse_variables(in_lab(lab, "prefill", "env").stdout)
    assert env["UCX_TLS"] == "tcp"
    assert env["UCX_NET_DEVICES"] == lab.prefill_dev
    assert Lab.from_env(env) == lab
    namespace = in_lab(lab, "decode", "ip", "netns", "identify").stdout.strip()
    assert namespace == lab.decode_ns


SERVE_ONCE = r"""
import socket, sys
with socket.create_server((sys.argv[1], 0)) as server:
    print(server.getsockname()[1], flush=True)
    server.settimeout(60)
    conn, peer = server.accept()
    with conn:
        conn.sendall(f"hello {peer[0]}\n".encode() + bytes(2**20))
"""

CONNECT = r"""
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    received = b"".join(iter(lambda: conn.recv(65536), b""))
greeting, _, rest = received.partition(b"\n")
print(greeting.decode(), len(rest))
"""


def test_the_link_local_addresses_reach_each_other_through_the_shaped_ends(lab: Lab) -> None:
    argv = [str(SCRIPT), "exec", lab.id, "prefill", sys.executable, "-c", SERVE_ONCE, lab.prefill_addr]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            sent = lab.sent_bytes("prefill")
            answer = in_lab(lab, "decode", sys.executable, "-c", CONNECT, lab.prefill_addr, port).stdout.strip()
            assert answer == f"hello {lab.decode_addr} {2**20}"
            assert lab.sent_bytes("prefill") - sent > 2**20  # the MiB (and headers) went through prefill's tbf
            assert server.wait(TIMEOUT_S) == 0
        finally:
            server.kill()


UNREACHABLE = """
import errno, socket, sys
for address in sys.argv[1:]:
    try:
        socket.create_connection((address, 9), timeout=5).close()
        print(address, "connected")
    except OSError as e:
        print(address, errno.errorcode.get(e.errno, e.errno))
"""


def test_nothing_routes_out_of_the_lab(lab: Lab) -> None:
    # This machine's own addresses outside the lab, its default gateways and TEST-NET-2: from inside, each must
    # fail at once with "network unreachable" (no route), not time out or connect.
    outside = names(sh("ip", "-4", "-o", "addr", "show"), r"^\d+: (?!lo\b)\S+\s+inet ([\d.]+)/")
    gateways = names(sh("ip", "-4", "route", "show", "default"), r"^default via ([\d.]+) ")
    targets = ["198.51.100.1", *sorted(outside | gateways)]
    for role in ("prefill", "decode"):
        lines = in_lab(lab, role, sys.executable, "-c", UNREACHABLE, *targets).stdout.splitlines()
        assert lines == [f"{address} ENETUNREACH" for address in targets]


PAUSE = "import signal; print('ready', flush=True); signal.pause()"


def test_down_stops_the_labs_processes_and_leaves_nothing() -> None:
    chosen = lab_id()
    before = snapshot(chosen)
    made = up(RATE, lab_id=chosen)
    argv = [str(SCRIPT), "exec", made.id, "prefill", sys.executable, "-c", PAUSE]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
            down(made.id)
            assert process.wait(TIMEOUT_S) == -signal.SIGTERM
        finally:
            process.kill()
            down(made.id)
    assert snapshot(chosen) == before
    down(made.id)  # idempotent


@pytest.mark.parametrize("step", ["ns-prefill", "ns-decode", "veth", "moved", "addresses", "qdisc-prefill"])
def test_an_up_that_fails_half_way_removes_what_it_made(step: str) -> None:
    chosen = lab_id()
    before = snapshot(chosen)
    env = {**os.environ, "NETLAB_FAIL_AT": step}
    with pytest.raises(subprocess.CalledProcessError) as failed:
        up(RATE, lab_id=chosen, env=env)
    assert failed.value.returncode == 1
    assert f"failing after step {step}" in failed.value.stderr
    assert snapshot(chosen) == before


def test_an_up_that_collides_removes_only_what_it_made() -> None:
    chosen = lab_id()
    taken = f"kvl-{chosen}-d"  # someone else's namespace under the decode side's name
    sh("ip", "netns", "add", taken)
    try:
        before = snapshot(chosen)
        with pytest.raises(subprocess.CalledProcessError):
            up(RATE, lab_id=chosen)
        assert snapshot(chosen) == before  # the prefill namespace it made is gone, the one it did not is there
    finally:
        subprocess.run(["ip", "netns", "delete", taken], timeout=TIMEOUT_S, check=True)


def test_an_interrupted_run_removes_the_lab() -> None:
    chosen = lab_id()
    before = snapshot(chosen)
    argv = [str(SCRIPT), "run", "--rate", RATE, "--id", chosen, "--", sys.executable, "-c", PAUSE]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        try:
            assert run.stdout is not None and run.stdout.readline().strip() == "ready"
            assert snapshot(chosen) != before
            run.send_signal(signal.SIGINT)
            # It cleans up, then dies of the signal (a shell would report 130), as an interrupted program should.
            assert run.wait(TIMEOUT_S) == -signal.SIGINT
        finally:
            run.kill()
            down(chosen)
    assert snapshot(chosen) == before


def test_run_removes_the_lab_and_passes_on_the_commands_exit_status() -> None:
    chosen = lab_id()
    before = snapshot(chosen)
    argv = [str(SCRIPT), "run", "--id", chosen, "--", "sh", "-c", "ip netns identify; exit 7"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert (result.returncode, result.stdout.strip()) == (7, f"kvl-{chosen}-d")
    assert snapshot(chosen) == before


@pytest.mark.parametrize(
    ("dropped", "why"),
    [
        (["--reuid=65534", "--regid=65534", "--clear-groups"], "not root"),
        (["--bounding-set=-net_admin", "--inh-caps=-net_admin"], "RTNETLINK answers: Operation not permitted"),
        (["--bounding-set=-sys_admin", "--inh-caps=-sys_admin"], "unshare failed: Operation not permitted"),
    ],
    ids=["not-root", "no-cap-net-admin", "no-cap-sys-admin"],
)
def test_it_refuses_without_privileges_and_makes_nothing(dropped: list[str], why: str) -> None:
    before = snapshot()
    argv = ["setpriv", *dropped, str(SCRIPT), "up"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == EXIT_REFUSED
    assert result.stderr.startswith("netlab: refusing: ") and why in result.stderr
    assert snapshot() == before


def test_a_bad_rate_is_refused_before_anything_is_made() -> None:
    before = snapshot()
    result = subprocess.run([str(SCRIPT), "up", "--rate", "fast"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 2
    assert "bad rate 'fast'" in result.stderr
    assert snapshot() == before
