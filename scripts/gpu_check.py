"""NIXL VRAM -> VRAM through the project's writer and receiver: two processes on one GPU, two ranks a side.

Run by scripts/gpu_check.sh. The producer (this process) runs one `TransferWriter` per rank; a spawned consumer
process owns a `TransferReceiver` per rank and polls them. Two engines' worth of cases, each transfer checked
byte for byte on the GPU and timed next to a device-to-device torch copy of as many bytes:

  tp2->tp2  producer TP 2 into consumer TP 2: whole blocks, rank to rank (prepared descriptor lists)
  pp2->tp2  producer PP 2 (each stage half the layers, all heads) into consumer TP 2: every producer rank writes
            its layers' head slices into both consumer ranks (per-transfer descriptor lists)
  tp2->tp2 layer-wise
            progressive push racing the kernels: each layer's KV is written on the GPU by a copy queued behind a
            long kernel and handed to the writer at once, with the event that marks it computed
            (`rendezvous.clients.nixl.device.CudaDevice`); the consumer must hold the computed bytes, never the stale
            ones the producer's memory held before (a write posted before its event would copy those)

Only the data plane is loaded (clients/nixl and rendezvous/protocol, not the SDK's package, which needs gRPC
extras), and NIXL either as `nixl` or as the bare `nixl_cu13` wheel. Without a GPU it prints "no GPU: skipping"
and exits 0. `--device cpu` runs the same flow on DRAM (small sizes), to check the script where no GPU is.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import statistics
import sys
import threading
import time
import types
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LAYERS, HEADS, TOKENS, UNIT = 16, 8, 16, 256  # UNIT: bytes of one token of one head (128 x fp16)
LAYERWISE = "tp2->tp2 layer-wise"
SPIN_CYCLES = 20_000_000  # the long kernel ahead of each layer's copy: ~10 ms at 2 GHz
STALE = 0xEE  # the producer's KV before the kernels computed it


def load_data_plane() -> None:
    """Make `rendezvous.clients.nixl.*` importable without running the `rendezvous.clients` and
    `rendezvous.clients.nixl` package modules (they load the whole SDK, and gRPC with it), and `nixl` resolve to
    `nixl_cu13` when only that wheel is there. `rendezvous` itself is import-free."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    for name, path in (
        ("rendezvous.clients", REPO / "clients"),
        ("rendezvous.clients.nixl", REPO / "clients" / "nixl"),
    ):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
            parent, _, child = name.rpartition(".")
            setattr(importlib.import_module(parent), child, package)
    try:
        importlib.import_module("nixl._api")
    except ImportError:
        backend = importlib.import_module("nixl_cu13")
        sys.modules["nixl"] = backend
        for sub in ("_bindings", "_utils", "logging", "_api"):
            sys.modules[f"nixl.{sub}"] = importlib.import_module(f"nixl_cu13.{sub}")


@dataclass(frozen=True)
class Engine:
    tp: int
    pp: int

    def layout(self, block_size: int = TOKENS) -> Any:
        from rendezvous.protocol.records import KvLayout

        return KvLayout("gpu-check", "fp16", block_size, LAYERS, self.tp, self.pp, "HND", HEADS)

    def layers(self, rank: int) -> range:
        per = LAYERS // self.pp
        return range(rank // self.tp * per, (rank // self.tp + 1) * per)

    def heads(self, rank: int) -> range:
        per = HEADS // self.tp
        return range(rank % self.tp * per, (rank % self.tp + 1) * per)

    def tensors(self, rank: int, num_blocks: int, device: str, seed: int | None) -> list[Any]:
        """Per layer K and V, [num_blocks, heads, tokens * unit] bytes: random from `seed`, or zeros."""
        import torch

        shape = (num_blocks, len(self.heads(rank)), TOKENS * UNIT)
        out = []
        for i in range(len(self.layers(rank)) * 2):
            if seed is None:
                out.append(torch.zeros(shape, dtype=torch.uint8, device=device))
            else:
                g = torch.Generator(device=device).manual_seed(seed * 1000 + rank * 100 + i)
                out.append(torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g))
        return out


CONSUMER = Engine(2, 1)
CASES = {"tp2->tp2": Engine(2, 1), "pp2->tp2": Engine(1, 2), LAYERWISE: Engine(2, 1)}


