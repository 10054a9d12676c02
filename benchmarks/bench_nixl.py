"""NIXL data-plane benchmark: two processes on loopback, this one producing, a spawned one consuming.

  throughput  one WRITE of 64 MiB as blocks of each size, in scattered order (NIXL cannot merge the blocks)
              and, for the smallest size, in order (NIXL merges neighbouring blocks into larger transfers)
  round trip  a one-block WRITE with notification, answered by a one-block WRITE back (NixlEndpoint), with
              both sides polling in a tight loop, then both polling with the library's backoff
  writer      TransferWriter with the assignment already held: source_ready() -> on_complete, one 4 KiB block,
              the consumer polling with backoff
  posting     one transfer of a 118-block context (32 layers x K and V, 16 tokens per block; one token of one
              head is 64 fp16, or 2 bytes so that descriptors dominate): descriptors, plan time, post time
              (making the transfer handle + the transfer call) and time to DONE, for whole blocks (TP 1 -> 1:
              prepared lists with indices, or per-transfer lists from rendezvous.clients.nixl.plan, unmerged or merged)
              and for one rank's head slice (TP 2 -> 1, HND, and vLLM-CPU's HKTV where the unit allows)
  parts       progressive push on a TransferWriter: one layer of a 512-token prompt (64 scattered block
              descriptors of 1 KiB) handed over and posted, per part (32 in a row, and one at a time), and one
              layer of 8 requests, against NIXL's own prepared post of the same descriptors measured in the same
              run (see `parts`)
  integrity   end-to-end checksums (`--only-integrity`): a TransferWriter's whole write of the buffer in 64 KiB
              blocks, source_ready -> on_complete, with `WriterConfig.integrity` off and on (the producer's
              xxh3 digests), and the consumer's check (`block_digests` over the same blocks) with zlib.crc32 of
              the same bytes beside it; each as seconds per GiB. Then the same bytes as a progressive write of
              32 layers x K and V in 16 KiB blocks: all layers but the last handed over as parts and written,
              then the last layer and source_ready -> on_complete, integrity off and on (what is left for the
              final once the parts were hashed as they went), and on as TP rank 0 of 2 into a TP 1 consumer
              (scoped digests, each layer's regions hashed once its part is posted), and the consumer's check
              at arrival: the whole
              target hashed then, or only the last layer (`LandedDigests`, the others hashed as they landed).
              Last, scoped digests (hetero layouts) of half the heads of the same 64 KiB blocks (8 heads x 16
              tokens x 512 B), a consumer's `scope_digests` (its plan and the hash), HND (one range per block)
              and NHD (one per token), as seconds per GiB hashed
  agent modes with a real service (`--only-pull-read`, `--only-source-hold`, `--only-pull-commit`; see
              benchmarks/nixl_agents.py): what the rank agents' reports cost on the path, per one-block transfer:
              a pull READ's end -> its result, a pushed source's write end -> on_free, and a two-rank pull consumer's
              commit -> release

Both sides must poll for a WRITE to complete (see rendezvous.clients.nixl.agent). Spinning pollers on a machine with few
cores fight each other and everything else for the CPU: read the tails with the machine's load in mind.

    python -m benchmarks.bench_nixl [--total-mib 64] [--reps 5] [--round-trips 1000] [--output nixl.json]
                                    [--only-parts | --only-integrity]
    python -m benchmarks.bench_nixl --only-pull-read | --only-source-hold [--transfers 200] [--output ...]
    python -m benchmarks.bench_nixl --only-pull-commit [--at-once 60] [--output ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import replace
from importlib.metadata import version
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # its sibling nixl_agents, as `python -m benchmarks.bench_nixl` too
import nixl_agents

from rendezvous.clients.nixl import (
    KvRegion,
    NixlAgentInfo,
    NixlEndpoint,
    TransferReceiver,
    TransferWriter,
    WriterConfig,
    XferStatus,
)
from rendezvous.clients.nixl.integrity import LandedDigests, block_digests, scope_digests
from rendezvous.clients.nixl.notifications import DigestScope
from rendezvous.clients.nixl.plan import RankGeometry, plan_write
from rendezvous.clients.nixl.polling import Backoff, PollConfig
from rendezvous.clients.nixl.writer import ConsumerEngine
from rendezvous.protocol import kvmap
from rendezvous.protocol.kvmap import RankShare
from rendezvous.protocol.records import KvLayout, WrittenPart

RESULTS = Path(__file__).parent / "results"
BLOCK_SIZES = (16 << 10, 64 << 10, 256 << 10, 2 << 20)
TINY_BLOCK = 64
WRITER_BLOCK = 4 << 10
AGENT_MODES = ("pull-read", "source-hold", "pull-commit")
"""The modes with a real service and the rank agents (`benchmarks.nixl_agents`), each run alone."""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_region(buffer: np.ndarray[Any, Any], block: int) -> list[KvRegion]:
    return [KvRegion(buffer.ctypes.data, block, block, buffer.nbytes // block)]


def consumer(conn: Connection, total: int) -> None:
    """Serve endpoints over one buffer; poll them all; answer a "ping:<i>" notification with a WRITE back.

    Polls in a tight loop, or with the library's backoff after the "backoff" command. Endpoints are closed
    after use: every NIXL agent brings its own UCX workers and threads to poll."""
    buffer = np.zeros(total, dtype=np.uint8)
    receivers: dict[str, TransferReceiver] = {}
    answers = []
    backoff: Backoff | None = None
    while True:
        progressed = False
        if conn.poll():
            progressed = True
            command, *args = conn.recv()
            if command == "stop":
                break
            if command == "create":
                name, block = args
                receivers[name] = TransferReceiver(NixlEndpoint(name, one_region(buffer, block)))
                conn.send(receivers[name].agent_info())
            elif command == "close":
                receivers.pop(args[0]).close()
                conn.send(None)
            elif command == "add_peer":
                name, agent = args
                receivers[name].add_peer(agent, 1)
                conn.send(None)
            elif command == "backoff":
                backoff = Backoff(PollConfig()) if args[0] else None
                conn.send(None)
        for receiver in receivers.values():
            for n in receiver.poll_notifications():
                progressed = True
                if n.transfer_id == "ping":
                    pong = f"pong:{n.generation}".encode()
                    answers.append((receiver, receiver.endpoint.post("WRITE", n.sender, [1], [1], pong)))
        for answer in [a for a in answers if a[0].endpoint.poll(a[1]) is not XferStatus.IN_PROGRESS]:
            progressed = True
            answers.remove(answer)
            answer[0].endpoint.release(answer[1])
        if backoff and progressed:
            backoff.reset()
        elif backoff:
            time.sleep(backoff.next())  # not conn.poll(timeout): its timeout is rounded up to milliseconds
    for receiver in receivers.values():
        receiver.close()


class Consumer:
    def __init__(self, total: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=consumer, args=(child, total), daemon=True)
        self.process.start()

    def call(self, *request: Any) -> Any:
        self.conn.send(request)
        if not self.conn.poll(60):
            raise TimeoutError(f"consumer did not answer {request[0]}")
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.process.join(30)


def wait(endpoint: NixlEndpoint, posted: Any) -> None:
    while endpoint.poll(posted) is XferStatus.IN_PROGRESS:
        pass
    endpoint.release(posted)
    if posted.status is not XferStatus.DONE:
        raise RuntimeError(posted.error)


def throughput(peer: Consumer, buffer: np.ndarray[Any, Any], block: int, scattered: bool, reps: int) -> float:
    """GiB/s of the median of `reps` WRITEs of the whole buffer, after one warm-up WRITE."""
    name = f"bench-{block}-{'s' if scattered else 'c'}"
    agent = peer.call("create", f"{name}-dst", block)
    endpoint = NixlEndpoint(f"{name}-src", one_region(buffer, block))
    endpoint.add_peer(agent, 1)
    n = buffer.nbytes // block
    src = np.arange(n)
    dst = np.random.default_rng(block).permutation(n) if scattered else src
    seconds = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        wait(endpoint, endpoint.post("WRITE", agent.name, src, dst, b"bulk:1"))
        seconds.append(time.perf_counter() - start)
    endpoint.close()
    peer.call("close", agent.name)
    return buffer.nbytes / statistics.median(seconds[1:]) / 2**30


def round_trips(peer: Consumer, count: int, backoff: bool) -> list[float]:
    """Seconds from posting a ping WRITE to seeing the pong notification, `count` times after a warm-up.
    Both sides spin, or both poll with the library's default backoff."""
    buffer = np.zeros(TINY_BLOCK * 4, dtype=np.uint8)
    endpoint = NixlEndpoint("bench-ping", one_region(buffer, TINY_BLOCK))
    agent = peer.call("create", "bench-pong", TINY_BLOCK)
    endpoint.add_peer(agent, 1)
    peer.call("add_peer", "bench-pong", endpoint.agent_info())
    peer.call("backoff", backoff)
    samples = []
    for i in range(count + 20):
        start = time.perf_counter()
        posted = endpoint.post("WRITE", agent.name, [0], [0], f"ping:{i}".encode())
        expected = f"pong:{i}".encode()
        pause = Backoff(PollConfig())
        # Poll the ping too: a new connection and the notification only progress while the WRITE is polled.
        while expected not in endpoint.get_notifications().get(agent.name, []):
            endpoint.poll(posted)
            if backoff:
                time.sleep(pause.next())
        samples.append(time.perf_counter() - start)
        wait(endpoint, posted)
    peer.call("backoff", False)
    endpoint.close()
    peer.call("close", agent.name)
    return samples[20:]


