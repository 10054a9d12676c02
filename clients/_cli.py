"""The `kv-rendezvous demo` subcommand, found by the service's CLI through the entry point group
`kv_rendezvous.commands` (pyproject.toml), so that the service does not import its clients.

Only argparse here: the demo and its dependencies are imported when the subcommand runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def add_demo_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `demo`; an engine-side program with heavier dependencies, whose flags are parsed only when it runs."""
    parser = subparsers.add_parser(
        "demo", help="move real bytes over NIXL between producer and consumer processes", add_help=False
    )
    parser.set_defaults(run=run_demo_command)


def run_demo_command(argv: Sequence[str]) -> int:
    """`kv-rendezvous demo ARGV...`."""
    from rendezvous.clients.demo import add_demo_arguments, demo_argument_error, run_demo
    from rendezvous.protocol.flags import Parser

    demo = Parser(prog="kv-rendezvous demo", description=run_demo.__doc__)
    add_demo_arguments(demo)
    args = demo.parse_args(argv)
    if (error := demo_argument_error(args)) is not None:
        demo.error(error)
    return run_demo(args)
