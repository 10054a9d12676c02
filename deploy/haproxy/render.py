"""Render haproxy.cfg.template into a folder: an HAProxy admission front for `kv-rendezvous serve`.

    python deploy/haproxy/render.py OUT_DIR --server 10.0.0.5:50051 [--listen :8443] [--max-calls 32] ...
    haproxy -f OUT_DIR/haproxy.cfg

The front refuses in C what the service would otherwise queue in gRPC core: a caller past its share of
concurrent calls or streams at once, any call that waited `--queue-timeout-ms` for one of the service's
`--max-calls` slots. Each refusal is a gRPC trailers-only answer, RESOURCE_EXHAUSTED with a google.rpc.Status
(ErrorInfo in the service's domain, and a RetryInfo) built here from the protos, so that the SDK reads it as
it reads the service's own (docs/operations.md "An admission front (HAProxy)").
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template
from urllib.parse import quote

from rendezvous.protocol.convert import error_status
from rendezvous.protocol.errors import RendezvousError
from rendezvous.protocol.reasons import Reason

TEMPLATE = Path(__file__).with_name("haproxy.cfg.template")


@dataclass(frozen=True)
class Front:
    """What the front admits (defaults: what bench_overload.py measured best on one 2-core machine).

    max_calls: concurrent unary calls the service is given; the rest waits in HAProxy, in priority order, at
        most `queue_timeout_ms`, then is refused RATE_LIMITED. Size it from the capacity model: enough to keep
        the service busy (calls/s it serves x one call's latency), no more, since every call inside waits in
        gRPC core's first-come-first-served queue.
    calls_share, rate_per_caller: a caller with more concurrent calls, or more calls/s, waits behind the
        others' calls (HAProxy priority class 1).
    calls_per_caller, streams_per_caller: past these a caller's call or Watch/KeepAlive stream is refused at
        once, TOO_MANY_CONCURRENT_CALLS.
    retry_after_s: the RetryInfo of every refusal.
    """

    listen: str
    server: str
    max_calls: int = 32
    calls_share: int = 24
    calls_per_caller: int = 128
    streams_per_caller: int = 64
    rate_per_caller: int = 1000
    queue_timeout_ms: int = 200
    retry_after_s: float = 0.2
    max_connections: int = 4096


def refusal_headers(reason: Reason, message: str, retry_after_s: float) -> list[tuple[str, str]]:
    """The trailers of a gRPC RESOURCE_EXHAUSTED answer, with its google.rpc.Status as the service sends it."""
    status = error_status(RendezvousError(reason, message, retry_after=retry_after_s, refused_by="front"))
    details = base64.b64encode(status.SerializeToString()).decode()
    return [
        ("grpc-status", str(status.code)),
        ("grpc-message", quote(message, safe=" ,;:()'")),
        ("grpc-status-details-bin", details),
    ]


def _write_answer(path: Path, headers: list[tuple[str, str]]) -> Path:
    """A trailers-only gRPC answer as an HAProxy errorfile (an HTTP/1 response HAProxy sends as HTTP/2)."""
    lines = ["HTTP/1.1 200 OK", "content-type: application/grpc", "content-length: 0"]
    path.write_text("\r\n".join([*lines, *(f"{name}: {value}" for name, value in headers), "", ""]))
    return path


def render(front: Front, out: Path) -> Path:
    """Write haproxy.cfg and its refusals (errorfiles) into out; the config's path. HAProxy's stats socket
    will be out/stats.sock."""
    out.mkdir(parents=True, exist_ok=True)
    retry = front.retry_after_s
    queued = refusal_headers(
        Reason.RATE_LIMITED, "no slot of the service came free in time; retry after the hint", retry
    )
    calls = refusal_headers(
        Reason.TOO_MANY_CONCURRENT_CALLS, f"more than {front.calls_per_caller} concurrent calls of this caller", retry
    )
    streams = refusal_headers(
        Reason.TOO_MANY_CONCURRENT_CALLS, f"more than {front.streams_per_caller} open streams of this caller", retry
    )
    config = Template(TEMPLATE.read_text()).substitute(
        listen=front.listen,
        server=front.server,
        max_calls=front.max_calls,
        calls_share=front.calls_share,
        calls_per_caller=front.calls_per_caller,
        streams_per_caller=front.streams_per_caller,
        rate_per_caller=front.rate_per_caller,
        queue_timeout_ms=front.queue_timeout_ms,
        max_connections=front.max_connections,
        stats_socket=out / "stats.sock",
        queue_refusal=_write_answer(out / "queue_refusal.http", queued),
        too_many_calls=_write_answer(out / "too_many_calls.http", calls),
        too_many_streams=_write_answer(out / "too_many_streams.http", streams),
    )
    path = out / "haproxy.cfg"
    path.write_text(config)
    return path


def refused(stats_socket: Path) -> int:
    """Calls the front answered itself so far (refused per caller or from the queue): every request it took
    less those it passed to a server, from `show stat` on its stats socket."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(stats_socket))
        sock.sendall(b"show stat\n")
        text = b"".join(iter(lambda: sock.recv(65536), b"")).decode()
    header, *rows = text.lstrip("# ").splitlines()
    records = [dict(zip(header.split(","), row.split(","), strict=False)) for row in rows if row]
    taken = sum(int(r["req_tot"] or 0) for r in records if r["svname"] == "FRONTEND")
    passed = sum(int(r["stot"] or 0) for r in records if r["svname"] not in ("FRONTEND", "BACKEND"))
    return taken - passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for haproxy.cfg and its errorfiles")
    parser.add_argument("--server", required=True, help="the service's host:port")
    parser.add_argument("--listen", default=":8443", help="the front's address")
    for field in dataclasses.fields(Front):
        if field.name not in ("listen", "server"):
            kind = float if isinstance(field.default, float) else int
            parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=field.default)
    args = parser.parse_args(argv)
    front = Front(**{k: v for k, v in vars(args).items() if k != "out"})
    print(render(front, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
