"""The server process around the service: health, reflection, metrics, the CLI and SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import index_pb2 as ipb
from rendezvous.v1 import index_pb2_grpc as ipb_grpc
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.conftest import engine_request

SERVICE = "rendezvous.v1.RendezvousService"


async def test_health_turns_not_serving_while_draining_then_calls_are_refused(server_config: ServerConfig) -> None:
    server = RendezvousServer(replace(server_config, drain=300.0))  # ended below, once checked
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert serving.status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.create_task(server.stop())
        deadline = time.monotonic() + 5
        while (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status != (
            health_pb2.HealthCheckResponse.NOT_SERVING
        ):
            assert time.monotonic() < deadline, "health never reported NOT_SERVING"
            await asyncio.sleep(0.01)
        # Still answering while draining.
        status = await pb_grpc.RendezvousServiceStub(channel).GetStatus(pb.GetStatusRequest())
        assert status.store == "memory"
        assert not stopping.done()
        server.end_drain()
        await stopping
        try:
            await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        else:
            raise AssertionError("a stopped server answered")


async def test_reflection_lists_the_service(server: RendezvousServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        names = {s.name for s in response.list_services_response.service}
        await call.done_writing()
    assert {SERVICE, "grpc.health.v1.Health"} <= names


async def test_metrics_endpoint_reports_rpcs_and_transfers(server_config: ServerConfig) -> None:
    server = RendezvousServer(replace(server_config, metrics_listen="127.0.0.1:0", health_interval=0.05))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            # The longest lease: the engine must still be counted when the gauges are read, however slow the machine.
            await stub.RegisterEngine(engine_request("d1", pb.ENGINE_ROLE_CONSUMER, lease_ttl=Duration(seconds=300)))
            await stub.RegisterTargets(
                pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
            )
            await stub.AbortTransfers(pb.AbortTransfersRequest(aborts=[pb.AbortSpec(transfer_id="t")]))
            stored = ipb.CacheEvent(stored=ipb.BlocksStored(block_hashes=[b"h"]))
            hashing = ipb.BlockHashing(algorithm="sha256", block_size=16)
            report = ipb.ReportCacheEventsRequest(engine_id="d1", hashing=hashing, events=[stored])
            await ipb_grpc.KvIndexServiceStub(channel).ReportCacheEvents(report)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert 'kv_rendezvous_rpcs_total{code="OK",method="RegisterTargets"} 1.0' in body
        assert 'kv_rendezvous_transfer_aborts_total{reason="REQUESTED"} 1.0' in body
        assert "kv_rendezvous_match_wait_seconds_bucket" in body
        # The memory budget's gauges follow the store (refreshed every health_interval).
        used = 'kv_rendezvous_budget_used{budget="engines"} 1.0'
        deadline = asyncio.get_running_loop().time() + 30  # a wait that must succeed: the refresh is every 0.05 s
        while used not in body and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert used in body and 'kv_rendezvous_budget_used{budget="live_blocks"} 0.0' in body
        # The KV index's blocks are counted with them (refreshed in the same step).
        assert 'kv_rendezvous_budget_used{budget="index_blocks"} 1.0' in body
        prefix = 'kv_rendezvous_budget_limit{budget="index_blocks"} '
        (limit,) = (float(line.removeprefix(prefix)) for line in body.splitlines() if line.startswith(prefix))
        assert limit == server_config.limits.max_index_blocks_total
        assert f'kv_rendezvous_budget_limit{{budget="engines"}} {float(server_config.limits.max_engines)}' in body
    finally:
        await server.stop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_serves_answers_operator_commands_and_exits_cleanly_on_sigterm() -> None:
    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "KV_RENDEZVOUS_LISTEN": address, "KV_RENDEZVOUS_DRAIN": "0"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "rendezvous.cli", "serve", "--metrics-listen", "off", "--log-format", "json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert serve.stdout is not None
        banner = serve.stdout.readline()
        assert f"serving on {address}" in banner
        with grpc.insecure_channel(address) as channel:
            pb_grpc.RendezvousServiceStub(channel).RegisterEngine(engine_request("d1", pb.ENGINE_ROLE_CONSUMER))
        cli = [sys.executable, "-m", "rendezvous.cli"]
        status = subprocess.run([*cli, "status", "--address", address], capture_output=True, text=True, check=True)
        rows = dict(line.rsplit(maxsplit=1) for line in status.stdout.splitlines()[1:])
        assert rows["live engines"] == "1" and rows["live transfers"] == "0"
        engines = subprocess.run([*cli, "engines", "--address", address], capture_output=True, text=True, check=True)
        assert engines.stdout.splitlines()[1].split()[:3] == ["d1", "decode", "consumer"]
        read, write = os.pipe()
        os.close(read)  # a reader that left, as `| head -2` does once it has its lines
        try:
            cut = subprocess.run(
                [*cli, "status", "--address", address],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
            )
        finally:
            os.close(write)
        assert cut.returncode == 141 and "Traceback" not in cut.stderr, cut.stderr  # a BrokenPipeError's, before
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=15) == 0
        assert '"message": "stopped"' in serve.stderr.read()  # type: ignore[union-attr]
    finally:
        serve.kill()
        serve.wait()


@contextlib.contextmanager
def serving(drain: float) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`kv-rendezvous serve` (memory store) on a port the system picks (one picked here and released could be
    taken before the server binds it), with `--drain`, once its banner (which names the port) is out; killed
    after."""
    env = {**os.environ, "KV_RENDEZVOUS_LISTEN": "127.0.0.1:0", "KV_RENDEZVOUS_DRAIN": f"{drain:g}"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "rendezvous.cli", "serve", "--metrics-listen", "off"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert serve.stdout is not None
        banner = serve.stdout.readline()
        found = re.search(r"serving on (127\.0\.0\.1:[1-9][0-9]*) ", banner)
        assert found, banner
        yield serve, found[1]
    finally:
        serve.kill()
        serve.wait()


def test_cli_drains_on_sigterm_and_a_second_sigterm_ends_the_drain() -> None:
    with serving(drain=300) as (serve, address):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            serve.send_signal(signal.SIGTERM)
            while health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30).status != (
                health_pb2.HealthCheckResponse.NOT_SERVING
            ):
                time.sleep(0.01)
            # Draining: still answering, and it would for 300 s.
            assert pb_grpc.RendezvousServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=30).store == "memory"
            assert serve.poll() is None
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0