def writer_latencies(peer: Consumer, count: int) -> list[float]:
    """Seconds from source_ready() to on_complete, with the assignment already held by the writer."""
    buffer = np.zeros(WRITER_BLOCK * 16, dtype=np.uint8)
    agent: NixlAgentInfo = peer.call("create", "bench-writer-dst", WRITER_BLOCK)
    completed = threading.Event()
    outcomes: list[bool] = []

    def on_complete(transfer_id: str, generation: int, ok: bool, error: str | None) -> None:
        outcomes.append(ok)
        completed.set()

    writer = TransferWriter(
        NixlEndpoint("bench-writer-src", one_region(buffer, WRITER_BLOCK)),
        on_complete=on_complete,
        on_revoked=lambda *_: None,
        on_source_free=lambda *_: None,
    )
    samples = []
    with writer:
        for i in range(count + 20):
            writer.assign(f"t{i}", 1, agent, 1, [i % 16])
            writer.barrier()
            completed.clear()
            start = time.perf_counter()
            writer.source_ready(f"t{i}", [i % 16])
            if not completed.wait(10):
                raise TimeoutError("writer did not complete")
            samples.append(time.perf_counter() - start)
    if not all(outcomes):
        raise RuntimeError("a benchmark write failed")
    return samples[20:]


