"""The memory budget holds the server's memory (issue 17, item 3): a bound on RSS, not a timing.

A server (the CLI, in a subprocess, memory store) with a small budget is attacked as docs/security.md
measured it without one: 65,536-block targets registered and aborted over and over (whose tombstones used to
keep their block ids), many 65,536-block targets, many engines with 1 MiB of agent metadata each, and engines
that register and deregister over and over (whose tombstones used to keep their metadata). Its RSS
may grow by at most what the budget admits (block ids at 48 bytes, as measured in the server, and the metadata
bytes) plus an allowance: the metadata budget once more, since the native copies of the 1 MiB requests (gRPC's
receive buffers, the parsed message) stay in glibc's heap after the call (measured: 31 engines of 1 MiB hold
about 67 MiB of RSS, while Python's own objects hold 31 MiB), and FIXED_ALLOWANCE for everything else. The
attack offers several times that, so without the budget the bound fails (measured: 418 MiB of growth).

Run it as a script to print the numbers (`python -m tests.security.test_budget_rss`; `--no-budget` to see
what the attack costs without one).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import grpc

from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.conftest import LAYOUT

MIB = 1 << 20
BLOCKS_PER_TARGET = 65_536
BYTES_PER_BLOCK_ID = 48  # measured here: 15 targets of 65,536 blocks, +46 MiB
BUDGET = {
    "max_live_blocks": 1_000_000,  # ~40 MB of block ids
    "max_agent_metadata_bytes_total": 32 * MIB,
    "max_engines": 64,
}
FIXED_ALLOWANCE = 64 * MIB
ABORTED_TARGETS = 60  # registered and aborted at once: 60 x 2.62 MiB more if tombstones kept their blocks
TARGETS = 120  # 120 x 2.62 MiB = 315 MiB offered
METADATA_ENGINES = 100  # 100 MiB offered
CHURN_ROUNDS = 3  # register and deregister the metadata engines again: 3 x 32 MiB more if tombstones kept it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int) -> int:
    """Resident set size of a process, in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _engine(engine_id: str, metadata: int, num_blocks: int = 1024) -> pb.RegisterEngineRequest:
    """An engine whose lease is the longest the server grants: nothing renews it, and on a loaded machine the
    attack can outlast the default 10 s (the victim lapsed before its targets were all registered)."""
    region = pb.KvRegion(base_address=1 << 30, block_stride_bytes=4096, block_length_bytes=4096, num_blocks=num_blocks)
    agent = pb.NixlAgent(
        name=engine_id + "-0", metadata=os.urandom(metadata), memory_kind=pb.MEMORY_KIND_DRAM, regions=[region]
    )
    request = pb.RegisterEngineRequest(
        engine_id=engine_id, pool="decode", role=pb.ENGINE_ROLE_CONSUMER, layout=LAYOUT, agents=[agent]
    )
    request.lease_ttl.FromSeconds(300)
    return request


def _refused(call: Any) -> bool:
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        return True
    return False


