"""Run the custom-engine example: python -m examples.custom_engine [--requests N] [--auth] (from the repository
root)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .model import BLOCK_SIZE, blocks_needed
from .router import DECODE_ID, PREFILL_ID, Router
from .secure import secure

LEASE_TTL = 5.0
"""Prefill's lease: how soon decode hears that a killed prefill is gone. Renewed every third of it, so only a
process stalled for seconds loses it by mistake; the server's default is 10 s."""
POOL_BLOCKS = 256


@contextlib.contextmanager
def rendezvous_service(flags: Sequence[str] = ()) -> Iterator[str]:
    """`kv-rendezvous serve` on a free loopback port (it prints the port it got); yields its address."""
    command = [sys.executable, "-m", "rendezvous.cli", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"]
    command += ["--drain", "0", "--log-level", "warning", *flags]
    service = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert service.stdout is not None
        banner = service.stdout.readline()  # "kv-rendezvous X serving on 127.0.0.1:PORT (store memory ...)"
        yield banner.split(" serving on ")[1].split()[0]
    finally:
        service.terminate()
        service.wait()


def prompts(n: int) -> list[str]:
    """n prompts of 2 to 5 blocks of tokens."""
    return [f"request {i}: " + "lorem ipsum " * (i % (4 * BLOCK_SIZE // 12) + 1) for i in range(n)]


def requests(router: Router, n: int) -> None:
    """n requests at once, each byte-verified by decode; then prefill has every one's blocks back (a source is
    freed once its write's report was answered, a round trip after decode has the bytes)."""
    ids = [router.submit(prompt) for prompt in prompts(n)]
    failed = [r for r in (router.wait("done", i) for i in ids) if r[2] is not True]
    check(not failed, f"{n} requests: every byte of their KV landed in decode's blocks", failed)
    for transfer_id in ids:
        router.wait("freed", transfer_id)


def unsigned(router: Router) -> None:
    """--auth: a request the router did not sign is refused at both engines, and nothing of it is registered."""
    transfer_id = router.submit("a request without the router's binding", sign=False)
    decode, prefill = router.wait("done", transfer_id), router.wait("claimed", transfer_id)
    refused = decode[2:] == (False, "BINDING_REQUIRED") and prefill[2] == "BINDING_REQUIRED"
    check(refused, "unsigned request: target and claim refused BINDING_REQUIRED", (decode, prefill))
    check(router.pools() == {"decode": POOL_BLOCKS, "prefill": POOL_BLOCKS}, "unsigned request: both pools whole")


def decode_abort(router: Router) -> None:
    """Decode aborts a request whose prefill is still running; both engines get their blocks back."""
    transfer_id = router.submit("a request whose client goes away", hold=True)
    router.wait("registered", transfer_id)
    router.wait("claimed", transfer_id)  # matched: the prefill side holds the assignment
    router.decode.send("abort", transfer_id)
    done = router.wait("done", transfer_id)
    router.prefill.send("finish", transfer_id)  # its prefill ends after the abort: the source is freed at once
    router.wait("freed", transfer_id)
    check(done[2:] == (False, "REQUESTED"), "decode abort: decode told REQUESTED, prefill freed its blocks", done)
    check(router.pools() == {"decode": POOL_BLOCKS, "prefill": POOL_BLOCKS}, "decode abort: both pools whole")


def prefill_killed(router: Router) -> None:
    """Prefill dies (SIGKILL) after taking a request; decode learns PEER_LOST within its lease."""
    transfer_id = router.submit("a request whose prefill dies", hold=True)
    router.wait("registered", transfer_id)
    router.wait("claimed", transfer_id)
    router.prefill.kill()
    killed = time.monotonic()
    done = router.wait("done", transfer_id)
    after = time.monotonic() - killed
    check(done[2:] == (False, "PEER_LOST"), f"prefill killed: decode told PEER_LOST after {after:.1f} s", done)
    router.decode.send("pool")
    check(router.wait("pool", "decode")[2] == POOL_BLOCKS, "prefill killed: decode's pool whole")


def check(ok: bool, what: str, detail: object = "") -> None:
    print(("ok    " if ok else "FAILED ") + what + ("" if ok else f": {detail}"), flush=True)
    if not ok:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=50, help="requests in the first step (default 50)")
    parser.add_argument(
        "--auth", action="store_true", help="a token per engine and the router's bindings, required (secure.py)"
    )
    args = parser.parse_args()
    if sum(blocks_needed(p) for p in prompts(args.requests)) > POOL_BLOCKS:
        parser.error(f"{args.requests} requests at once do not fit pools of {POOL_BLOCKS} blocks")
    os.environ.setdefault("UCX_TLS", "shm,tcp")  # NIXL over UCX, on loopback only
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    decode: dict[str, Any] = {"num_blocks": POOL_BLOCKS}
    prefill: dict[str, Any] = {"num_blocks": POOL_BLOCKS, "lease_ttl": LEASE_TTL}
    with tempfile.TemporaryDirectory() as folder:
        flags: tuple[str, ...] = ()
        binding_key = None
        if args.auth:
            secured = secure(Path(folder), {DECODE_ID: ("consumer", "decode"), PREFILL_ID: ("producer", "prefill")})
            flags, binding_key = secured.serve_flags, secured.binding_key
            decode["token"], prefill["token"] = secured.tokens[DECODE_ID], secured.tokens[PREFILL_ID]
        with rendezvous_service(flags) as address:
            router = Router(address, decode_options=decode, prefill_options=prefill, binding_key=binding_key)
            try:
                requests(router, args.requests)
                if args.auth:
                    unsigned(router)
                decode_abort(router)
                prefill_killed(router)
            finally:
                router.close()


if __name__ == "__main__":
    main()