def consumer(conn: Connection, device: str, num_blocks: int) -> None:
    """The consumer engine: two ranks' receivers, polled steadily; checks the bytes when asked."""
    load_data_plane()
    from rendezvous.clients.nixl.agent import NixlEndpoint
    from rendezvous.clients.nixl.receiver import TransferReceiver

    tensors = [CONSUMER.tensors(r, num_blocks, device, None) for r in range(2)]
    receivers = [TransferReceiver(NixlEndpoint.from_tensors(f"gpu-check-c{r}", tensors[r])) for r in range(2)]
    conn.send([rx.agent_info(r) for r, rx in enumerate(receivers)])  # TP 2, PP 1: no layer ranges to state
    while True:
        for rx in receivers:
            rx.poll_notifications()  # completes the producers' WRITEs; their success is what is checked
        if not conn.poll():
            continue
        command, *args = conn.recv()
        if command == "stop":
            break
        if command == "check":
            case, seed, src, dst = args
            conn.send(check(tensors, case, seed, src, dst, device=device, num_blocks=num_blocks))
            for rank in tensors:
                for t in rank:
                    t.zero_()
    for rx in receivers:
        rx.endpoint.close()


def check(
    tensors: list[list[Any]], case: str, seed: int, src: list[int], dst: list[int], device: str, num_blocks: int
) -> str:
    """ "ok", or what differs: each consumer block against the producer's, head by head; the rest still zero."""
    import torch

    producer = CASES[case]
    sources = [producer.tensors(r, num_blocks, device, seed) for r in range(producer.tp * producer.pp)]
    for c_rank, regions in enumerate(tensors):
        for j, got in enumerate(regions):
            layer, kind = CONSUMER.layers(c_rank)[j // 2], j % 2
            want = torch.zeros_like(got)
            for h, head in enumerate(CONSUMER.heads(c_rank)):
                p_rank = next(
                    r
                    for r in range(producer.tp * producer.pp)
                    if layer in producer.layers(r) and head in producer.heads(r)
                )
                p_region = (layer - producer.layers(p_rank).start) * 2 + kind
                local = head - producer.heads(p_rank).start
                want[dst, h] = sources[p_rank][p_region][src[len(src) - len(dst) :], local]
            if not torch.equal(got, want):
                return f"{case}: consumer rank {c_rank} region {j} differs"
    return "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--blocks", type=int, default=0, help="blocks per region (default: 544 on cuda, 40 on cpu)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("no GPU: skipping (torch is not installed)")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU: skipping (torch sees no CUDA device)")
        return 0
    load_data_plane()
    from rendezvous.clients.nixl.writer import ConsumerEngine

    num_blocks = max(args.blocks or (544 if args.device == "cuda" else 40), 17)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=consumer, args=(child, args.device, num_blocks), daemon=True)
    process.start()
    if not conn.poll(180):
        print("FAIL: the consumer process did not start")
        return 1
    engine = ConsumerEngine(CONSUMER.layout(), tuple(conn.recv()))
    src = list(range(num_blocks - 8))  # the context: all but 8 blocks, the first 8 already at the consumer
    dst = [b + 8 for b in range(num_blocks - 16)]
    failures = 0
    try:
        for case, producer in CASES.items():
            if case == LAYERWISE:
                failures += not run_layerwise(producer, engine, conn, args.device, num_blocks, src, dst)
            else:
                failures += not run_case(case, producer, engine, conn, args.device, args.reps, num_blocks, src, dst)
    finally:
        conn.send(("stop",))
        process.join(30)
    return 1 if failures else 0


def start_writers(
    name: str, producer: Engine, tensors: list[list[Any]]
) -> tuple[list[Any], threading.Semaphore, list[str]]:
    """One started `TransferWriter` per producer rank over its tensors (with PP, each its stage's layers), the
    semaphore each completion releases, and the list failed completions are reported to."""
    from rendezvous.clients.nixl.agent import NixlEndpoint
    from rendezvous.clients.nixl.writer import TransferWriter

    done = threading.Semaphore(0)
    errors: list[str] = []

    def on_complete(transfer_id: str, generation: int, ok: bool, error: str | None) -> None:
        if not ok:
            errors.append(f"{transfer_id}: {error}")
        done.release()

    writers = [
        TransferWriter(
            NixlEndpoint.from_tensors(f"gpu-check-{name}-p{r}", tensors[r]),
            on_complete=on_complete,
            on_revoked=lambda *_: None,
            on_source_free=lambda *_: None,
            layout=producer.layout(),
            rank=r,
            first_layer=producer.layers(r).start if producer.pp > 1 else 0,
            num_layers=len(producer.layers(r)) if producer.pp > 1 else 0,
        )
        for r in range(producer.tp * producer.pp)
    ]
    for w in writers:
        w.start()
    return writers, done, errors