def attack(budget: dict[str, int] | None) -> dict[str, int]:
    """Run the attack against a fresh server; the RSS numbers and how much the server accepted."""
    address = f"127.0.0.1:{_free_port()}"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in (budget or {}).items()]
    serve = subprocess.Popen(
        [sys.executable, "-m", "rendezvous.cli", "serve", "--listen", address, "--metrics-listen", "off", *flags],
        env={**os.environ, "KV_RENDEZVOUS_DRAIN": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert serve.stdout is not None
        assert "serving on" in serve.stdout.readline()
        options = [("grpc.max_send_message_length", 64 * MIB), ("grpc.max_receive_message_length", 64 * MIB)]
        with grpc.insecure_channel(address, options=options) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            # Warm up every path the attack takes, then take the baseline.
            victim = stub.RegisterEngine(_engine("victim", 64, BLOCKS_PER_TARGET), timeout=30).engine
            warm = pb.RegisterTargetsRequest(engine_id="victim", incarnation=victim.incarnation)
            warm.targets.add(transfer_id="warm", block_ids=range(16), generation=1)
            stub.RegisterTargets(warm, timeout=30)
            churn = stub.RegisterEngine(_engine("warm-engine", MIB), timeout=30).engine
            stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="warm-engine", incarnation=churn.incarnation))
            base = rss(serve.pid)
            blocks = range(BLOCKS_PER_TARGET)
            aborted = 0
            for n in range(ABORTED_TARGETS):
                request = pb.RegisterTargetsRequest(engine_id="victim", incarnation=victim.incarnation)
                request.targets.add(transfer_id=f"aborted-{n}", block_ids=blocks, generation=1)
                aborted += stub.RegisterTargets(request, timeout=60).results[0].status.code == 0
                abort = pb.AbortTransfersRequest(engine_id="victim", incarnation=victim.incarnation)
                abort.aborts.add(transfer_id=f"aborted-{n}")
                stub.AbortTransfers(abort, timeout=30)
            after_aborts = rss(serve.pid)
            accepted_targets = 0
            for n in range(TARGETS):
                request = pb.RegisterTargetsRequest(engine_id="victim", incarnation=victim.incarnation)
                request.targets.add(transfer_id=f"big-{n}", block_ids=blocks, generation=1)
                result = stub.RegisterTargets(request, timeout=60).results[0]
                accepted_targets += result.status.code == 0
            after_targets = rss(serve.pid)
            accepted_engines = 0
            peak = after_targets
            for round_ in range(CHURN_ROUNDS + 1):
                live = []
                for n in range(METADATA_ENGINES):
                    engine_id = f"meta-{round_}-{n}"
                    reply: list[Any] = []

                    def register(engine_id: str = engine_id, reply: list[Any] = reply) -> None:
                        reply.append(stub.RegisterEngine(_engine(engine_id, MIB), timeout=30).engine)

                    if not _refused(register):
                        live.append(reply[0])
                peak = max(peak, rss(serve.pid))
                accepted_engines += len(live)
                if round_ < CHURN_ROUNDS:  # the last round stays registered
                    for engine in live:
                        end = pb.DeregisterEngineRequest(engine_id=engine.engine_id, incarnation=engine.incarnation)
                        stub.DeregisterEngine(end, timeout=30)
            end_rss = rss(serve.pid)
            health = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
            assert health.header.epoch
        return {
            "base": base,
            "after_aborts": after_aborts,
            "after_targets": after_targets,
            "end": end_rss,
            "peak": max(peak, end_rss),
            "aborted_targets": aborted,
            "accepted_targets": accepted_targets,
            "accepted_engines": accepted_engines,
        }
    finally:
        serve.kill()
        serve.wait()


def bound() -> int:
    """What the budget admits, plus the allowance (the metadata budget again, and FIXED_ALLOWANCE)."""
    metadata = BUDGET["max_agent_metadata_bytes_total"]
    return BUDGET["max_live_blocks"] * BYTES_PER_BLOCK_ID + metadata + metadata + FIXED_ALLOWANCE


def offered() -> int:
    """What the attack sends that a server without budget would keep."""
    targets = (ABORTED_TARGETS + TARGETS) * BLOCKS_PER_TARGET * BYTES_PER_BLOCK_ID
    return targets + METADATA_ENGINES * MIB * (CHURN_ROUNDS + 1)


def test_rss_stays_within_the_budget_under_attack() -> None:
    assert offered() > 3 * bound()  # without the budget the bound could not hold
    numbers = attack(BUDGET)
    # The server accepted what the budget admits (the victim's own blocks and metadata count too)...
    assert numbers["aborted_targets"] == ABORTED_TARGETS  # each one's blocks come back when it aborts
    assert numbers["accepted_targets"] == (BUDGET["max_live_blocks"] - 16) // BLOCKS_PER_TARGET
    assert numbers["accepted_engines"] >= (CHURN_ROUNDS + 1) * (BUDGET["max_agent_metadata_bytes_total"] // MIB - 2)
    # ... and its memory grew by no more than that.
    growth = numbers["peak"] - numbers["base"]
    assert growth < bound(), {k: v / MIB for k, v in numbers.items()}


if __name__ == "__main__":
    numbers = attack(None if "--no-budget" in sys.argv else BUDGET)
    for key, value in numbers.items():
        print(
            f"{key:18} {value / MIB:9.1f} MiB"
            if key in ("base", "after_aborts", "after_targets", "end", "peak")
            else f"{key:18} {value}"
        )
    print(f"{'growth (peak)':18} {(numbers['peak'] - numbers['base']) / MIB:9.1f} MiB")
    print(f"{'bound':18} {bound() / MIB:9.1f} MiB   offered {offered() / MIB:.1f} MiB")
