"""The KV index's cost per event batch and per query (KvIndexService), memory store and Redis, over real gRPC.

    python benchmarks/bench_index.py [--runs 3] [--engines 16] [--blocks 4096] [--batches 2000] [--queries 2000]

A fleet of --engines engines each starts from a snapshot of --blocks blocks (chains of 64). Then:

  report  ReportCacheEvents, engine after engine: a batch as a vLLM scheduler step sends it, one BlocksStored of
          16 blocks linked to a held block and one BlocksRemoved of the 16 that engine stored the batch before
          (so every entry keeps its size)
  query   MatchPrefixes of a 64-block chain over every engine (no filter): the engine holding it matches 64,
          the others 0 (each engine's hashes are its own); with --min-matched 1 only the holder is answered

Each call is awaited before the next (one in flight): its latency is the round trip on loopback. Client and
server share this process (rendezvous.clients.testing), so "cpu" is both sides' Python per call; Redis's own CPU per
call (INFO cpu) is apart. The `_service` phases make the same calls on the server's coordinator directly (no gRPC, no
SDK): what the service itself spends per batch and per query. --runs runs of each store; the report gives
medians and the spread (min to max) of each run's figures. Results go to benchmarks/results/index-<n>.json
(--tag to name them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

RESULTS = Path(__file__).parent / "results"
CHAIN = 64
STEP = 16


@contextlib.contextmanager
def local_redis() -> Iterator[str]:
    """A throwaway redis-server on a unix socket (no persistence)."""
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "redis.sock"
        argv = ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        try:
            for _ in range(200):
                if sock.exists():
                    break
                time.sleep(0.025)
            else:
                raise RuntimeError("redis-server did not start")
            yield f"unix://{sock}"
        finally:
            proc.terminate()
            proc.wait()


def block(engine: int, n: int) -> bytes:
    """A block hash of 32 bytes, unique per engine and number."""
    return engine.to_bytes(4, "big") + n.to_bytes(28, "big")


def redis_cpu(url: str | None) -> float:
    """Redis's own CPU seconds so far (0 for the memory store)."""
    if url is None:
        return 0.0
    info = redis.Redis.from_url(url).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def figures(latencies: list[float], cpu: float, redis_s: float) -> dict[str, float]:
    latencies.sort()
    n = len(latencies)
    return {
        "p50_us": latencies[n // 2] * 1e6,
        "p90_us": latencies[int(n * 0.9)] * 1e6,
        "cpu_us": cpu / n * 1e6,
        "redis_cpu_us": redis_s / n * 1e6,
    }


async def one_run(store: str, redis_url: str | None, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from rendezvous.clients import (
        AsyncRendezvousClient,
        BlockHashing,
        BlocksRemoved,
        BlocksStored,
        CacheReport,
        CacheSnapshot,
        EngineRole,
        EngineSpec,
        PrefixQuery,
    )
    from rendezvous.clients.testing import stand_in_agent, start_test_server
    from rendezvous.core import Limits

    hashing = BlockHashing("sha256_cbor", "0", 16)
    limits = Limits(max_index_blocks_total=1 << 30)
    async with (
        start_test_server(store=store, limits=limits) as server,
        AsyncRendezvousClient(server.address) as client,
    ):
        ids = [f"e{i}" for i in range(args.engines)]
        for i, engine_id in enumerate(ids):
            agents = (stand_in_agent(f"{engine_id}-rank0"),)
            spec = EngineSpec(engine_id, "pool", EngineRole.CONSUMER, agents=agents, lease_ttl=300)
            await client.register_engine(spec)
            held = tuple(block(i, n) for n in range(args.blocks))
            await client.replace_cached_blocks(CacheSnapshot(engine_id, 0, hashing, ((0, held),)))
        sequence = dict.fromkeys(ids, 0)
        steps = dict.fromkeys(ids, 0)
        index = server.server.coordinator.index
        out: dict[str, dict[str, float]] = {}

        def next_report(k: int) -> CacheReport:
            i = k % args.engines
            engine_id = ids[i]
            step = steps[engine_id]
            steps[engine_id] += 1
            fresh = tuple(block(i, args.blocks + step * STEP + n) for n in range(STEP))
            events: list[Any] = [BlocksStored(fresh, block(i, 0), 0, STEP * 16)]
            if step:
                events.append(BlocksRemoved(tuple(block(i, args.blocks + (step - 1) * STEP + n) for n in range(STEP))))
            sequence[engine_id] += 1
            return CacheReport(engine_id, sequence[engine_id], tuple(events))

        def next_query(q: int) -> PrefixQuery:
            i = q % args.engines
            start = (q * CHAIN) % (args.blocks - CHAIN)
            return PrefixQuery(tuple(block(i, start + n) for n in range(CHAIN)), min_matched=args.min_matched)

        # Over gRPC through the SDK, then the service's own part: the coordinator's calls, no gRPC.
        for suffix, report, query in (
            ("", client.report_cache_events, client.match_prefixes),
            ("_service", index.report, index.match),
        ):
            latencies: list[float] = []
            cpu, rcpu = time.process_time(), redis_cpu(redis_url)
            for k in range(args.batches):
                request = next_report(k)
                started = time.perf_counter()
                await report(request)
                latencies.append(time.perf_counter() - started)
            out["report" + suffix] = figures(latencies, time.process_time() - cpu, redis_cpu(redis_url) - rcpu)
            latencies = []
            cpu, rcpu = time.process_time(), redis_cpu(redis_url)
            for q in range(args.queries):
                chain = next_query(q)
                started = time.perf_counter()
                found = await query(chain)
                latencies.append(time.perf_counter() - started)
                assert found[0].matched_blocks == CHAIN and len(found) == (1 if args.min_matched else args.engines)
            out["query" + suffix] = figures(latencies, time.process_time() - cpu, redis_cpu(redis_url) - rcpu)
    return out


async def footprint(redis_url: str, blocks: int = 200_000) -> dict[str, float]:
    """Bytes a held block costs: the memory store's Python heap (tracemalloc: the set and the hashes it keeps) and
    Redis's used_memory, for one entry of `blocks` blocks of 32-byte hashes written by a snapshot's decision."""
    import tracemalloc

    from rendezvous.core import Limits
    from rendezvous.core.cache_index import IndexEntry, IndexWrite, member
    from rendezvous.core.model import Role
    from rendezvous.protocol.cache_index import BlockHashing
    from rendezvous.store.cache_index import IndexBounds, MemoryIndex
    from rendezvous.store.factory import create_store

    entry = IndexEntry("e0", 1, "pool", Role.CONSUMER, 0, BlockHashing("x"), blocks)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = MemoryIndex()
    # The hashes are made inside the trace: the index keeps them (a request's bytes objects).
    members = frozenset(member(0, block(0, n)) for n in range(blocks))
    await index.write(None, IndexWrite(entry, True, members, frozenset()), IndexBounds(blocks, blocks))
    del members
    out = {"memory_bytes_per_block": (tracemalloc.get_traced_memory()[0] - before) / blocks}
    tracemalloc.stop()
    del index
    write = IndexWrite(entry, True, frozenset(member(0, block(0, n)) for n in range(blocks)), frozenset())
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    store = create_store(redis_url, Limits())
    await store.open()
    used = int(client.info("memory")["used_memory"])
    await store.index().write(None, write, IndexBounds(blocks, blocks))
    out["redis_bytes_per_block"] = (int(client.info("memory")["used_memory"]) - used) / blocks
    await store.close()
    return out


def summary(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per phase and figure: median, min and max over the runs."""
    return {
        phase: {
            key: {
                "median": statistics.median(r[phase][key] for r in runs),
                "min": min(r[phase][key] for r in runs),
                "max": max(r[phase][key] for r in runs),
            }
            for key in runs[0][phase]
        }
        for phase in runs[0]
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=4096, help="blocks each engine holds")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--min-matched", type=int, default=0, help="queries answer only engines holding this many")
    parser.add_argument("--stores", default="memory,redis")
    parser.add_argument("--redis-url", help="use this Redis instead of starting a local redis-server")
    parser.add_argument("--tag", default="", help="results file name: index[-tag]-<n>.json")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for store in args.stores.split(","):
            url = None
            if store == "redis":
                url = args.redis_url or stack.enter_context(local_redis())
            runs = []
            for _ in range(args.runs):
                if url is not None:
                    redis.Redis.from_url(url).flushall()
                runs.append(asyncio.run(one_run("memory" if url is None else url, url, args)))
            results[store] = {"runs": runs, "summary": summary(runs)}
        sizes = asyncio.run(footprint(args.redis_url or stack.enter_context(local_redis())))
    header = f"{'store':8} {'phase':14} {'p50 us':>16} {'p90 us':>16} {'cpu us/call':>16} {'redis cpu us':>16}"
    print(header)
    for store, r in results.items():
        for phase, keys in r["summary"].items():
            cells = [f"{v['median']:7.0f} ({v['min']:.0f}-{v['max']:.0f})" for v in keys.values()]
            print(f"{store:8} {phase:14} " + " ".join(f"{c:>16}" for c in cells))
    document = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "stores": results,
        "footprint": sizes,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "index" + (f"-{args.tag}" if args.tag else "")
    n = 1
    while (args.out_dir / f"{name}-{n}.json").exists():
        n += 1
    path = args.out_dir / f"{name}-{n}.json"
    path.write_text(json.dumps(document, indent=2))
    print("bytes per held block: " + ", ".join(f"{k} {v:.0f}" for k, v in sizes.items()))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