def test_cli_a_sigterm_right_after_the_banner_stops_it_cleanly() -> None:
    """The banner says the server is up; a supervisor may stop it at once. Before, the banner came before the
    signal handlers, and about half such stops killed the process (exit -15) instead of stopping it."""
    for _ in range(5):
        with serving(drain=0) as (serve, _):
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(timeout=60) == 0


def test_cli_reports_an_unreachable_server_and_a_bad_store() -> None:
    cli = [sys.executable, "-m", "rendezvous.cli"]
    down = subprocess.run(
        [*cli, "status", "--address", f"127.0.0.1:{_free_port()}", "--timeout", "0.5"], capture_output=True, text=True
    )
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    bad = subprocess.run(
        [*cli, "serve", "--store", "postgres://x", "--listen", "127.0.0.1:0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown store" in bad.stderr


def test_json_logs_carry_the_transfer_id_of_an_abort() -> None:
    import json
    import logging

    from rendezvous.logs import JsonFormatter

    record = logging.LogRecord("rendezvous.coordinator", logging.INFO, __file__, 1, "transfer aborted", None, None)
    record.transfer_id = "t-42"
    record.abort_reason = "DEADLINE_EXCEEDED"
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["message"], entry["transfer_id"], entry["abort_reason"]) == (
        "transfer aborted",
        "t-42",
        "DEADLINE_EXCEEDED",
    )


async def test_an_abort_is_logged_with_its_transfer_id(
    server: RendezvousServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="rendezvous.coordinator")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        await stub.RegisterEngine(engine_request("d1", pb.ENGINE_ROLE_CONSUMER))
        await stub.RegisterTargets(
            pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id="t-logged", block_ids=[1])])
        )
        await stub.AbortTransfers(pb.AbortTransfersRequest(aborts=[pb.AbortSpec(transfer_id="t-logged")]))
    (record,) = [r for r in caplog.records if r.getMessage() == "transfer aborted"]
    assert (record.transfer_id, record.abort_reason, record.from_state) == ("t-logged", "REQUESTED", "TARGETED")  # type: ignore[attr-defined]
