"""The `kv-rendezvous router` subcommand, found by the service's CLI through the entry point group
`kv_rendezvous.commands` (pyproject.toml), so that the service does not import the connector.

Only argparse here: the router and aiohttp are imported when the subcommand runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def add_router_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `router`; its flags are parsed by the router itself when it runs."""
    parser = subparsers.add_parser(
        "router", help="OpenAI-compatible proxy dispatching prefill and decode legs at once", add_help=False
    )
    parser.set_defaults(run=run_router_command)


def run_router_command(argv: Sequence[str]) -> int:
    """`kv-rendezvous router ARGV...`."""
    from rendezvous.connector.router import main

    return main(argv)
