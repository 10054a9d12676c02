"""`kv-rendezvous`: run the service (`serve`) and inspect a running one (`status`, `engines`, `transfers`).

Every `serve` flag also reads an environment variable: --store is KV_RENDEZVOUS_STORE, and so on.
"""

# The service does not import its clients: subcommands that live in `rendezvous.clients` or `rendezvous.connector`
# (`demo`, `router`) are entry points in the group `kv_rendezvous.commands` (pyproject.toml), loaded only when the
# command line may name one of them.

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, cast

import grpc

from rendezvous import __version__
from rendezvous.core.limits import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_RECEIVE_WINDOW_BYTES, Limits, Timeouts
from rendezvous.logs import configure_logging
from rendezvous.protocol.flags import Parser as _Parser
from rendezvous.protocol.flags import boolean as _bool
from rendezvous.protocol.flags import choice as _choice
from rendezvous.protocol.flags import count as _count
from rendezvous.protocol.flags import seconds as _seconds

if TYPE_CHECKING:
    from rendezvous.v1 import rendezvous_pb2 as pb

ENV_PREFIX = "KV_RENDEZVOUS_"
DEFAULT_ADDRESS = "127.0.0.1:50051"
COMMANDS_GROUP = "kv_rendezvous.commands"
"""Entry points of subcommands other packages provide. Each names a hook `add_parser(subparsers)` that adds one
subcommand (usually with `add_help=False`) and sets its default `run`: `run(argv) -> exit status`, given the
arguments that follow the command."""
BUILTIN_COMMANDS = ("serve", "conformance", "health", "status", "engines", "transfers")


def _env(name: str, default: Any) -> Any:
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


@dataclasses.dataclass(frozen=True)
class _BadEnv:
    """The default of a flag whose environment variable holds a value the flag's type refuses. The parser is
    built for every command, so the variable is reported (exit 2) only when the command that has the flag runs."""

    variable: str
    value: str
    error: str


