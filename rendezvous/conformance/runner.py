"""Runs the checks one after another against the targets and reports PASS/FAIL per check.

`kv-rendezvous conformance --address HOST:PORT` exits 0 when every selected check passed, 1 when one
failed, 2 on a usage error. `--json PATH` also writes the results as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TextIO

from rendezvous.conformance import errors, failures, lifecycle
from rendezvous.conformance.driver import Driver, Failed, Options, Scenario
from rendezvous.conformance.registry import CHECKS, Check

CHECK_MODULES = (lifecycle, failures, errors)
"""Importing them registers the checks."""

ENV_PREFIX = "KV_RENDEZVOUS_"
DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check."""

    name: str
    group: str
    summary: str
    passed: bool
    reason: str
    seconds: float


def select(only: Sequence[str]) -> list[Check]:
    """The checks whose `group.name` contains one of the substrings (all when none is given)."""
    return [c for c in CHECKS if not only or any(part in c.full_name for part in only)]


def _one_line(text: str) -> str:
    return " ".join(text.split())


async def run_check(driver: Driver, check: Check) -> CheckResult:
    """Run one check in a scenario of its own; its engines are deregistered whatever happens."""
    options = driver.options
    scenario = Scenario(driver)
    started = time.monotonic()
    reason = ""
    try:
        async with asyncio.timeout(options.check_timeout):
            await check.fn(scenario)
    except Failed as err:
        reason = str(err) or "failed"
    except TimeoutError:
        reason = f"did not finish within {options.check_timeout:g} s"
    except Exception as err:
        reason = f"{type(err).__name__}: {err}"
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(options.rpc_timeout * (1 + len(scenario.engines))):
                await scenario.close()
    seconds = time.monotonic() - started
    return CheckResult(check.full_name, check.group, check.summary, not reason, _one_line(reason), seconds)


async def run_suite(
    options: Options, checks: Sequence[Check] | None = None, on_result: Callable[[CheckResult], None] | None = None
) -> list[CheckResult]:
    """Run checks (default: all) one after another; on_result is told of each as it finishes."""
    driver = Driver(options)
    results: list[CheckResult] = []
    try:
        for c in CHECKS if checks is None else checks:
            result = await run_check(driver, c)
            results.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        await driver.close()
    return results


def format_result(result: CheckResult) -> str:
    """PASS/FAIL, the name, the time and, for a failure, the reason; one line."""
    line = f"{'PASS' if result.passed else 'FAIL'}  {result.name}  ({result.seconds:.2f} s)"
    return line if result.passed else f"{line}  {result.reason}"


def write_json(path: str, options: Options, results: Sequence[CheckResult], seconds: float) -> None:
    """The results as one JSON document."""
    passed = sum(r.passed for r in results)
    document = {
        "targets": list(options.targets),
        "passed": passed,
        "failed": len(results) - passed,
        "total": len(results),
        "seconds": round(seconds, 3),
        "checks": [dict(asdict(r), result="PASS" if r.passed else "FAIL") for r in results],
    }
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


class _DeprecatedAddressFlag(argparse.Action):
    """`--target`, this command's name for `--address` before every command said `--address`: still accepted
    (appended like `--address`), with a warning, until the release."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        print(f"kv-rendezvous conformance: {option_string} is deprecated, use --address", file=sys.stderr)
        setattr(namespace, self.dest, [*getattr(namespace, self.dest, []), values])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The conformance flags."""
    parser.add_argument(
        "--address",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="server address; repeat for replicas of one deployment: consumers and producers of a transfer "
        f"then talk to different ones (default: env {ENV_PREFIX}ADDRESS, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument("--target", dest="address", action=_DeprecatedAddressFlag, help=argparse.SUPPRESS)
    parser.add_argument(
        "--only", action="append", default=[], metavar="TEXT", help="run the checks whose name contains TEXT"
    )
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH as JSON")
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=2.0,
        help="lease (seconds) requested by the engines the lease-loss checks let lapse (default 2)",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=5.0,
        help="seconds a lease or deadline check waits beyond the lease or timeout, for the server's sweeper",
    )
    parser.add_argument("--event-timeout", type=float, default=5.0, help="seconds to wait for an immediate event")
    parser.add_argument("--rpc-timeout", type=float, default=5.0, help="deadline of each call, seconds")
    parser.add_argument("--check-timeout", type=float, default=60.0, help="bound on one check, seconds")
    parser.add_argument(
        "--tls",
        action="store_true",
        default=_env("tls", "") in ("1", "true", "yes", "on"),
        help=f"connect with TLS (env {ENV_PREFIX}TLS)",
    )
    for flag, text in (
        ("ca", "CA bundle that signs the server certificate (implies --tls)"),
        ("client-cert", "client certificate for mTLS"),
        ("client-key", "its private key"),
        ("token", "bearer token of an identity with the admin role (better: the environment variable)"),
    ):
        env = ENV_PREFIX + flag.upper().replace("-", "_")
        parser.add_argument(f"--{flag}", default=_env(flag), help=f"{text} (env {env})")


def options_from(args: argparse.Namespace) -> Options:
    """Options from parsed flags."""
    targets = tuple(args.address) or (_env("address", DEFAULT_ADDRESS) or DEFAULT_ADDRESS,)
    return Options(
        targets=targets,
        lease_ttl=args.lease_ttl,
        margin=args.margin,
        event_timeout=args.event_timeout,
        rpc_timeout=args.rpc_timeout,
        check_timeout=args.check_timeout,
        token=args.token,
        tls=args.tls,
        ca=args.ca,
        client_cert=args.client_cert,
        client_key=args.client_key,
    )


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of `kv-rendezvous conformance`."""
    stream = out or sys.stdout
    parser = argparse.ArgumentParser(
        prog="kv-rendezvous conformance",
        description="Drive a running rendezvous through the documented lifecycle and report each check.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.list:
        for c in select(args.only):
            print(f"{c.full_name}  {c.summary}", file=stream)
        return 0
    if bool(args.client_cert) != bool(args.client_key):
        parser.error("--client-cert and --client-key go together")
    checks = select(args.only)
    if not checks:
        print(f"kv-rendezvous conformance: no check matches {args.only}", file=sys.stderr)
        return 2
    options = options_from(args)
    plural = "s" * (len(checks) != 1)
    print(f"kv-rendezvous conformance: {len(checks)} check{plural} against {', '.join(options.targets)}", file=stream)
    started = time.monotonic()
    results = asyncio.run(run_suite(options, checks, lambda r: print(format_result(r), file=stream, flush=True)))
    seconds = time.monotonic() - started
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed, {len(results)} total in {seconds:.1f} s", file=stream)
    if args.json:
        write_json(args.json, options, results, seconds)
    return 1 if failed else 0
