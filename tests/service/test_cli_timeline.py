"""`kv-rendezvous transfers --timeline ID` against a real server: one transfer's moments, phases and outcome."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from rendezvous.cli import main
from rendezvous.clients import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    EngineRole,
    EngineSpec,
    ReleaseSpec,
    RendezvousClient,
    TargetSpec,
    TransferInfo,
)
from rendezvous.clients.testing import TestServer
from tests.clients.conftest import LAYOUT, agent, client_config


@pytest.fixture
def server() -> Iterator[TestServer]:
    with TestServer() as srv:
        yield srv


@pytest.fixture
def client(server: TestServer) -> Iterator[RendezvousClient]:
    with RendezvousClient(client_config(server.address)) as c:
        for engine_id, role, pool in (("d0", EngineRole.CONSUMER, "decode"), ("p0", EngineRole.PRODUCER, "prefill")):
            c.register_engine(EngineSpec(engine_id, pool, role, LAYOUT, (agent(f"{engine_id}-0"),)))
        yield c


def timeline(server: TestServer, transfer_id: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, str]]:
    """The command's three tables (fields, moments, phases), each as {first column: second column}."""
    assert main(["transfers", "--address", server.address, "--timeline", transfer_id]) == 0
    tables = capsys.readouterr().out.strip().split("\n\n")
    return [dict(re.split(r"\s{2,}", line, maxsplit=1) for line in t.splitlines()[1:]) for t in tables]


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def test_a_released_transfer_shows_its_moments_from_the_first_and_its_phase_durations(
    server: TestServer, client: RendezvousClient, capsys: pytest.CaptureFixture[str]
) -> None:
    client.claim_transfer("p0", ClaimSpec("t1"))
    client.register_target("d0", TargetSpec("t1", [1, 2, 3]))
    client.complete_transfer("p0", CompletionSpec("t1", 1))
    client.release_target("d0", ReleaseSpec("t1", 1))
    t: TransferInfo = client.get_transfer("t1")
    fields, moments, durations = timeline(server, "t1", capsys)

    assert fields["state"] == "released" and fields["generation"] == "1" and fields["mode"] == "push"
    assert fields["consumer"] == f"d0 (incarnation {t.consumer_incarnation})"
    assert fields["producer"] == f"p0 (incarnation {t.producer_incarnation})"
    assert fields["abort reason"] == "-"
    times = t.times
    first = times.claim_time
    assert list(moments) == ["claim", "target", "match", "commit", "end"]
    assert moments["claim"] == "0.000"
    for name, at in (("match", times.match_time), ("commit", times.commit_time), ("end", times.end_time)):
        assert float(moments[name]) == pytest.approx(ms(at - first), abs=0.002), name
    assert list(durations) == ["target_to_match", "claim_to_match", "match_to_commit", "commit_to_release", "total"]
    assert float(durations["claim_to_match"]) == pytest.approx(ms(times.match_time - first), abs=0.002)
    assert float(durations["total"]) == pytest.approx(ms(times.end_time - first), abs=0.002)
    assert float(durations["commit_to_release"]) == pytest.approx(ms(times.end_time - times.commit_time), abs=0.002)


def test_an_aborted_transfer_shows_its_reason_and_no_release_phases(
    server: TestServer, client: RendezvousClient, capsys: pytest.CaptureFixture[str]
) -> None:
    client.register_target("d0", TargetSpec("t2", [1]))
    client.abort_transfer("d0", AbortSpec("t2", "user went away"))
    fields, moments, durations = timeline(server, "t2", capsys)
    assert fields["state"] == "aborted"
    assert fields["abort reason"] == "requested: user went away"
    assert fields["producer"] == "-"
    assert list(moments) == ["target", "end"]
    assert durations == {}


def test_an_unknown_transfer_is_an_error_naming_it(server: TestServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["transfers", "--address", server.address, "--timeline", "nope"]) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "NOT_FOUND" in captured.err and "nope" in captured.err
