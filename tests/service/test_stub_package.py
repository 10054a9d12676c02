"""`scripts/generate_stubs.py --package`: protocol stubs for code outside the service, under a name of its own."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from rendezvous.server import RendezvousServer

ROOT = Path(__file__).resolve().parents[2]

CLIENT = """
import sys
import grpc
from rendezvous.v1 import rendezvous_pb2 as service_pb  # the service's own stubs, in the same process
from my_engine.rdv import rendezvous_pb2 as pb, rendezvous_pb2_grpc as pb_grpc

assert pb.__name__ == "my_engine.rdv.rendezvous_pb2"
assert pb.Engine.DESCRIPTOR is service_pb.Engine.DESCRIPTOR  # one protocol: the same descriptors
with grpc.insecure_channel(sys.argv[1]) as channel:
    print("version", pb_grpc.RendezvousServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=30).version)
"""


async def test_stubs_generate_under_another_package_and_talk_to_the_service(
    server: RendezvousServer, tmp_path: Path
) -> None:
    generate = [sys.executable, "scripts/generate_stubs.py", "--package", "my_engine.rdv", "--out", str(tmp_path)]
    made = await asyncio.to_thread(subprocess.run, generate, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "my_engine" / "rdv" / "rendezvous_pb2_grpc.py").exists()
    assert not (tmp_path / "rendezvous").exists()
    run = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", CLIENT, server.address],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("version ")


def test_a_package_inside_the_service_namespace_is_refused(tmp_path: Path) -> None:
    generate = [sys.executable, "scripts/generate_stubs.py", "--package", "rendezvous.v2", "--out", str(tmp_path)]
    refused = subprocess.run(generate, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "outside `rendezvous`" in refused.stderr
