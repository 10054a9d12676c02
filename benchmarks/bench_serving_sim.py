r"""Simulated disaggregated serving with real gRPC and real NIXL bytes: pull vs push vs ideal.

One producer (prefill) and one consumer (decode) engine run as separate processes with DRAM KV pools and the
data-plane agents; the rendezvous service runs in this process, which is also the router. Requests arrive as
a Poisson process at each `--rates` value. Prefill compute is simulated (`--prefill-us-per-token`, one request
at a time); the KV bytes are real and sized like `--model` (bytes per token from its shape, divided by
`--kv-scale` to fit memory). Decode is a step loop (`--decode-step-ms` per step, every active request gets a
token per step). Prompts are `--prompt-tokens` long, uniform within +-`--prompt-spread` of it (each length of
a list in turn).

  pull   as vLLM's default connector does it, paying each of its costs (named parameters, all on the path
         after prefill finished):
         - relay (`--pull-relay-ms`): the router learns prefill is done and sends the decode leg, one HTTP
           hop later;
         - admission at a step boundary: decode's scheduler allocates the request's blocks when its running
           step ends (push pays this too, but while prefill still computes);
         - handshake on first contact (`--pull-handshake-ms`): decode fetches prefill's NIXL metadata before
           its first READ from that engine;
         - the READ on the step loop: issued in the step that admitted the request, it is seen done at the next
           step boundary (the request then decodes); its setup stalls that step by `--pull-setup-ms`, which
           shows in the TPOT of requests already decoding.
  push   both legs at once through the rendezvous: the consumer registers its blocks while the producer
         computes; the producer's writer thread WRITEs as soon as the KV is ready.
  push-progressive
         push into progressive targets: the producer hands its KV over as the simulated prefill computes it,
         `--progressive layer` (the forward sleeps compute / layers per layer, then `ready_part` of that layer
         for every prompt token) or `chunk` (`--chunk-tokens` per chunk, then `ready_part` of the tokens so far
         in all layers), then `ready`; the writer posts each part at once, and the consumer learns of the KV
         only once all of it is in.
  ideal  push's compute and raw WRITE time with no coordination: the KV lands at prefill done + the WRITE's
         own duration, and the decode side takes as long as it did in push to emit the first token (the wait
         for the running step, then one step).
  ideal-compute
         no transfer at all: each push request's prefill done (its forward not slowed by any handing over) +
         its decode side's time to the first token (push-progressive's requests when push does not run).

`--modes` picks among pull, push and push-progressive (ideal comes with push, ideal-compute with either push mode).
With push-progressive every mode of the run uses per-layer KV regions (K and V of each of the model's layers,
layer-major), so they all move the same layout. TTFT = first token at the consumer - arrival; TPOT = mean time
between a request's later tokens; WRITE = first post to done (push-progressive: from `ready`, the tail); compute
= the simulated forward, handing over included (the sleeps aim at deadlines, so only what overruns them counts).
Each mode first runs `--warmup` requests that are not counted (first contact: peer metadata, descriptor lists).
`--verify` checks that every request's KV arrived: the simulated forward stamps each head of every block of every
region it computes with a value of (request, block, region, head), and the consumer checks its blocks after the
last token (off the TTFT path, in a thread, before it frees them); a request whose blocks differ stops the run.
`ends` (the default) stamps and checks the first and last 8 bytes of each head (a WRITE moves whole heads of a
block, so this catches a missing, misplaced, truncated or stale one), `bytes` every byte (at the benchmark's
sizes that costs the engines' CPU as much as the copies), `off` nothing.

`--tp P:D` gives the producer engine P ranks and the consumer engine D (tensor parallel; `--tp 4:4,4:2,2:4`
runs each pair in turn, with only that pair's engines alive). Each rank has its own agent (its own NIXL agent,
writer or receiver thread, and rendezvous client); an engine's ranks share one process. The KV bytes per token
are split across ranks by KV heads (HND blocks), and every producer rank writes its heads into the consumer
ranks that hold them. A request's KV has arrived once every consumer rank has its share; ideal's WRITE
duration is the slowest producer rank's. Pull (the consumer READs rank to rank) runs at 1:1 only.

    python benchmarks/bench_serving_sim.py [--rates 10,20,35] [--requests 60] [--tp 1:1] [--out benchmarks/results]

Progressive push with the WRITE about as long as the compute (Qwen3-32B's KV / 4 = 64 KiB per token, 20 us of
compute per token: on this loopback push's WRITE is 0.9-1.0x its compute, as for Qwen3-32B at ~40 us/token
writing at ~6.5 GB/s per engine; benchmarks/RESULTS.md, "Progressive push"):

    python benchmarks/bench_serving_sim.py --modes push,push-progressive --prompt-tokens 512,2048,8192 \
        --prompt-spread 0 --prefill-us-per-token 20 --kv-scale 4 --pool-blocks 1536 --rates 1 --requests 30 \
        [--progressive layer|chunk] [--chunk-tokens 512]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import os
import platform
import queue
import random
import statistics
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS = {
    # layers x KV heads x head dim x (K and V) x bytes (bf16)
    "qwen3-32b": 64 * 8 * 128 * 2 * 2,
    "llama-3.1-8b": 32 * 8 * 128 * 2 * 2,
}
MODEL_LAYERS = {"qwen3-32b": 64, "llama-3.1-8b": 32}
KV_HEADS = 8  # both models; TP ranks split them
BLOCK_TOKENS = 16
KV = 2  # K and V: the regions per layer, or the regions of a pool not split by layer
PULL, PUSH, PROGRESSIVE = "pull", "push", "push-progressive"
MODES = (PULL, PUSH, PROGRESSIVE)


@dataclass(frozen=True)
class Sim:
    """The simulated engines' timing and sizes."""

    prefill_s_per_token: float
    decode_step_s: float
    pull_setup_s: float
    pull_relay_s: float
    pull_handshake_s: float
    output_tokens: int
    block_bytes: int  # per region, whole engine (each of `ranks` ranks holds 1/ranks of it)
    pool_blocks: int
    model: str
    producer_ranks: int = 1
    consumer_ranks: int = 1
    layers: int = 0
    """Per-layer regions (`KV` per layer, layer-major) for this many layers; 0 = `KV` regions of all layers."""
    progressive: str = "layer"
    """How push-progressive hands the KV over: "layer" or "chunk"."""
    chunk_tokens: int = 512
    part_compute_ratio: float | None = None
    """The producer writer's `WriterConfig.part_compute_ratio` (adaptive granularity of parts); None: its default."""
    verify: str = "ends"
    """What the consumer checks: every byte ("bytes"), each head's first and last 8 bytes ("ends"), or "off"."""
    with_pull: bool = True
    """Whether pull runs: only then does the producer serve READs (a second agent, its thread polling for them,
    which takes the GIL from the forward every poll)."""

    def layout(self, ranks: int) -> Any:
        from rendezvous.clients import KvLayout

        return KvLayout(self.model, "bf16", BLOCK_TOKENS, self.layers, ranks, 1, "HND", KV_HEADS)

    @property
    def regions(self) -> int:
        return KV * (self.layers or 1)

    @property
    def pull(self) -> bool:
        """Pull runs rank to rank, so only between single-rank engines."""
        return self.producer_ranks == self.consumer_ranks == 1

    @property
    def label(self) -> str:
        return f"{self.producer_ranks}x{self.consumer_ranks}"


