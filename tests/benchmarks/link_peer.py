"""One side of a NIXL WRITE across a netlab link, run in that side's namespace (tests/benchmarks/test_netlab_nixl.py).

    python -m tests.benchmarks.link_peer consumer     prints its agent as one JSON line, then waits for the
                                                      transfer's notification and prints what landed
    python -m tests.benchmarks.link_peer producer     reads the consumer's line on stdin, WRITEs every block
                                                      into it, prints the transfer's final status

Both sides fill their regions from the same seed (the producer with the data, the consumer with the sentinel), so
the consumer can compare what landed without the bytes travelling any other way. UCX comes from the namespace's
environment (netlab.sh exec: UCX_TLS=tcp, UCX_NET_DEVICES=<its veth>). Every wait is bounded.
"""

from __future__ import annotations

import base64
import json
import sys
import time

import numpy as np
import numpy.typing as npt

from rendezvous.clients.nixl import (
    KvRegion,
    NixlAgentInfo,
    NixlEndpoint,
    TransferReceiver,
    XferStatus,
    encode_notification,
)

REGIONS = 2
BLOCKS = 64
BLOCK_BYTES = 32 * 1024
SEED = 25
SENTINEL = 0xA5
TRANSFER_ID = "across-the-link"
GENERATION = 1
WAIT_S = 60.0


def buffers(fill_random: bool) -> list[npt.NDArray[np.uint8]]:
    """One [BLOCKS * BLOCK_BYTES] buffer per region: the seeded data, or the sentinel."""
    if fill_random:
        rng = np.random.default_rng(SEED)
        return [rng.integers(0, 256, BLOCKS * BLOCK_BYTES, dtype=np.uint8) for _ in range(REGIONS)]
    return [np.full(BLOCKS * BLOCK_BYTES, SENTINEL, dtype=np.uint8) for _ in range(REGIONS)]


def endpoint(name: str, memory: list[npt.NDArray[np.uint8]]) -> NixlEndpoint:
    regions = [KvRegion(b.ctypes.data, BLOCK_BYTES, BLOCK_BYTES, BLOCKS) for b in memory]
    return NixlEndpoint(name, regions)


def encode_agent(agent: NixlAgentInfo) -> str:
    regions = [[r.base_address, r.block_stride_bytes, r.block_length_bytes, r.num_blocks] for r in agent.regions]
    return json.dumps({"name": agent.name, "metadata": base64.b64encode(agent.metadata).decode(), "regions": regions})


def decode_agent(line: str) -> NixlAgentInfo:
    fields = json.loads(line)
    regions = tuple(KvRegion(*r) for r in fields["regions"])
    return NixlAgentInfo(fields["name"], base64.b64decode(fields["metadata"]), regions=regions)


def consumer() -> int:
    memory = buffers(fill_random=False)
    receiver = TransferReceiver(endpoint("link-consumer", memory))
    print(encode_agent(receiver.agent_info()), flush=True)
    deadline = time.monotonic() + WAIT_S
    while not (notifications := receiver.poll_notifications()):
        if time.monotonic() > deadline:
            print(json.dumps({"error": f"no notification within {WAIT_S} s"}), flush=True)
            return 1
        time.sleep(1e-3)
    landed = all(np.array_equal(got, want) for got, want in zip(memory, buffers(fill_random=True), strict=True))
    received = [f"{n.transfer_id}:{n.generation}" for n in notifications]
    print(json.dumps({"notifications": received, "equal": landed}), flush=True)
    receiver.close()
    return 0


def producer() -> int:
    memory = buffers(fill_random=True)
    local = endpoint("link-producer", memory)
    peer = decode_agent(sys.stdin.readline())
    local.add_peer(peer, incarnation=1)
    blocks = list(range(BLOCKS))
    posted = local.post("WRITE", peer.name, blocks, blocks, encode_notification(TRANSFER_ID, GENERATION))
    deadline = time.monotonic() + WAIT_S
    while (status := local.poll(posted)) is XferStatus.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(1e-3)
    local.release(posted)
    print(json.dumps({"status": status.value, "bytes": REGIONS * BLOCKS * BLOCK_BYTES}), flush=True)
    local.close()
    return 0 if status is XferStatus.DONE else 1


if __name__ == "__main__":
    sys.exit({"consumer": consumer, "producer": producer}[sys.argv[1]]())
