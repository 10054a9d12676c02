"""Argument types and the one-line parser every `kv-rendezvous` command uses (serve and the inspection commands in
rendezvous.cli, `router` in the connector, `demo` in the SDK): each flag has a typed range, and a value outside it
is one line naming the flag and the value, exit 2, never a traceback.

Only argparse and math: the service, the SDK and the connector all import it (imports flow one way: connector ->
clients -> protocol <- rendezvous).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import NoReturn

__all__ = ["Parser", "boolean", "choice", "count", "host_port", "seconds"]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: serve's usage alone is 80 lines, which buried the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def seconds(minimum: float = 0.0, *, positive: bool = False, what: str = "number of seconds") -> Callable[[str], float]:
    """A flag's type: a finite number (of seconds), at least `minimum` (above it when `positive`)."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (positive and value == minimum):
            bound = f"> {minimum:g}" if positive else f">= {minimum:g}"
            raise argparse.ArgumentTypeError(f"not a finite {what} {bound}: {text!r}")
        return value

    return seconds


def count(minimum: int = 0, maximum: int | None = None) -> Callable[[str], int]:
    """A flag's type: a whole number within minimum..maximum."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"within {minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"not {bound}: {text!r}")
        return value

    return count


def boolean(value: str | bool) -> bool:
    """A switch's variable: 1/true/yes/on or 0/false/no/off (any case; empty is off)."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("", "0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def choice(choices: Sequence[str], convert: Callable[[str], str] = str) -> Callable[[str], str]:
    """A variable's type for a flag with choices (argparse checks only the command line's)."""

    def choice(text: str) -> str:
        if (value := convert(text)) not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(choices)})")
        return value

    return choice


def host_port(text: str) -> tuple[str, int]:
    """A listen address's type: HOST:PORT (HOST may be empty, or a bracketed IPv6 address), port 0..65535."""
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65_535 or (host.startswith("[") != host.endswith("]")):
        raise argparse.ArgumentTypeError(f"not host:port with a port in 0..65535: {text!r}")
    return host.strip("[]"), int(port)