# Engine processes


def rank_tensors(sim: Sim, ranks: int) -> list[Any]:
    """One rank's KV regions: its share (1/ranks) of each block of the pool."""
    import torch

    shape = (sim.pool_blocks, sim.block_bytes // ranks)
    return [torch.zeros(shape, dtype=torch.uint8).fill_(0) for _ in range(sim.regions)]  # touched: no page faults later


def stamps(transfer_id: str, blocks: range, regions: range, heads: range) -> Any:
    """The value every 8 bytes of each head of the request's blocks hold, per (block, region, head): a block is
    its position in the request, a head the model's."""
    import torch

    seed = (zlib.crc32(transfer_id.encode()) & 0x7FFFFFFF) << 31
    b = torch.arange(blocks.start, blocks.stop, dtype=torch.int64).view(-1, 1, 1) << 16
    r = torch.arange(regions.start, regions.stop, dtype=torch.int64).view(1, -1, 1) << 8
    h = torch.arange(heads.start, heads.stop, dtype=torch.int64).view(1, 1, -1)
    return seed ^ b ^ r ^ h


@dataclass(frozen=True)
class _Words:
    """One rank's regions as (blocks, its heads, 8-byte words), and which of the model's heads it holds."""

    regions: list[Any]
    heads: range
    flat: list[Any]
    """The regions as flat words (views)."""

    @classmethod
    def of(cls, tensors: list[Any], rank: int, ranks: int) -> _Words:
        import torch

        per_rank = KV_HEADS // ranks
        views = [t.view(torch.int64).view(t.shape[0], per_rank, -1) for t in tensors]
        return cls(views, range(rank * per_rank, (rank + 1) * per_rank), [v.view(-1) for v in views])


def _runs(block_ids: list[int] | tuple[int, ...], blocks: range) -> Iterator[tuple[range, int]]:
    """The request's blocks `blocks` (positions in `block_ids`) as runs of consecutive ids: (positions, first id),
    so that each run is a view of the pool, not a copy."""
    first = blocks.start
    for end in range(blocks.start + 1, blocks.stop + 1):
        if end == blocks.stop or block_ids[end] != block_ids[end - 1] + 1:
            yield range(first, end), block_ids[first]
            first = end


def _stamped(pool: Any, verify: str) -> list[Any]:
    """The words of a run of blocks of a region that hold stamps: all ("bytes"), or each head's first and last."""
    return [pool] if verify == "bytes" else [pool[:, :, 0], pool[:, :, -1]]


@dataclass(frozen=True)
class _Stamps:
    """One rank's stamps of a request, placed (`verify` "ends"): per block, the positions of the stamped words in a
    region (flat), and per region and block the values they get."""

    positions: Any  # (blocks, stamped words of a block)
    values: Any  # (regions, blocks, stamped words of a block)

    @classmethod
    def of(cls, words: _Words, transfer_id: str, block_ids: list[int]) -> _Stamps:
        import torch

        _, heads, per_head = words.regions[0].shape
        ends = torch.tensor([0, per_head - 1])
        positions = (
            torch.tensor(block_ids, dtype=torch.int64).view(-1, 1, 1) * (heads * per_head)
            + torch.arange(heads).view(1, -1, 1) * per_head
            + ends.view(1, 1, -1)
        ).view(len(block_ids), -1)
        values = stamps(transfer_id, range(len(block_ids)), range(len(words.regions)), words.heads)
        per_region = values.permute(1, 0, 2)  # (regions, blocks, heads)
        stacked = torch.stack([per_region] * len(ends), dim=-1)  # not expand(): its copy is ~100x slower here
        return cls(positions, stacked.reshape(len(words.regions), len(block_ids), -1))


def stamp(
    ranks: list[_Words], transfer_id: str, block_ids: list[int], blocks: range, regions: range, verify: str
) -> None:
    """Write the request's stamps into its blocks `blocks` (positions in `block_ids`) of `regions`, every rank."""
    for words in ranks:
        values = stamps(transfer_id, blocks, regions, words.heads)
        for run, first in _runs(block_ids, blocks):
            for i, region in enumerate(regions):
                value = values[run.start - blocks.start : run.stop - blocks.start, i]
                for stamped in _stamped(words.regions[region][first : first + len(run)], verify):
                    stamped.copy_(value.view(*value.shape, *[1] * (stamped.dim() - 2)).expand_as(stamped))


def stamp_ends(ranks: list[_Words], placed: list[_Stamps], blocks: range, regions: range) -> None:
    """`stamp` with `verify` "ends", from the request's stamps placed beforehand: one scatter per region, whatever
    the blocks' runs, so that handing the KV over per layer costs the simulated forward little more stamping than
    handing it over at once (per layer `stamp` costs ~10 torch calls, more than a layer of a short prompt computes)."""
    for words, p in zip(ranks, placed, strict=True):
        where = p.positions[blocks.start : blocks.stop].reshape(-1)
        for region in regions:
            words.flat[region].index_copy_(0, where, p.values[region, blocks.start : blocks.stop].reshape(-1))


def intact(ranks: list[_Words], transfer_id: str, block_ids: tuple[int, ...], verify: str) -> bool:
    """Whether the request's blocks hold, on every rank, every stamp the producer wrote."""
    import torch

    blocks = range(len(block_ids))
    for words in ranks:
        values = stamps(transfer_id, blocks, range(len(words.regions)), words.heads)
        for run, first in _runs(block_ids, blocks):
            for region, view in enumerate(words.regions):
                value = values[run.start : run.stop, region]
                for stamped in _stamped(view[first : first + len(run)], verify):
                    expected = value.view(*value.shape, *[1] * (stamped.dim() - 2)).expand_as(stamped)
                    if not torch.equal(stamped, expected):
                        return False
    return True


@dataclass(frozen=True)
class _Piece:
    """One step of the simulated forward: when it is done, what it computed, and what to hand over then."""

    done: float
    """Its end, as a fraction of the prefill's compute."""
    computed_tokens: int
    layers: tuple[int, int] | None
    blocks: range
    """The request's blocks (positions) it computes."""
    regions: range


def pieces(sim: Sim, tokens: int, mode: str) -> Iterator[_Piece]:
    """The simulated forward of a `tokens` prompt: a piece per layer or chunk in push-progressive, else one."""
    num_blocks = math.ceil(tokens / BLOCK_TOKENS)
    if mode == PROGRESSIVE and sim.progressive == "layer":
        for layer in range(sim.layers):
            done = (layer + 1) / sim.layers
            yield _Piece(done, tokens, (layer, layer + 1), range(num_blocks), range(KV * layer, KV * layer + KV))
    elif mode == PROGRESSIVE:
        for first in range(0, tokens, sim.chunk_tokens):
            end = min(first + sim.chunk_tokens, tokens)
            blocks = range(first // BLOCK_TOKENS, math.ceil(end / BLOCK_TOKENS))
            yield _Piece(end / tokens, end, None, blocks, range(sim.regions))
    else:
        yield _Piece(1.0, tokens, None, range(num_blocks), range(sim.regions))


async def _producer(address: str, sim: Sim, commands: Any, reports: Any) -> None:
    from rendezvous.clients import AsyncRendezvousClient, TransferMode
    from rendezvous.clients.nixl.producer import ProducerAgent
    from rendezvous.clients.nixl.rank import start_ranks
    from rendezvous.clients.nixl.writer import WriterConfig

    ranks = sim.producer_ranks
    ratio = sim.part_compute_ratio
    config = WriterConfig() if ratio is None else WriterConfig(part_compute_ratio=ratio)
    free = list(range(sim.pool_blocks))
    work: asyncio.Queue[tuple[str, int, int, str]] = asyncio.Queue()
    writes: dict[str, list[tuple[float, int]]] = {}  # each rank's WRITE duration and parts, until all reported
    frees: dict[str, int] = {}

    def on_report(r: Any) -> None:
        durations = writes.setdefault(r.transfer_id, [])
        durations.append((r.written_time - max(r.ready_time, r.assigned_time), len(r.parts)))
        if len(durations) == ranks:
            reports.put(("write", r.transfer_id, max(d for d, _ in durations), max(p for _, p in durations)))
            del writes[r.transfer_id]

    def on_free(blocks: list[int]) -> Any:
        def freed(transfer_id: str) -> None:  # the blocks are free once every rank let go of them
            frees[transfer_id] = frees.get(transfer_id, 0) + 1
            if frees[transfer_id] == ranks:
                del frees[transfer_id]
                free.extend(blocks)

        return freed

    engine_id = f"sim-prefill-{sim.label}"
    clients = [AsyncRendezvousClient(address) for _ in range(ranks)]
    kv = [rank_tensors(sim, ranks) for _ in range(ranks)]
    words = [_Words.of(tensors, rank, ranks) for rank, tensors in enumerate(kv)]
    agents = [
        ProducerAgent(
            client,
            engine_id,
            "prefill",
            kv[rank],
            rank=rank,
            layout=sim.layout(ranks),
            serve_reads=sim.pull and sim.with_pull,
            on_report=on_report,
            writer_config=config,
        )
        for rank, client in enumerate(clients)
    ]
    agent = agents[0]
    await start_ranks(agents)
    reports.put(("started", "producer"))
    try:

        async def compute() -> None:  # one prefill at a time, like one GPU
            while True:
                transfer_id, tokens, num_blocks, mode = await work.get()
                while len(free) < num_blocks:  # noqa: ASYNC110 (a scheduler step looking for free blocks)
                    await asyncio.sleep(0.001)
                blocks, free[:] = free[:num_blocks], free[num_blocks:]
                start, seconds = time.monotonic(), tokens * sim.prefill_s_per_token
                placed = [_Stamps.of(w, transfer_id, blocks) for w in words] if sim.verify == "ends" else []
                for piece in pieces(sim, tokens, mode):
                    if placed:  # the forward writes the piece's KV
                        stamp_ends(words, placed, piece.blocks, piece.regions)
                    elif sim.verify != "off":
                        stamp(words, transfer_id, blocks, piece.blocks, piece.regions, sim.verify)
                    await asyncio.sleep(max(0.0, start + piece.done * seconds - time.monotonic()))
                    if mode == PROGRESSIVE:
                        so_far = blocks[: math.ceil(piece.computed_tokens / BLOCK_TOKENS)]
                        for a in agents:
                            a.ready_part(transfer_id, so_far, piece.computed_tokens, piece.layers, prompt_tokens=tokens)
                transfer_mode = TransferMode.PULL if mode == PULL else TransferMode.PUSH
                for a in agents:
                    a.ready(transfer_id, blocks, on_free(blocks), mode=transfer_mode, prompt_tokens=tokens)
                reports.put(("prefilled", transfer_id, time.monotonic(), time.monotonic() - start))

        computing = asyncio.create_task(compute())
        loop = asyncio.get_running_loop()
        while (command := await loop.run_in_executor(None, commands.get))[0] != "stop":
            _, transfer_id, tokens, num_blocks, mode = command
            if mode != PULL:
                await agent.claim(transfer_id)
            work.put_nowait((transfer_id, tokens, num_blocks, mode))
        computing.cancel()
    finally:
        for a in reversed(agents):
            await a.close()
        for client in clients:
            await client.close()


async def _consumer(address: str, sim: Sim, commands: Any, reports: Any) -> None:
    from rendezvous.clients import AsyncRendezvousClient, TransferMode
    from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
    from rendezvous.clients.nixl.rank import start_ranks

    ranks = sim.consumer_ranks
    free = list(range(sim.pool_blocks))
    arrived: asyncio.Queue[tuple[float, TransferResult]] = asyncio.Queue()
    admissions: list[tuple[str, int, int, str]] = []  # decode legs the scheduler admits at the next step
    shares: dict[str, int] = {}  # consumer ranks whose share of a transfer arrived
    wake = asyncio.Event()

    def on_result(result: TransferResult) -> None:
        if result.ok:  # the request's KV is in once every rank has its share
            shares[result.transfer_id] = shares.get(result.transfer_id, 0) + 1
            if shares[result.transfer_id] < ranks:
                return
            del shares[result.transfer_id]
        arrived.put_nowait((time.monotonic(), result))
        wake.set()

    engine_id = f"sim-decode-{sim.label}"
    clients = [AsyncRendezvousClient(address) for _ in range(ranks)]
    kv = [rank_tensors(sim, ranks) for _ in range(ranks)]
    words = [_Words.of(tensors, rank, ranks) for rank, tensors in enumerate(kv)]
    agents = [
        ConsumerAgent(
            client,
            engine_id,
            "decode",
            kv[rank],
            rank=rank,
            layout=sim.layout(ranks),
            on_result=on_result,
        )
        for rank, client in enumerate(clients)
    ]
    agent = agents[0]
    await start_ranks(agents)
    pending: set[asyncio.Task[Any]] = set()
    reports.put(("started", "consumer"))

    first_contact: list[asyncio.Task[None]] = []  # pull: fetching prefill's NIXL metadata, once

    async def register(transfer_id: str, target: list[int], tokens: int, mode: str) -> None:
        if mode == PULL:  # no READ before decode holds the metadata
            if not first_contact:
                first_contact.append(asyncio.create_task(asyncio.sleep(sim.pull_handshake_s)))
            await first_contact[0]
        transfer_mode = TransferMode.PULL if mode == PULL else TransferMode.PUSH
        progressive = mode == PROGRESSIVE
        for follower in agents[1:]:  # they expect their shares before rank 0 registers the target
            await follower.register_target(transfer_id, target, mode=transfer_mode)
        await agent.register_target(
            transfer_id, target, mode=transfer_mode, num_tokens=tokens if progressive else 0, progressive=progressive
        )

    async def finish(transfer_id: str, target: tuple[int, ...], tokens: list[float]) -> None:
        """Report a decoded request (its bytes checked first, off the step loop), then free its blocks."""
        checked = None
        if sim.verify != "off":
            loop = asyncio.get_running_loop()
            checked = await loop.run_in_executor(None, intact, words, transfer_id, target, sim.verify)
        free.extend(target)
        gaps = [b - a for a, b in itertools.pairwise(tokens[1:])]
        tpot = statistics.fmean(gaps) if gaps else 0.0
        reports.put(("decoded", transfer_id, tokens[0], tokens[1], tpot, checked))

    try:

        async def step_loop() -> None:
            active: dict[str, list[float]] = {}  # transfer id -> KV arrival, then token times
            blocks: dict[str, tuple[int, ...]] = {}
            while True:
                if not active and not admissions:
                    await wake.wait()
                    wake.clear()
                stall = 0.0
                while admissions and len(free) >= admissions[0][2]:  # the scheduler allocates at a step boundary
                    transfer_id, prompt, num_blocks, mode = admissions.pop(0)
                    target, free[:] = free[:num_blocks], free[num_blocks:]
                    pending.add(asyncio.create_task(register(transfer_id, target, prompt, mode)))
                    stall += sim.pull_setup_s if mode == PULL else 0.0
                while not arrived.empty():
                    kv_time, result = arrived.get_nowait()
                    if result.ok:
                        active[result.transfer_id], blocks[result.transfer_id] = [kv_time], result.block_ids
                    else:
                        free.extend(result.block_ids)
                        reports.put(("failed", result.transfer_id, str(result.reason)))
                await asyncio.sleep(sim.decode_step_s + stall)
                pending.difference_update([t for t in pending if t.done()])
                now = time.monotonic()
                for transfer_id, tokens in list(active.items()):
                    tokens.append(now)
                    if len(tokens) == sim.output_tokens + 1:
                        del active[transfer_id]
                        pending.add(asyncio.create_task(finish(transfer_id, blocks.pop(transfer_id), tokens)))

        stepping = asyncio.create_task(step_loop())
        loop = asyncio.get_running_loop()

        def admit(leg: tuple[str, int, int, str]) -> None:
            admissions.append(leg)
            wake.set()

        while (command := await loop.run_in_executor(None, commands.get))[0] != "stop":
            leg = command[1:]
            if leg[3] == PULL:  # pull: the leg reaches decode one router hop after prefill finished
                loop.call_later(sim.pull_relay_s, admit, leg)
            else:
                admit(leg)
        stepping.cancel()
    finally:
        for a in reversed(agents):
            await a.close()
        for client in clients:
            await client.close()


def _engine(role: str, address: str, sim: Sim, commands: Any, reports: Any) -> None:
    import torch

    # The simulation's own torch calls (stamping the KV, checking it) are small: split over both cores of a busy
    # machine, each waits for a second thread (a 0.5M-element xor took 17 ms instead of 0.5 ms).
    torch.set_num_threads(1)
    run = _producer if role == "producer" else _consumer
    asyncio.run(run(address, sim, commands, reports))


# Router


@dataclass
class _Request:
    transfer_id: str
    arrival: float
    tokens: int
    num_blocks: int
    prefilled: float = 0.0
    compute_s: float = 0.0
    write_s: float = 0.0
    parts: int = 0
    kv_arrived: float = 0.0
    first_token: float = 0.0
    tpot: float = 0.0
    intact: bool | None = None


def _drain(reports: Any, requests: dict[str, _Request], on_prefilled: Any) -> int:
    """Apply the engines' reports; the number of requests that finished decoding."""
    finished = 0
    while True:
        try:
            report = reports.get_nowait()
        except queue.Empty:
            return finished
        kind, transfer_id = report[0], report[1]
        request = requests.get(transfer_id)
        if request is None:
            continue
        if kind == "prefilled":
            request.prefilled, request.compute_s = report[2:4]
            on_prefilled(request)
        elif kind == "write":
            request.write_s, request.parts = report[2:4]
        elif kind == "decoded":
            request.kv_arrived, request.first_token, request.tpot, request.intact = report[2:6]
            if request.intact is False:
                raise RuntimeError(f"transfer {transfer_id}: the consumer's blocks do not hold the producer's bytes")
            finished += 1
        elif kind == "failed":
            raise RuntimeError(f"transfer {transfer_id} failed: {report[2]}")


def _run_load(
    engines: dict[str, Any],
    reports: Any,
    rate: float,
    prompt_tokens: int,
    args: argparse.Namespace,
    mode: str,
    label: str,
) -> list[_Request]:
    rng = random.Random(args.seed)
    requests: dict[str, _Request] = {}

    def relay(request: _Request) -> None:  # pull: the decode leg goes out once prefill is done
        if mode == PULL:
            engines["consumer"].put(("decode", request.transfer_id, request.tokens, request.num_blocks, mode))

    start = time.monotonic()
    arrival = start
    finished = 0
    spread = int(prompt_tokens * args.prompt_spread)
    for i in range(args.requests):
        arrival += rng.expovariate(rate)
        tokens = rng.randint(max(1, prompt_tokens - spread), prompt_tokens + spread)
        transfer_id = f"sim-{mode}-{label}-{prompt_tokens}-{rate}-{i}-{os.getpid()}"
        request = _Request(transfer_id, arrival, tokens, math.ceil(tokens / BLOCK_TOKENS))
        while time.monotonic() < arrival:
            finished += _drain(reports, requests, relay)
            time.sleep(min(0.0005, max(0.0, arrival - time.monotonic())))
        requests[request.transfer_id] = request
        engines["producer"].put(("prefill", request.transfer_id, tokens, request.num_blocks, mode))
        if mode != PULL:
            engines["consumer"].put(("decode", request.transfer_id, tokens, request.num_blocks, mode))
    deadline = time.monotonic() + 60
    while finished < args.requests and time.monotonic() < deadline:
        finished += _drain(reports, requests, relay)
        time.sleep(0.001)
    if finished < args.requests:
        raise TimeoutError(f"{args.requests - finished} requests did not finish")
    return list(requests.values())


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean_ms": statistics.fmean(values) * 1e3,
        "p50_ms": statistics.median(values) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
    }


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [r["rate"] for r in results]
    for mode in ("pull", "push", "ideal"):
        ttft.plot(rates, [r[mode]["ttft"]["mean_ms"] for r in results], marker="o", label=mode)
        if mode != "ideal":
            tpot.plot(rates, [r[mode]["tpot"]["mean_ms"] for r in results], marker="o", label=mode)
    ttft.set(xlabel="request rate (req/s)", ylabel="TTFT mean (ms)", title="time to first token")
    tpot.set(xlabel="request rate (req/s)", ylabel="TPOT mean (ms)", title="time per output token")
    ttft.legend()
    tpot.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def _row(tp: str, prompt_tokens: int, rate: float, runs: dict[str, list[_Request]]) -> dict[str, Any]:
    """One rate's figures from each mode's requests."""
    row: dict[str, Any] = {"tp": tp, "prompt_tokens": prompt_tokens, "rate": rate}
    for mode, done in runs.items():
        row[mode] = {
            "ttft": _stats([r.first_token - r.arrival for r in done]),
            "tpot": _stats([r.tpot for r in done]),
            "verified": sum(r.intact is True for r in done),
            "compute": _stats([r.compute_s for r in done]),  # the simulated forward, handing over included
        }
        if mode != PULL:
            row[mode]["write"] = _stats([r.write_s for r in done])
            row[mode]["parts"] = statistics.fmean(r.parts for r in done)
        if mode == PUSH:
            ideal = [r.prefilled + r.write_s + (r.first_token - r.kv_arrived) - r.arrival for r in done]
            row["ideal"] = {"ttft": _stats(ideal)}
            row["write"] = row[PUSH]["write"]
    compute_only = runs.get(PUSH) or runs.get(PROGRESSIVE)
    if compute_only:
        ideal = [r.prefilled + (r.first_token - r.kv_arrived) - r.arrival for r in compute_only]
        row["ideal-compute"] = {
            "ttft": _stats(ideal),
            "prefill": _stats([r.prefilled - r.arrival for r in compute_only]),
        }

    def ratio(a: str, b: str, name: str) -> None:
        if a in row and b in row:
            row[name] = row[a]["ttft"]["mean_ms"] / row[b]["ttft"]["mean_ms"]

    ratio(PUSH, "ideal", "push_over_ideal_ttft")
    ratio(PULL, PUSH, "pull_over_push_ttft")
    ratio(PROGRESSIVE, "ideal-compute", "progressive_over_ideal_compute_ttft")
    ratio(PUSH, PROGRESSIVE, "push_over_progressive_ttft")
    return row


def _line(row: dict[str, Any]) -> str:
    """The row for the console."""
    line = f"tp {row['tp']}  prompt {row['prompt_tokens']}  rate {row['rate']:5.1f}/s  TTFT mean"
    for mode in (*MODES, "ideal", "ideal-compute"):
        if mode in row:
            line += f"  {mode} {row[mode]['ttft']['mean_ms']:.1f}"
    line += " ms"
    if PULL in row:
        line += (
            f"  (p99 pull {row[PULL]['ttft']['p99_ms']:.1f}, push {row[PUSH]['ttft']['p99_ms']:.1f})"
            f"  TPOT pull {row[PULL]['tpot']['mean_ms']:.1f} push {row[PUSH]['tpot']['mean_ms']:.1f} ms"
        )
    for mode in (PUSH, PROGRESSIVE):
        if mode in row:
            line += f"  WRITE p50 {mode} {row[mode]['write']['p50_ms']:.2f} ms"
    if PROGRESSIVE in row:
        line += f" ({row[PROGRESSIVE]['parts']:.1f} parts)"
    names = ("pull_over_push", "push_over_ideal", "progressive_over_ideal_compute", "push_over_progressive")
    for name in names:
        if f"{name}_ttft" in row:
            line += f"  {name.replace('_over_', '/')} {row[f'{name}_ttft']:.2f}x"
    return line


def _run_pair(server_address: str, sim: Sim, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start one producer/consumer engine pair, run every prompt length and rate against it, stop it; a row
    per prompt length and rate."""
    ctx = multiprocessing.get_context("spawn")
    reports: Any = ctx.Queue()
    engines: dict[str, Any] = {role: ctx.Queue() for role in ("producer", "consumer")}
    rows: list[dict[str, Any]] = []
    processes = [
        ctx.Process(target=_engine, args=(role, server_address, sim, q, reports), daemon=True)
        for role, q in engines.items()
    ]
    for p in processes:
        p.start()
    try:
        for _ in processes:
            assert reports.get(timeout=120)[0] == "started"
        tp = f"{sim.producer_ranks}:{sim.consumer_ranks}"
        modes = [m for m in args.modes if m != PULL or sim.pull]
        warmup = argparse.Namespace(**{**vars(args), "requests": args.warmup})
        for mode in modes if args.warmup else ():  # first contact: peer metadata, prepared descriptor lists
            _run_load(engines, reports, args.rates[0], args.prompt_tokens[0], warmup, mode, f"{sim.label}-warmup")
        for prompt_tokens in args.prompt_tokens:
            for rate in args.rates:
                runs = {m: _run_load(engines, reports, rate, prompt_tokens, args, m, sim.label) for m in modes}
                rows.append(_row(tp, prompt_tokens, rate, runs))
                print(_line(rows[-1]), flush=True)
    finally:
        for q in engines.values():
            q.put(("stop",))
        for p in processes:
            p.join(15)
            if p.is_alive():
                p.kill()
    return rows


def _tp_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        producer, _, consumer = item.partition(":")
        pair = int(producer), int(consumer or producer)
        if min(pair) < 1 or KV_HEADS % pair[0] or KV_HEADS % pair[1]:
            raise argparse.ArgumentTypeError(f"--tp {item}: each side's ranks must divide the {KV_HEADS} KV heads")
        pairs.append(pair)
    return pairs


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"--modes: {', '.join(unknown)} (choose among {', '.join(MODES)})")
    return [m for m in MODES if m in modes]


def _numbers(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> list[int | float]:
        return [kind(item) for item in text.split(",")]

    return parse


def parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=_numbers(float), default="10,20,35", help="request rates to run, req/s")
    parser.add_argument("--requests", type=int, default=60, help="requests per rate and mode")
    parser.add_argument("--warmup", type=int, default=2, help="requests per mode run first and not counted")
    parser.add_argument("--modes", type=_modes, default="pull,push", help=f"among {', '.join(MODES)}")
    parser.add_argument("--prompt-tokens", type=_numbers(int), default="512", help="mean prompt lengths to run")
    parser.add_argument("--prompt-spread", type=float, default=0.5, help="prompts uniform within +-this share")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens decoded per request")
    parser.add_argument("--prefill-us-per-token", type=float, default=40.0, help="simulated prefill compute")
    parser.add_argument("--decode-step-ms", type=float, default=20.0, help="simulated decode step")
    parser.add_argument("--pull-setup-ms", type=float, default=2.0, help="pull setup on the decode step loop")
    parser.add_argument("--pull-relay-ms", type=float, default=1.0, help="pull: the router's hop to decode")
    parser.add_argument(
        "--pull-handshake-ms", type=float, default=50.0, help="pull: decode's first contact with prefill"
    )
    parser.add_argument(
        "--progressive", choices=("layer", "chunk"), default="layer", help="push-progressive: parts per layer or chunk"
    )
    parser.add_argument("--chunk-tokens", type=int, default=512, help="push-progressive --progressive chunk")
    parser.add_argument(
        "--part-compute-ratio",
        type=float,
        help="push-progressive: the writer's WriterConfig.part_compute_ratio (default: its default; 0: every part)",
    )
    parser.add_argument(
        "--verify", choices=("ends", "bytes", "off"), default="ends", help="what the consumer checks of each request"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-32b", help="KV bytes per token")
    parser.add_argument("--kv-scale", type=int, default=32, help="divide the model's KV bytes per token by this")
    parser.add_argument("--pool-blocks", type=int, default=1024, help="KV blocks per engine")
    parser.add_argument("--tp", type=_tp_pairs, default="1:1", help="producer:consumer ranks, e.g. 4:4,4:2,2:4")
    parser.add_argument("--name", default="serving_sim", help="results file name (without .json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every engine pair; the results (what `main` writes)."""
    os.environ.setdefault("UCX_TLS", "shm,tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    bytes_per_token = MODELS[args.model] // args.kv_scale
    layers = MODEL_LAYERS[args.model] if PROGRESSIVE in args.modes else 0
    regions = KV * (layers or 1)
    head_bytes = bytes_per_token * BLOCK_TOKENS // regions // KV_HEADS
    if head_bytes * regions * KV_HEADS != bytes_per_token * BLOCK_TOKENS or (args.verify != "off" and head_bytes % 8):
        raise SystemExit(f"--kv-scale {args.kv_scale}: a head of a block of a region must be a multiple of 8 bytes")
    largest = math.ceil(max(args.prompt_tokens) * (1 + args.prompt_spread) / BLOCK_TOKENS)
    if largest > args.pool_blocks:
        raise SystemExit(f"--pool-blocks {args.pool_blocks}: the longest prompt needs {largest}")
    print(
        f"{args.model} KV / {args.kv_scale}: {bytes_per_token} B/token in {regions} regions, prompts of"
        f" {','.join(map(str, args.prompt_tokens))} tokens (+-{args.prompt_spread:.0%})"
    )
    from rendezvous.clients.testing import TestServer

    results: list[dict[str, Any]] = []
    with TestServer() as server:
        for producer_ranks, consumer_ranks in args.tp:
            sim = Sim(
                prefill_s_per_token=args.prefill_us_per_token * 1e-6,
                decode_step_s=args.decode_step_ms * 1e-3,
                pull_setup_s=args.pull_setup_ms * 1e-3,
                pull_relay_s=args.pull_relay_ms * 1e-3,
                pull_handshake_s=args.pull_handshake_ms * 1e-3,
                output_tokens=args.output_tokens,
                block_bytes=bytes_per_token * BLOCK_TOKENS // regions,
                pool_blocks=args.pool_blocks,
                model=args.model,
                producer_ranks=producer_ranks,
                consumer_ranks=consumer_ranks,
                layers=layers,
                progressive=args.progressive,
                chunk_tokens=args.chunk_tokens,
                part_compute_ratio=args.part_compute_ratio,
                verify=args.verify,
                with_pull=PULL in args.modes,
            )
            results.extend(_run_pair(server.address, sim, args))
    return {
        "benchmark": "serving_sim",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bytes_per_token": bytes_per_token,
        "results": results,
    }


def main() -> None:
    args = parser().parse_args()
    load = os.getloadavg()
    payload = run(args)
    payload["machine"]["load_average_at_start"] = load
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results: {path}")
    with_pull = [r for r in payload["results"] if "pull" in r and r["prompt_tokens"] == args.prompt_tokens[0]]
    if with_pull:
        _plot(with_pull, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