def run_case(
    case: str,
    producer: Engine,
    engine: Any,
    conn: Connection,
    device: str,
    reps: int,
    num_blocks: int,
    src: list[int],
    dst: list[int],
) -> bool:
    """One producer engine's ranks write `reps` + 1 transfers into the consumer; the last is checked."""
    seed = len(case) + (1 if case.startswith("pp") else 0)
    ranks = producer.tp * producer.pp
    tensors = [producer.tensors(r, num_blocks, device, seed) for r in range(ranks)]
    writers, done, errors = start_writers(case, producer, tensors)
    seconds = []
    for rep in range(reps + 1):  # the first one connects the agents: not timed
        transfer_id = f"{case}-{rep}"
        for w in writers:
            w.assign(transfer_id, 1, engine, 1, dst)
        assert all(w.barrier(30) for w in writers)
        start = time.perf_counter()
        for w in writers:
            w.source_ready(transfer_id, src)
        for _ in writers:
            if not done.acquire(timeout=60):
                errors.append(f"{transfer_id}: no completion within 60 s")
                break
        seconds.append(time.perf_counter() - start)
    for w in writers:
        w.stop(30)
    conn.send(("check", case, seed, src, dst))
    verdict = conn.recv() if conn.poll(120) else "no answer from the consumer"
    moved = sum(t[0].numel() for r in tensors for t in r) * len(dst)
    nixl_gbs = moved / statistics.median(seconds[1:] or seconds) / 1e9
    torch_gbs = torch_copy_gbs(moved, device)
    ok = verdict == "ok" and not errors
    print(
        f"{case}: {'OK' if ok else 'FAIL'}  {moved / 2**20:.0f} MiB per transfer, {ranks} producer ranks -> 2 "
        f"consumer ranks; NIXL WRITE {nixl_gbs:.1f} GB/s (median of {reps}), torch device copy "
        f"{torch_gbs:.1f} GB/s" + ("" if ok else f"; {verdict}; {errors[:3]}"),
        flush=True,
    )
    return ok


def run_layerwise(
    producer: Engine, engine: Any, conn: Connection, device: str, num_blocks: int, src: list[int], dst: list[int]
) -> bool:
    """One transfer pushed layer by layer while the device computes each layer behind a long kernel; checked."""
    import torch

    from rendezvous.clients.nixl.device import CpuDevice, CudaDevice, Device

    seed, ranks, prompt = 5, producer.tp * producer.pp, len(src) * TOKENS
    computed = [producer.tensors(r, num_blocks, device, seed) for r in range(ranks)]  # what the kernels write
    tensors = [[torch.full_like(t, STALE) for t in rank] for rank in computed]
    compute: Device = CudaDevice(torch.device(device)) if device == "cuda" else CpuDevice()
    writers, done, errors = start_writers("layerwise", producer, tensors)
    for w in writers:
        w.assign(LAYERWISE, 1, engine, 1, dst, prompt_tokens=prompt, progressive=True)
    assert all(w.barrier(30) for w in writers)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for layer in range(LAYERS):
        for r, w in enumerate(writers):
            if device == "cuda":  # the layer's attention: still queued when its KV is handed over
                torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]
            for region in (2 * layer, 2 * layer + 1):
                tensors[r][region].copy_(computed[r][region], non_blocking=True)
            w.source_part(LAYERWISE, src, prompt, (layer, layer + 1), prompt_tokens=prompt, kv_ready=compute.record())
    handed = time.perf_counter() - start  # the forward's thread was not held up by the writes
    for w in writers:
        w.source_ready(LAYERWISE, src, kv_ready=compute.record())
    for _ in writers:
        if not done.acquire(timeout=120):
            errors.append("no completion within 120 s")
            break
    seconds = time.perf_counter() - start
    for w in writers:
        w.stop(30)
    conn.send(("check", LAYERWISE, seed, src, dst))
    verdict = conn.recv() if conn.poll(120) else "no answer from the consumer"
    ok = verdict == "ok" and not errors
    print(
        f"{LAYERWISE}: {'OK' if ok else 'FAIL'}  {LAYERS} layers x {ranks} ranks handed over in {handed * 1e3:.1f} ms"
        f", all written {seconds * 1e3:.1f} ms after the first" + ("" if ok else f"; {verdict}; {errors[:3]}"),
        flush=True,
    )
    return ok


def torch_copy_gbs(nbytes: int, device: str) -> float:
    """GB/s of a copy of `nbytes` between two buffers on the device, median of 5 after a warm-up."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    seconds = []
    for _ in range(6):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        b.copy_(a)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds[1:]) / 1e9


if __name__ == "__main__":
    sys.exit(main())
