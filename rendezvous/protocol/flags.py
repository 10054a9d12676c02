"""Command-line flags shared by the commands above the protocol (the conformance suite, the router).

Plain argparse: an old name of a flag stays accepted, with a warning, until the release.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class DeprecatedFlag(argparse.Action):
    """An old name of a flag: warns on stderr, then does what the flag that replaces it (`instead`) does."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, instead: argparse.Action) -> None:
        super().__init__(option_strings, dest, metavar=instead.metavar, help=argparse.SUPPRESS)
        self.instead = instead

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is deprecated, use {self.instead.option_strings[0]}", file=sys.stderr)
        self.instead(parser, namespace, values, option_string)


def add_deprecated_name(parser: argparse.ArgumentParser, old: str, instead: argparse.Action) -> None:
    """Accept `old` as a hidden, deprecated name of the flag `instead` (the action `add_argument` returned)."""
    parser.add_argument(old, dest=instead.dest, action=DeprecatedFlag, instead=instead)