def _env_default(name: str, default: Any, type: Callable[[str], Any]) -> Any:
    """The flag's default: its environment variable's value converted by `type`, else `default`."""
    variable = ENV_PREFIX + name.upper().replace("-", "_")
    value = os.environ.get(variable)
    if value is None:
        return default
    try:
        return type(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
        return _BadEnv(variable, value, str(err))


def _check_env(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first environment variable of the parsed command whose value is invalid."""
    for dest, value in vars(args).items():
        if isinstance(value, _BadEnv):
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{value.variable}={value.value!r} (the default of {flag}): {value.error}")


def _flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    default: Any,
    help: str,
    type: Callable[[str], Any] = str,
) -> None:
    env = ENV_PREFIX + name.upper().replace("-", "_")
    parser.add_argument(
        f"--{name}",
        default=_env_default(name, None if default is None else type(default), type),
        type=type,
        help=f"{help} (env {env}; default {default})",
    )


INT32_MAX = 2**31 - 1
"""The largest value gRPC takes for a channel argument (message sizes, windows)."""


LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _switch(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, help: str) -> None:
    """A boolean flag, off by default: `--NAME` turns it on, `--NAME=off` off, and so does its variable."""
    env = ENV_PREFIX + name.upper().replace("-", "_")
    parser.add_argument(
        f"--{name}",
        nargs="?",
        const=True,
        default=_env_default(name, False, _bool),
        type=_bool,
        help=f"{help} (env {env}; default False)",
    )


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the rendezvous service")
    _flag(p, "listen", DEFAULT_ADDRESS, "gRPC listen address host:port")
    _flag(p, "store", "memory", "store: 'memory' or redis://, rediss://, unix://, redis+sentinel:// URL")
    _flag(p, "metrics-listen", "127.0.0.1:9464", "Prometheus /metrics address host:port; 'off' disables")
    _flag(
        p,
        "health-listen",
        "off",
        "plaintext grpc.health.v1-only address host:port, answered off the serving loop: point probes here; "
        "'off' disables",
    )
    _flag(
        p,
        "drain",
        2.0,
        "seconds of NOT_SERVING on SIGTERM before refusing new calls; a second SIGTERM ends it",
        _seconds(),
    )
    _flag(p, "grace", 5.0, "seconds running calls then get to finish", _seconds())
    _flag(p, "sweep-interval", 0.05, "seconds between lease/deadline sweeps; > 0", _seconds(positive=True))
    _flag(
        p,
        "idempotency-ttl",
        600.0,
        "seconds the answer to a request with a request_id is kept for its retries (AIP-155); > 0",
        float,
    )
    _switch(
        p, "tracing", "export OpenTelemetry traces (OTEL_EXPORTER_OTLP_ENDPOINT; the tracing extra; docs/operations.md)"
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=_env_default("log-format", "text", _choice(LOG_FORMATS)),
        help=f"log format (env {ENV_PREFIX}LOG_FORMAT; default text)",
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.lower,
        default=_env_default("log-level", "info", _choice(LOG_LEVELS, str.lower)),
        help=f"log level (env {ENV_PREFIX}LOG_LEVEL; default info)",
    )
    g = p.add_argument_group("security (docs/security.md)")
    _flag(g, "tls-cert", None, "serve TLS with this certificate chain (file path or PEM; re-read when it changes)")
    _flag(g, "tls-key", None, "the certificate's private key (file path or PEM)")
    _flag(g, "tls-client-ca", None, "CA bundle that signs client certificates, for mTLS (file path or PEM)")
    _switch(g, "tls-require-client-cert", "mTLS: refuse clients without a certificate from --tls-client-ca")
    _flag(
        g,
        "auth-file",
        None,
        "JSON file binding tokens and certificate names to identities (re-read when it changes, and on SIGHUP); "
        "unset: no auth",
    )
    _flag(g, "min-token-bytes", 16, "refuse to start if the auth file names a shorter token in the clear", _count(1))
    _switch(
        g,
        "strict-identities",
        "refuse an auth file whose engine identities lack engine_roles (or engine_pools); default: log a warning",
    )
    _flag(
        g,
        "binding-key-file",
        None,
        "keys (one a line, >= 32 bytes) routers sign transfer bindings with; set, a transfer half without the "
        "router's binding is refused; unset: bindings are not checked",
    )
    _switch(g, "allow-unbound", "with --binding-key-file, admit a transfer half without a binding (rollout step)")
    _flag(
        g,
        "max-message-bytes",
        DEFAULT_MAX_MESSAGE_BYTES,
        "largest request (and response) message; a larger request is refused unread with RESOURCE_EXHAUSTED; "
        f"1..{INT32_MAX}",
        _count(1, INT32_MAX),
    )
    _flag(
        g,
        "receive-window-bytes",
        DEFAULT_RECEIVE_WINDOW_BYTES,
        "each call's HTTP/2 receive window: what a call refused before its request is read may still send "
        f"(0: gRPC's own, grown by bandwidth-delay probing); at most {INT32_MAX}",
        _count(0, INT32_MAX),
    )
    # The defaults of CallLimits (rendezvous.server.quotas; tests/security/test_defaults.py keeps them equal).
    _flag(
        g,
        "rate-limit",
        None,
        "calls per second per caller (identity, else peer host), KeepAlive messages included; 0: unlimited; "
        "unset: 10000 with --auth-file, unlimited without",
        _seconds(what="rate"),
    )
    _flag(g, "rate-burst", 0, "burst of calls above --rate-limit; 0: one second's worth", _count())
    _flag(g, "rate-cost-bytes", 65_536, "a call costs one more per started N bytes of request; 0: one each", _count())
    _flag(g, "max-concurrent-calls", 0, "unary calls in flight per caller (they wait on Redis); 0: unlimited", _count())
    _flag(g, "max-streams", 1_024, "open Watch and KeepAlive streams per caller; 0: unlimited", _count())
    _flag(g, "refusal-rate", 5.0, "unauthenticated calls per second per peer host; 0: unlimited", _seconds(what="rate"))
    _flag(g, "refusal-burst", 50, "burst of unauthenticated calls above --refusal-rate", _count())
    _flag(
        g,
        "max-calls-in-progress",
        32,
        "unary calls served at once; the next turn goes round robin by caller",
        _count(1),
    )
    _flag(
        g, "max-waiting-calls", 256, "unary calls per caller waiting for a turn; beyond: refused, retry hint", _count()
    )
    _flag(
        g,
        "max-waiting-bytes",
        16 << 20,
        "bytes of a caller's requests waiting for a turn (its first waiting call always may); beyond: refused, "
        "retry hint; 0: no bound",
        _count(),
    )
    _flag(
        g,
        "invalid-backoff-bytes",
        65_536,
        "after a caller's request of at least N bytes is refused as invalid, its requests as large are refused "
        "unread for 10x what that one cost (doubling while it repeats, <= 10 s); 0: off",
        _count(),
    )
    _flag(
        g,
        "invalid-backoff-hold",
        1.0,
        "seconds a call of a caller backing off from its method is held unread before it is refused (or served, "
        "if the back-off ended meanwhile); 0: refused at once",
        _seconds(),
    )
    limits = (
        "Per request: a message over --max-message-bytes is refused unread (RESOURCE_EXHAUSTED); a batch's items "
        "(--max-batch-items, BATCH_TOO_LARGE) and a CompleteTransfers's parts (--max-parts-per-request, "
        "TOO_MANY_PARTS) are counted before anything is converted; the rest apply per item or field. Each RPC's "
        "limits: docs/security.md, 'Limits against abuse'."
    )
    for group, cls, description in (("timeouts (seconds)", Timeouts, None), ("limits", Limits, limits)):
        g = p.add_argument_group(group, description)
        for f in dataclasses.fields(cls):
            kind: Callable[[str], Any] = _seconds(positive=True) if cls is Timeouts else _count(1)
            name = f.name.replace("_", "-")
            env = ENV_PREFIX + f.name.upper()
            g.add_argument(
                f"--{name}",
                type=kind,
                default=_env_default(f.name, f.default, kind),
                help=f"(env {env}; default {f.default}; {'> 0' if cls is Timeouts else '>= 1'})",
            )


def _config_from(args: argparse.Namespace) -> Any:
    from rendezvous.server import CallLimits, ServerConfig, TLSConfig

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    if bool(args.tls_client_ca) != bool(args.tls_require_client_cert):
        raise ValueError("--tls-client-ca and --tls-require-client-cert go together (mTLS)")
    if args.allow_unbound and not args.binding_key_file:
        raise ValueError("--allow-unbound needs --binding-key-file (without keys no binding is required)")
    if not math.isfinite(args.idempotency_ttl) or args.idempotency_ttl <= 0:
        raise ValueError(f"--idempotency-ttl must be a positive number of seconds, not {args.idempotency_ttl:g}")
    if not args.min_lease_ttl <= args.default_lease_ttl <= args.max_lease_ttl:
        raise ValueError(
            f"--min-lease-ttl ({args.min_lease_ttl:g}) <= --default-lease-ttl ({args.default_lease_ttl:g}) "
            f"<= --max-lease-ttl ({args.max_lease_ttl:g}) does not hold"
        )
    for flag in ("default_target_timeout", "default_claim_timeout", "default_credit_ttl"):
        if getattr(args, flag) > args.max_timeout:
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} ({getattr(args, flag):g}) is longer than --max-timeout ({args.max_timeout:g})")
    tls = (
        TLSConfig(args.tls_cert, args.tls_key, args.tls_client_ca or None, args.tls_require_client_cert)
        if args.tls_cert
        else None
    )

    def build(cls: type) -> Any:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    return ServerConfig(
        listen=args.listen,
        store=args.store,
        metrics_listen=None if args.metrics_listen in ("", "off") else args.metrics_listen,
        limits=build(Limits),
        timeouts=build(Timeouts),
        sweep_interval=args.sweep_interval,
        idempotency_ttl=args.idempotency_ttl,
        grace=args.grace,
        drain=args.drain,
        health_listen=None if args.health_listen in ("", "off") else args.health_listen,
        max_message_bytes=args.max_message_bytes,
        receive_window_bytes=args.receive_window_bytes,
        tls=tls,
        auth_file=args.auth_file or None,
        min_token_bytes=args.min_token_bytes,
        strict_identities=args.strict_identities,
        binding_key_file=args.binding_key_file or None,
        allow_unbound=args.allow_unbound,
        call_limits=CallLimits(
            args.rate_limit,
            args.rate_burst,
            args.max_concurrent_calls,
            args.rate_cost_bytes,
            args.max_streams,
            args.refusal_rate,
            args.refusal_burst,
            args.max_calls_in_progress,
            args.max_waiting_calls,
            args.invalid_backoff_bytes,
            args.max_waiting_bytes,
            args.invalid_backoff_hold,
        ),
    )


async def _serve(args: argparse.Namespace) -> int:
    from rendezvous.protocol import tracing
    from rendezvous.server import RendezvousServer

    if args.tracing:
        tracing.configure("kv-rendezvous")
    server = RendezvousServer(_config_from(args))
    await server.start()
    stop = asyncio.Event()

    def on_signal() -> None:  # the first one drains; a second ends the drain at once
        if stop.is_set():
            server.end_drain()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    if server.auth is not None:
        loop.add_signal_handler(signal.SIGHUP, server.auth.reload)
    # The banner last: whoever waits for it may signal at once.
    print(
        f"kv-rendezvous {__version__} serving on {server.address} (store {server.store.name}"
        + (f", metrics on :{server.metrics_port}" if server.metrics_port else "")
        + ")",
        flush=True,
    )
    await stop.wait()
    await server.stop()
    return 0


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def _label(enum: Any, value: int) -> str:
    """A wire enum value as the CLI prints it: TRANSFER_STATE_MATCHED -> matched."""
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.DESCRIPTOR.name).upper() + "_"
    return str(enum.Name(value)).removeprefix(prefix).lower()


def _credits(e: Any) -> tuple[str, str]:
    """An engine's capacity and free credits as `engines` prints them: "8 transfers / 4096 blocks", "-" when
    none is declared; free = capacity - in use - reserved (reserved shown when any)."""
    cap, used = e.capacity, e.credits
    if not cap.max_transfers and not cap.max_blocks:
        return "-", "-"
    parts, free = [], []
    for limit, in_use, reserved, unit in (
        (cap.max_transfers, used.transfers_in_use, used.transfers_reserved, "transfers"),
        (cap.max_blocks, used.blocks_in_use, used.blocks_reserved, "blocks"),
    ):
        if limit:
            parts.append(f"{limit} {unit}")
            held = f" ({reserved} reserved)" if reserved else ""
            free.append(f"{max(limit - in_use - reserved, 0)} {unit}{held}")
    return " / ".join(parts), " / ".join(free)


def _ago(ts: Any) -> str:
    if not ts.seconds and not ts.nanos:
        return "-"
    return f"{time.time() - ts.ToNanoseconds() / 1e9:.1f}s ago"


class _UsageError(ValueError):
    """A flag's file that cannot be read, or flags that contradict each other: exit 2."""


def _pem(flag: str, value: str | None) -> bytes | None:
    """PEM bytes from PEM text or from the file a path names; ValueError naming the flag if it cannot be read."""
    if value is not None and "-----BEGIN" not in value:
        try:
            with open(value, "rb") as f:
                return f.read()
        except OSError as err:
            raise _UsageError(f"--{flag} {value}: {err.strerror or err}") from None
    return None if value is None else value.encode()


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials:
    if (args.client_cert is None) != (args.client_key is None):
        raise _UsageError("--client-cert and --client-key go together (mTLS)")
    return grpc.ssl_channel_credentials(
        _pem("ca", args.ca), _pem("client-key", args.client_key), _pem("client-cert", args.client_cert)
    )


def _inspect(args: argparse.Namespace) -> int:
    from rendezvous.v1 import rendezvous_pb2 as pb
    from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

    secure = args.tls or args.ca or args.client_cert
    channel = grpc.secure_channel(args.address, _credentials(args)) if secure else grpc.insecure_channel(args.address)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    with channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        if args.command == "health":
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            check = health_pb2_grpc.HealthStub(channel).Check
            status = check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout).status
            print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
            return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1
        if args.command == "status":
            s = stub.GetStatus(pb.GetStatusRequest(), timeout=args.timeout, metadata=metadata)
            rows = [
                ("address", args.address),
                ("version", s.version),
                ("store", s.store),
                ("epoch", s.header.epoch),
                ("revision", s.header.revision),
                ("server", s.header.server_id),
                ("up since", _ago(s.start_time)),
                ("live engines", s.live_engines),
                ("watchers", s.watchers),
                ("live transfers", sum(s.transfers_by_state.values())),
                *((f"  {k.lower()}", v) for k, v in sorted(s.transfers_by_state.items())),
            ]
            print(_table(("field", "value"), rows))
        elif args.command == "engines":
            engines = []
            request = pb.ListEnginesRequest(pool=args.pool, view=pb.ENGINE_VIEW_BASIC)
            while True:  # every page (a page is bounded in count and bytes; --timeout applies to each)
                page = stub.ListEngines(request, timeout=args.timeout, metadata=metadata)
                engines += page.engines
                request.page_token = page.next_page_token
                if not request.page_token:
                    break
            print(
                _table(
                    (
                        "engine",
                        "pool",
                        "role",
                        "incarnation",
                        "agents",
                        "live transfers",
                        "capacity",
                        "free credits",
                        "registered",
                    ),
                    [
                        (
                            e.engine_id,
                            e.pool,
                            _label(pb.EngineRole, e.role),
                            e.incarnation,
                            len(e.agents),
                            e.live_transfers,
                            *_credits(e),
                            _ago(e.register_time),
                        )
                        for e in engines
                    ],
                )
            )
        elif args.timeline:
            response = stub.GetTransfer(
                pb.GetTransferRequest(transfer_id=args.timeline), timeout=args.timeout, metadata=metadata
            )
            print(_timeline(response.transfer))
        else:
            wire_states: Any = [pb.TransferState.Value("TRANSFER_STATE_" + s.upper()) for s in args.state]
            transfers = stub.ListTransfers(
                pb.ListTransfersRequest(engine_id=args.engine, states=wire_states, page_size=args.limit),
                timeout=args.timeout,
                metadata=metadata,
            ).transfers
            print(
                _table(
                    ("transfer", "state", "gen", "consumer", "producer", "blocks", "abort reason"),
                    [
                        (
                            t.transfer_id,
                            _label(pb.TransferState, t.state),
                            t.generation,
                            t.consumer_engine_id or "-",
                            t.producer_engine_id or "-",
                            len(t.target_block_ids),
                            _label(pb.AbortReason, t.abort_reason) if t.abort_reason else "-",
                        )
                        for t in transfers
                    ],
                )
            )
    return 0


def _timeline(t: pb.Transfer) -> str:
    """One transfer (a rendezvous.v1 Transfer): its fields, its moments as offsets from the first, its phases."""
    from rendezvous.core import phases
    from rendezvous.protocol import convert
    from rendezvous.v1 import rendezvous_pb2 as pb

    state = _label(pb.TransferState, t.state)
    reason = _label(pb.AbortReason, t.abort_reason)
    fields = [
        ("transfer", t.transfer_id),
        ("state", state),
        ("mode", _label(pb.TransferMode, t.mode)),
        ("generation", t.generation),
        ("consumer", f"{t.consumer_engine_id} (incarnation {t.consumer_incarnation})" if t.consumer_engine_id else "-"),
        ("producer", f"{t.producer_engine_id} (incarnation {t.producer_incarnation})" if t.producer_engine_id else "-"),
        ("blocks", f"{len(t.target_block_ids)} target, {len(t.source_block_ids)} source"),
        ("abort reason", f"{reason}{': ' if t.abort_message else ''}{t.abort_message}" if t.abort_reason else "-"),
    ]
    times = convert.times(t.times)
    reached = {f.name.removesuffix("_time"): getattr(times, f.name) for f in dataclasses.fields(times)}
    reached = {name: at for name, at in reached.items() if at}
    first = min(reached.values(), default=0.0)
    moments = [(name, f"{(at - first) * 1e3:.3f}") for name, at in sorted(reached.items(), key=lambda kv: kv[1])]
    durations = phases.durations(times, released=state == "released")
    return "\n\n".join(
        (
            _table(("field", "value"), fields),
            _table(("moment", "at (ms)"), moments),
            _table(("phase", "ms"), [(p, f"{d * 1e3:.3f}") for p, d in durations.items()]),
        )
    )


def _add_entry_point_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for command in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        command.load()(sub)


def build_parser(*, entry_point_commands: bool = True) -> argparse.ArgumentParser:
    """The kv-rendezvous argument parser; with `entry_point_commands`, also the subcommands of other packages."""
    parser = _Parser(prog="kv-rendezvous", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True, parser_class=_Parser),
    )
    _add_serve(sub)
    if entry_point_commands:
        _add_entry_point_commands(sub)
    # Like the entry-point commands, the conformance suite parses its own flags when it runs.
    sub.add_parser("conformance", help="check a running service against the protocol", add_help=False)
    for name, text in (
        ("health", "exit 0 when the server's grpc.health.v1 check answers SERVING (container health checks)"),
        ("status", "summarise a running server"),
        ("engines", "list live engines"),
        ("transfers", "list transfers"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "--address",
            default=_env("address", DEFAULT_ADDRESS),
            help=f"server address (env {ENV_PREFIX}ADDRESS; default {DEFAULT_ADDRESS})",
        )
        p.add_argument(
            "--timeout",
            type=_seconds(positive=True),
            default=5.0,
            help="seconds to wait for the server; > 0 (default 5)",
        )
        p.add_argument(
            "--tls",
            action="store_true",
            default=_env_default("tls", False, _bool),
            help=f"connect with TLS (env {ENV_PREFIX}TLS)",
        )
        for flag, text in (
            ("ca", "CA bundle that signs the server certificate (implies --tls)"),
            ("client-cert", "client certificate for mTLS"),
            ("client-key", "its private key"),
            ("token", "bearer token (better: the environment variable)"),
        ):
            env = ENV_PREFIX + flag.upper().replace("-", "_")
            p.add_argument(f"--{flag}", default=_env(flag, None), help=f"{text} (env {env})")
        if name == "health":
            p.add_argument("--service", default="", help="the service to check (default: the whole server)")
        if name == "engines":
            p.add_argument("--pool", default="", help="only this pool")
        if name == "transfers":
            p.add_argument("--engine", default="", help="only transfers of this engine")
            p.add_argument(
                "--state",
                action="append",
                default=[],
                choices=["targeted", "claimed", "matched", "committed", "released", "aborted"],
                help="only these states (repeatable; default: live states)",
            )
            p.add_argument("--limit", type=_count(1), default=100, help="at most this many rows; >= 1")
            p.add_argument(
                "--timeline",
                metavar="ID",
                default="",
                help="instead of the list: one transfer's moments (ms from the first), phase durations and outcome",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the kv-rendezvous command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # A built-in command needs no other package: `serve` and the probes import no client code.
    parser = build_parser(entry_point_commands=not argv or argv[0] not in BUILTIN_COMMANDS)
    args, rest = parser.parse_known_args(argv)
    run: Callable[[list[str]], int] | None = getattr(args, "run", None)
    if run is not None:
        return run(rest)
    if args.command == "conformance":
        from rendezvous.conformance import main as conformance_main

        return conformance_main(rest)
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        _check_env(args)
    except ValueError as err:
        print(f"kv-rendezvous {args.command}: error: {err}", file=sys.stderr)
        return 2
    if args.command == "serve":
        configure_logging(args.log_level, args.log_format)
        from rendezvous.server.app import ListenError
        from rendezvous.server.settings import SettingError
        from rendezvous.store.base import StoreUnavailableError

        try:
            return asyncio.run(_serve(args))
        except ListenError as err:
            print(f"kv-rendezvous: --{err.setting.replace('_', '-')} {err.address}: {err.reason}", file=sys.stderr)
            return 2
        except SettingError as err:
            print(f"kv-rendezvous: --{err.setting.replace('_', '-')} {err.value}: {err.reason}", file=sys.stderr)
            return 2
        except (ValueError, OSError, StoreUnavailableError) as err:
            print(f"kv-rendezvous: {err}", file=sys.stderr)
            return 2
    try:
        return _inspect(args)
    except _UsageError as err:
        print(f"kv-rendezvous {args.command}: error: {err}", file=sys.stderr)
        return 2
    except grpc.RpcError as err:
        print(f"kv-rendezvous: {args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (`... | head`): no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # a shell's status for a command a SIGPIPE ended


if __name__ == "__main__":
    sys.exit(main())