POST_REGIONS = 64  # 32 layers x K and V
POST_HEADS = 4  # KV heads of the model
POST_TOKENS = 16  # tokens per block
POST_UNITS = (128, 2)  # bytes of one token of one head: 64 x fp16; 2 makes the bytes negligible next to descriptors
POST_BLOCKS = 118
POST_ELEMENT = 2  # bytes of an element (fp16): HKTV's key rows are a token's element each


def layer_regions(base: int, block: int, num_blocks: int) -> list[KvRegion]:
    """`POST_REGIONS` regions of `num_blocks` blocks, back to back from `base`."""
    return [KvRegion(base + r * block * num_blocks, block, block, num_blocks) for r in range(POST_REGIONS)]


def posting(peer: Consumer, total: int, reps: int) -> list[dict[str, Any]]:
    """Per mode: descriptors of one transfer, median plan, post and to-DONE microseconds over `reps`."""
    rows = []
    for unit in POST_UNITS:
        rows += _posting(peer, total, reps, unit)
    return rows


def _posting(peer: Consumer, total: int, reps: int, unit: int) -> list[dict[str, Any]]:
    block_d = POST_HEADS * POST_TOKENS * unit
    num_blocks = min(total // (POST_REGIONS * block_d), 256)
    agent: NixlAgentInfo = peer.call("create", f"bench-post-dst-{unit}", block_d)
    remote_regions = layer_regions(agent.regions[0].base_address, block_d, num_blocks)
    src, dst = np.arange(POST_BLOCKS), np.arange(POST_BLOCKS) + 5
    rows = []
    for tp in (1, 2):
        heads = POST_HEADS // tp
        block_p = heads * POST_TOKENS * unit
        buffer = np.random.default_rng(tp).integers(0, 256, POST_REGIONS * block_p * num_blocks, dtype=np.uint8)
        regions = layer_regions(buffer.ctypes.data, block_p, num_blocks)
        endpoint = NixlEndpoint(f"bench-post-src-{unit}-{tp}", regions)
        endpoint.add_peer(dataclasses.replace(agent, regions=tuple(remote_regions)), 1, whole_blocks=tp == 1)
        share = RankShare(0, 0, range(POST_REGIONS), range(POST_REGIONS), 0, 0, heads)
        producer = RankGeometry(regions, heads, POST_TOKENS, POST_ELEMENT)
        consumer = RankGeometry(remote_regions, POST_HEADS, POST_TOKENS, POST_ELEMENT)
        modes = ["prepared lists, indices"] if tp == 1 else []
        modes += ["per-transfer lists, unmerged", "per-transfer lists, merged"]
        if tp == 2 and unit % (2 * POST_ELEMENT) == 0:  # vLLM-CPU's layout: keys transposed, then the values
            modes.append("per-transfer lists, merged, HKTV")
        for mode in modes:
            samples, count = [], 0
            for _ in range(reps + 2):
                start = time.perf_counter()
                if mode.startswith("prepared"):
                    count = POST_REGIONS * POST_BLOCKS
                    planned = time.perf_counter()
                    posted = endpoint.post("WRITE", agent.name, src, dst, b"post:1")
                else:
                    kv_layout = kvmap.HKTV if mode.endswith("HKTV") else "HND"
                    plan = plan_write(producer, consumer, share, src, dst, kv_layout, merge="unmerged" not in mode)
                    count, planned = plan.num_descriptors, time.perf_counter()
                    posted = endpoint.post_descriptors("WRITE", agent.name, plan.local, plan.remote, b"post:1")
                sent = time.perf_counter()
                wait(endpoint, posted)
                samples.append((planned - start, sent - planned, time.perf_counter() - start))
            plan_s, post_s, done_s = (statistics.median(x) for x in zip(*samples[2:], strict=True))
            rows.append(
                {
                    "case": f"TP {tp} -> 1" + (" (whole blocks)" if tp == 1 else " (head slice)"),
                    "mode": mode,
                    "unit_bytes": unit,
                    "descriptors": count,
                    "bytes": POST_REGIONS * POST_BLOCKS * block_p,
                    "plan_us": plan_s * 1e6,
                    "post_us": post_s * 1e6,
                    "done_us": done_s * 1e6,
                }
            )
        endpoint.close()
    peer.call("close", agent.name)
    return rows


PART_LAYERS = 32  # 64 regions: K and V of each layer
PART_TOKENS = 512  # the prompt: 32 blocks of POST_TOKENS
PART_BLOCK = POST_HEADS * POST_TOKENS * 16  # bytes of a block of one region: 1 KiB
PART_REQUESTS = 8  # requests whose same layer is handed over together


def parts(peer: Consumer, total: int, reps: int) -> dict[str, Any]:
    """Progressive push's cost on the writer thread, against NIXL's own prepared post, per rep (fresh transfers):

    - part: a 512-token prompt handed over layer by layer (`source_part`), 32 parts, each posted at once:
      the time from the first `source_part` to the writer having handled the last (`barrier`), per part;
      caller: of that, the time in the calls themselves (what the thread running the forward pays), per part;
    - part alone: the same parts handed over one at a time, each followed by a `barrier` (the writer wakes for
      it, places it and posts its WRITE), per part; barrier: an empty `barrier`'s round trip, the share of the
      thread hand-off in it;
    - layer of N requests: one layer of `PART_REQUESTS` prompts handed over together, the same time for all;
    - floor: `NixlEndpoint.post_indices` of one layer's prepared descriptors, indices computed beforehand
      (NIXL's make_prepped_xfer + transfer and nothing of ours but a call), per post; and of the same layer of
      `PART_REQUESTS` prompts in one post.

    Each also as CPU time (`*_cpu_us`): the writer thread's (its CPU clock read from this thread) for the part,
    part alone and layer of N, this thread's for the floors. On a busy machine wall times measure the scheduler as
    much as the code; CPU times much less so.
    """
    blocks = PART_TOKENS // POST_TOKENS
    num_blocks = min(total // (POST_REGIONS * PART_BLOCK), 1024)
    assert num_blocks >= PART_REQUESTS * blocks, "--total-mib is too small for the parts benchmark"
    agent: NixlAgentInfo = peer.call("create", "bench-parts-dst", PART_BLOCK)
    remote_regions = layer_regions(agent.regions[0].base_address, PART_BLOCK, num_blocks)
    agent = dataclasses.replace(agent, regions=tuple(remote_regions))
    buffer = np.random.default_rng(3).integers(0, 256, POST_REGIONS * PART_BLOCK * num_blocks, dtype=np.uint8)
    regions = layer_regions(buffer.ctypes.data, PART_BLOCK, num_blocks)
    done: dict[str, threading.Event] = {}
    failed: list[str] = []

    def on_complete(transfer_id: str, generation: int, ok: bool, error: str | None) -> None:
        if not ok:
            failed.append(f"{transfer_id}: {error}")
        done[transfer_id].set()

    layout = KvLayout("bench", "uint8", POST_TOKENS, PART_LAYERS, kv_layout="HND")
    writer = TransferWriter(
        NixlEndpoint("bench-parts-src", regions),
        on_complete=on_complete,
        on_revoked=lambda *_: None,
        on_source_free=lambda *_: None,
        config=WriterConfig(max_parts_in_flight=PART_LAYERS, part_compute_ratio=0.0),  # every part posted
        layout=layout,
    )
    src = np.arange(blocks)
    samples: dict[str, list[float]] = {
        "part_us": [],
        "caller_us": [],
        "part_alone_us": [],
        "barrier_us": [],
        "part_cpu_us": [],
        "part_alone_cpu_us": [],
        "layer_of_n_cpu_us": [],
        "floor_cpu_us": [],
        "floor_layer_of_n_cpu_us": [],
        "layer_of_n_us": [],
        "floor_us": [],
        "floor_layer_of_n_us": [],
    }

    scattered = np.random.default_rng(4).permutation(num_blocks)  # a consumer's free blocks are anywhere

    def transfer(name: str, slot: int) -> None:
        done[name] = threading.Event()
        dst = scattered[slot * blocks : (slot + 1) * blocks]
        writer.assign(name, 1, agent, 1, dst, prompt_tokens=PART_TOKENS, progressive=True)

    def finish(names: list[str]) -> None:
        for name in names:
            writer.source_ready(name, src)
        for name in names:
            if not done[name].wait(30):
                raise TimeoutError(f"{name} did not complete")

    with writer:
        [thread] = [t for t in threading.enumerate() if t.name == "nixl-writer-bench-parts-src"]
        assert thread.ident is not None
        clock = time.pthread_getcpuclockid(thread.ident)  # the writer thread's CPU time

        def cpu() -> float:
            return time.clock_gettime(clock)

        for rep in range(reps + 1):
            name = f"part-{rep}"
            transfer(name, 0)
            writer.barrier()
            start, start_cpu = time.perf_counter(), cpu()
            for layer in range(PART_LAYERS):
                writer.source_part(name, src, PART_TOKENS, (layer, layer + 1), prompt_tokens=PART_TOKENS)
            handed = time.perf_counter()
            writer.barrier()
            per_part = (time.perf_counter() - start) / PART_LAYERS
            per_part_cpu = (cpu() - start_cpu) / PART_LAYERS
            caller = (handed - start) / PART_LAYERS
            finish([name])
            name = f"alone-{rep}"
            transfer(name, 0)
            writer.barrier()
            alone, alone_cpu, barrier = [], [], []
            for layer in range(PART_LAYERS):
                start, start_cpu = time.perf_counter(), cpu()
                writer.source_part(name, src, PART_TOKENS, (layer, layer + 1), prompt_tokens=PART_TOKENS)
                writer.barrier()
                alone.append(time.perf_counter() - start)
                alone_cpu.append(cpu() - start_cpu)
                start = time.perf_counter()
                writer.barrier()
                barrier.append(time.perf_counter() - start)
            finish([name])
            names = [f"layer-{rep}-{i}" for i in range(PART_REQUESTS)]
            for i, n in enumerate(names):
                transfer(n, i)
            writer.barrier()
            start, start_cpu = time.perf_counter(), cpu()
            for n in names:
                writer.source_part(n, src, PART_TOKENS, (0, 1), prompt_tokens=PART_TOKENS)
            writer.barrier()
            layer_of_n = time.perf_counter() - start
            layer_of_n_cpu = cpu() - start_cpu
            finish(names)
            if rep:  # the first is a warm-up: connections, caches
                samples["part_us"].append(per_part * 1e6)
                samples["caller_us"].append(caller * 1e6)
                samples["part_alone_us"].extend(x * 1e6 for x in alone)
                samples["part_cpu_us"].append(per_part_cpu * 1e6)
                samples["part_alone_cpu_us"].extend(x * 1e6 for x in alone_cpu)
                samples["layer_of_n_cpu_us"].append(layer_of_n_cpu * 1e6)
                samples["barrier_us"].extend(x * 1e6 for x in barrier)
                samples["layer_of_n_us"].append(layer_of_n * 1e6)
    if failed:
        raise RuntimeError(f"a benchmark write failed: {failed[0]}")
    endpoint = NixlEndpoint("bench-parts-floor", regions)
    endpoint.add_peer(agent, 1)
    local, remote = endpoint.indices(agent.name, src, scattered[:blocks], range(0, 2))  # one layer: K and V
    n_src = np.tile(src, PART_REQUESTS)
    n_local, n_remote = endpoint.indices(agent.name, n_src, scattered[: PART_REQUESTS * blocks], range(0, 2))
    for key, count, indices in (
        ("floor_us", reps * PART_LAYERS, (local, remote)),
        ("floor_layer_of_n_us", reps, (n_local, n_remote)),
    ):
        for i in range(count + 5):
            start, start_cpu = time.perf_counter(), time.thread_time()
            posted = endpoint.post_indices("WRITE", agent.name, *indices)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
            wait(endpoint, posted)
            if i >= 5:
                samples[key].append(elapsed * 1e6)
                samples[key.replace("_us", "_cpu_us")].append(elapsed_cpu * 1e6)
    endpoint.close()
    peer.call("close", agent.name)
    result: dict[str, Any] = {
        "regions": POST_REGIONS,
        "prompt_tokens": PART_TOKENS,
        "block_bytes": PART_BLOCK,
        "descriptors_per_part": 2 * blocks,
        "requests": PART_REQUESTS,
    }
    for key, values in samples.items():
        result[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
    result["part_over_floor"] = result["part_us"]["median"] / result["floor_us"]["median"]
    result["part_alone_over_floor"] = result["part_alone_us"]["median"] / result["floor_us"]["median"]
    for key in ("part", "part_alone"):
        result[f"{key}_cpu_over_floor"] = result[f"{key}_cpu_us"]["median"] / result["floor_cpu_us"]["median"]
    result["layer_of_n_cpu_over_floor"] = (
        result["layer_of_n_cpu_us"]["median"] / result["floor_layer_of_n_cpu_us"]["median"]
    )
    result["layer_of_n_over_floor"] = result["layer_of_n_us"]["median"] / result["floor_layer_of_n_us"]["median"]
    return result


INTEGRITY_BLOCK = 64 << 10


def integrity(peer: Consumer, total: int, reps: int) -> dict[str, Any]:
    """What end-to-end integrity costs a whole write of `total` bytes, per GiB: median (min-max) of `reps`."""
    buffer = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    blocks = list(range(total // INTEGRITY_BLOCK))
    agent: NixlAgentInfo = peer.call("create", "bench-integrity-dst", INTEGRITY_BLOCK)
    completed = threading.Event()
    outcomes: list[bool] = []

    def on_complete(transfer_id: str, generation: int, ok: bool, error: str | None) -> None:
        outcomes.append(ok)
        completed.set()

    writes: dict[str, list[float]] = {}
    for checked in (False, True):
        writer = TransferWriter(
            NixlEndpoint(f"bench-integrity-src-{checked}", one_region(buffer, INTEGRITY_BLOCK)),
            on_complete=on_complete,
            on_revoked=lambda *_: None,
            on_source_free=lambda *_: None,
            config=WriterConfig(integrity=checked),
        )
        samples = []
        with writer:
            for i in range(reps + 1):  # the first warms the peer up
                writer.assign(f"i{checked}{i}", 1, agent, 1, blocks)
                writer.barrier()
                completed.clear()
                start = time.perf_counter()
                writer.source_ready(f"i{checked}{i}", blocks)
                if not completed.wait(60):
                    raise TimeoutError("writer did not complete")
                samples.append(time.perf_counter() - start)
        writes["on" if checked else "off"] = samples[1:]
    if not all(outcomes):
        raise RuntimeError("a benchmark write failed")
    regions = one_region(buffer, INTEGRITY_BLOCK)
    check, crc = [], []
    for _ in range(reps):
        start = time.perf_counter()
        block_digests(regions, blocks)
        check.append(time.perf_counter() - start)
        start = time.perf_counter()
        zlib.crc32(buffer.data)
        crc.append(time.perf_counter() - start)
    per_gib = (1 << 30) / total
    on, off = statistics.median(writes["on"]), statistics.median(writes["off"])
    return {
        "bytes": total,
        "block_bytes": INTEGRITY_BLOCK,
        "write_off_s": _spread(writes["off"]),
        "write_on_s": _spread(writes["on"]),
        "producer_s_per_gib": (on - off) * per_gib,
        "check_s_per_gib": _spread([c * per_gib for c in check]),
        "crc32_s_per_gib": _spread([c * per_gib for c in crc]),
        **integrity_in_parts(peer, total, reps),
        **{f"scoped_{layout.lower()}_s_per_gib": scoped_check(buffer, layout, reps) for layout in ("HND", "NHD")},
    }


SCOPED_HEADS, SCOPED_TOKENS = 8, 16
"""The blocks of `scoped_check`: 8 heads x 16 tokens x 512 B (one token of one head: 128 x fp32) = 64 KiB."""


def scoped_check(buffer: np.ndarray[Any, Any], kv_layout: str, reps: int) -> dict[str, float]:
    """A consumer's check of scoped digests (`scope_digests`: its plan and the hash) of half the heads of every
    block of `buffer`, per GiB hashed: median (min-max) of `reps`."""
    regions = one_region(buffer, INTEGRITY_BLOCK)
    geometry = RankGeometry(regions, SCOPED_HEADS, SCOPED_TOKENS)
    blocks = list(range(regions[0].num_blocks))
    scope = DigestScope(range(0, 1), 0, SCOPED_HEADS // 2, len(blocks) * SCOPED_TOKENS)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        scope_digests(geometry, kv_layout, scope, blocks)
        samples.append(time.perf_counter() - start)
    return _spread([s * (1 << 30) / (buffer.nbytes / 2) for s in samples])


INTEGRITY_PART_BLOCK = 16 << 10


def integrity_in_parts(peer: Consumer, total: int, reps: int) -> dict[str, Any]:
    """A progressive write of `total` bytes (`PART_LAYERS` layers x K and V): every layer but the last handed over
    as a part, written; then the last layer and `source_ready`, timed to on_complete, with integrity off and on;
    and on, as TP rank 0 of 2 writing its half of the heads into a consumer of TP 1 (scoped digests)."""
    num_blocks = total // (POST_REGIONS * INTEGRITY_PART_BLOCK)
    agent: NixlAgentInfo = peer.call("create", "bench-integrity-parts-dst", INTEGRITY_PART_BLOCK)
    agent = dataclasses.replace(
        agent, regions=tuple(layer_regions(agent.regions[0].base_address, INTEGRITY_PART_BLOCK, num_blocks))
    )
    buffer = np.random.default_rng(5).integers(0, 256, POST_REGIONS * INTEGRITY_PART_BLOCK * num_blocks, np.uint8)
    layout = KvLayout("bench", "uint8", POST_TOKENS, PART_LAYERS, kv_layout="HND")
    prompt, src = num_blocks * POST_TOKENS, np.arange(num_blocks)
    dst = np.random.default_rng(6).permutation(num_blocks)
    completed, outcomes = threading.Event(), []

    def on_complete(transfer_id: str, generation: int, ok: bool, error: str | None) -> None:
        outcomes.append(ok)
        completed.set()

    finals: dict[str, list[float]] = {}
    for mode in ("off", "on", "scoped"):
        block, writer_layout = INTEGRITY_PART_BLOCK, layout
        into: NixlAgentInfo | ConsumerEngine = agent
        if mode == "scoped":  # rank 0 of TP 2 holds head 0 of 2: half of each consumer block
            block, into = INTEGRITY_PART_BLOCK // 2, ConsumerEngine(replace(layout, num_kv_heads=2), (agent,))
            writer_layout = replace(layout, tp_size=2, num_kv_heads=2)
        writer = TransferWriter(
            NixlEndpoint(f"bench-integrity-parts-src-{mode}", layer_regions(buffer.ctypes.data, block, num_blocks)),
            on_complete=on_complete,
            on_revoked=lambda *_: None,
            on_source_free=lambda *_: None,
            config=WriterConfig(integrity=mode != "off", max_parts_in_flight=PART_LAYERS, part_compute_ratio=0.0),
            layout=writer_layout,
        )
        samples = []
        with writer:
            for i in range(reps + 1):  # the first warms the peer up
                name = f"p{mode}{i}"
                writer.assign(name, 1, into, 1, dst, prompt_tokens=prompt, progressive=True)
                for layer in range(PART_LAYERS - 1):
                    writer.source_part(name, src, prompt, (layer, layer + 1))
                writer.barrier()
                while writer.parts_in_flight:  # the parts are written (and hashed) before the last layer
                    time.sleep(0.001)
                completed.clear()
                start = time.perf_counter()
                writer.source_part(name, src, prompt, (PART_LAYERS - 1, PART_LAYERS))
                writer.source_ready(name, src)
                if not completed.wait(60):
                    raise TimeoutError("writer did not complete")
                samples.append(time.perf_counter() - start)
        finals[mode] = samples[1:]
    if not all(outcomes):
        raise RuntimeError("a benchmark write failed")
    # The consumer's check at arrival: all of the target hashed then, or only what the last layer's part carried
    # (LandedDigests hashed the others as they landed), on these regions, in this thread.
    regions = layer_regions(buffer.ctypes.data, INTEGRITY_PART_BLOCK, num_blocks)
    shape = kvmap.rank_shape(layout, NixlAgentInfo("bench", b"", regions=tuple(regions)))
    whole, rest = [], []
    for _ in range(reps):
        start = time.perf_counter()
        block_digests(regions, dst)
        whole.append(time.perf_counter() - start)
        landed = LandedDigests.of(regions, shape, dst.tolist(), POST_TOKENS, prompt)
        assert landed is not None
        for layer in range(PART_LAYERS - 1):
            landed.hash(landed.land(WrittenPart(0, prompt, layer, 1), range(PART_LAYERS)))
        start = time.perf_counter()
        landed.hash(landed.rest())
        landed.digests()
        rest.append(time.perf_counter() - start)
    return {
        "parts_final_off_s": _spread(finals["off"]),
        "parts_final_on_s": _spread(finals["on"]),
        "parts_final_scoped_s": _spread(finals["scoped"]),
        "check_at_arrival_whole_s": _spread(whole),
        "check_at_arrival_landed_s": _spread(rest),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def measure(peer: Consumer, total: int, args: argparse.Namespace) -> dict[str, Any]:
    """Throughput, round trips, the writer's latency and the cost of posting one transfer."""
    buffer = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    rows: list[dict[str, Any]] = [
        {"block_bytes": b, "order": "scattered", "gib_per_s": throughput(peer, buffer, b, True, args.reps)}
        for b in BLOCK_SIZES
    ]
    rows.append(
        {
            "block_bytes": BLOCK_SIZES[0],
            "order": "in order",
            "gib_per_s": throughput(peer, buffer, BLOCK_SIZES[0], False, args.reps),
        }
    )
    rtt_spin = round_trips(peer, args.round_trips, backoff=False)
    rtt_backoff = round_trips(peer, args.round_trips, backoff=True)
    peer.call("backoff", True)
    writer = writer_latencies(peer, args.round_trips)
    posts = posting(peer, total, max(args.reps, 20))
    latency: dict[str, Any] = {}
    samples = {"round_trip_spin": rtt_spin, "round_trip_backoff": rtt_backoff, "writer_ready_to_complete": writer}
    for label, values in samples.items():
        latency[label] = {f"p{q}_us": percentile(values, q / 100) * 1e6 for q in (50, 90, 99)}
        latency[label]["samples"] = len(values)
    latency |= {"round_trip_block_bytes": TINY_BLOCK, "writer_block_bytes": WRITER_BLOCK}
    return {"throughput": rows, "latency": latency, "posting": posts}


def report(measured: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"WRITE of {args.total_mib} MiB, median of {args.reps}   UCX_TLS={os.environ['UCX_TLS']}")
    print(f"{'block':>10} {'order':>10} {'GiB/s':>8}")
    for row in measured["throughput"]:
        print(f"{row['block_bytes'] >> 10:>7} KiB {row['order']:>10} {row['gib_per_s']:>8.2f}")
    for label, row in measured["latency"].items():
        if isinstance(row, dict):
            print(f"{label:>26}: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "samples"))
    print(f"one transfer of {POST_BLOCKS} blocks x {POST_REGIONS} regions (post = handle + transfer call)")
    print(f"{'case':>28} {'mode':>30} {'unit':>4} {'descriptors':>11} {'plan us':>8} {'post us':>8} {'done us':>8}")
    for row in measured["posting"]:
        print(
            f"{row['case']:>28} {row['mode']:>30} {row['unit_bytes']:>4} {row['descriptors']:>11} "
            f"{row['plan_us']:>8.0f} {row['post_us']:>8.0f} {row['done_us']:>8.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--output", default="nixl.json", help="file name under benchmarks/results/")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--only-parts", action="store_true", help="run the progressive parts section alone")
    only.add_argument("--only-integrity", action="store_true", help="run the integrity section alone")
    for mode in AGENT_MODES:
        only.add_argument(f"--only-{mode}", action="store_true", help=f"run the agent mode {mode} alone")
    parser.add_argument("--transfers", type=int, default=200, help="pull-read, source-hold: transfers timed")
    parser.add_argument("--at-once", type=int, default=60, help="pull-commit: transfers at once")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    os.environ.setdefault("UCX_TLS", "shm,tcp")  # loopback only, inherited by the consumer process
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    total = args.total_mib << 20
    agents = next((m for m in AGENT_MODES if getattr(args, f"only_{m.replace('-', '_')}")), None)
    if agents is not None:
        agent_mode(agents, args, total, load_at_start)
        return
    peer = Consumer(total)
    try:
        peer.call("backoff", True)
        if args.only_integrity:
            checksums = integrity(peer, total, args.reps)
        else:
            progressive = parts(peer, total, max(args.reps, 20))
            measured = {} if args.only_parts else measure(peer, total, args)
    finally:
        peer.stop()
    if args.only_integrity:
        print(f"integrity, a whole write of {args.total_mib} MiB in {INTEGRITY_BLOCK >> 10} KiB blocks, seconds: "
              f"median (min-max) of {args.reps}")  # fmt: skip
        for key in ("write_off_s", "write_on_s", "check_s_per_gib", "crc32_s_per_gib", "parts_final_off_s",
                    "parts_final_on_s", "parts_final_scoped_s", "check_at_arrival_whole_s", "check_at_arrival_landed_s",
                    "scoped_hnd_s_per_gib", "scoped_nhd_s_per_gib"):  # fmt: skip
            row = checksums[key]
            print(f"{key:>22}: {row['median']:.4f} ({row['min']:.4f}-{row['max']:.4f})")
        print(f"{'producer_s_per_gib':>22}: {checksums['producer_s_per_gib']:.4f}")
        _write_result(args, total, {"integrity": checksums})
        return
    if measured:
        report(measured, args)
    print(
        f"progressive parts, {PART_LAYERS} layers x K and V ({POST_REGIONS} regions), {PART_TOKENS}-token prompt, "
        f"{progressive['descriptors_per_part']} descriptors of {PART_BLOCK} B a part; median (min-max) of "
        f"{progressive['part_us']['n']} reps"
    )
    for key, label in (
        ("part_us", "one part (plan + post), us"),
        ("caller_us", "of which the caller's thread, us"),
        ("part_alone_us", "one part alone, to its post, us"),
        ("barrier_us", "of which a barrier's round trip, us"),
        ("layer_of_n_us", f"one layer of {PART_REQUESTS} requests, us"),
        ("floor_us", "NIXL prepared post of a part, us"),
        ("floor_layer_of_n_us", f"NIXL prepared post of {PART_REQUESTS} parts, us"),
        ("part_cpu_us", "one part, writer CPU, us"),
        ("part_alone_cpu_us", "one part alone, writer CPU, us"),
        ("layer_of_n_cpu_us", f"one layer of {PART_REQUESTS}, writer CPU, us"),
        ("floor_cpu_us", "NIXL post of a part, CPU, us"),
        ("floor_layer_of_n_cpu_us", f"NIXL post of {PART_REQUESTS} parts, CPU, us"),
    ):
        row = progressive[key]
        print(f"{label:>36}: {row['median']:8.1f} ({row['min']:.1f}-{row['max']:.1f})")
    print(f"{'part / floor':>36}: {progressive['part_over_floor']:8.2f}")
    print(f"{'part alone / floor':>36}: {progressive['part_alone_over_floor']:8.2f}")
    for key in ("part", "part_alone", "layer_of_n"):
        label = f"{key.replace('_', ' ')} / floor, CPU"
        print(f"{label:>36}: {progressive[f'{key}_cpu_over_floor']:8.2f}")
    print(f"{'layer of N / floor':>36}: {progressive['layer_of_n_over_floor']:8.2f}")
    _write_result(args, total, {**measured, "progressive_parts": progressive})


def agent_mode(mode: str, args: argparse.Namespace, total: int, load_at_start: float) -> None:
    """One of `benchmarks.nixl_agents`' modes: print its figures (milliseconds) and write them with the build's
    commit and the load average at the start."""
    measured = {
        "pull-read": lambda: nixl_agents.pull_read(args.transfers),
        "source-hold": lambda: nixl_agents.source_hold(args.transfers),
        "pull-commit": lambda: nixl_agents.pull_commit(args.at_once),
    }[mode]()
    print(f"{mode}: {measured['transfers']} transfers, load average (1 min) at the start {load_at_start:.2f}")
    for key, row in measured.items():
        if isinstance(row, dict):
            print(f"{key:>28}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "n"))
        elif key != "transfers":
            print(f"{key:>28}: {row}")
    build = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
    ).stdout.strip()
    _write_result(args, total, {"mode": mode, "build": build, mode: measured}, load_at_start)


def _write_result(
    args: argparse.Namespace, total: int, measured: dict[str, Any], load_at_start: float | None = None
) -> None:
    RESULTS.mkdir(exist_ok=True)
    result = {
        "benchmark": "nixl",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            **({} if load_at_start is None else {"load_average_1m_at_start": load_at_start}),
            "load_average_1m_at_end": os.getloadavg()[0],
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "nixl": version("nixl"),
        "ucx": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "total_bytes": total,
        "reps": args.reps,
        **measured,
    }
    (RESULTS / args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
