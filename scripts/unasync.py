"""Generate the blocking client's unary calls (clients/_sync_calls.py) from the asyncio ones
(clients/_async_calls.py) by token replacement, as httpcore does: the RPC methods are written once.

python scripts/unasync.py                      # write clients/_sync_calls.py
python scripts/unasync.py --check              # exit 1 if it is stale
python scripts/unasync.py --check SOURCE DEST  # the same for other paths
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path("clients") / "_async_calls.py"
DEST = Path("clients") / "_sync_calls.py"

RULES: tuple[tuple[str, str], ...] = (
    (r"^import asyncio\n", ""),  # the sync form sleeps with `time`, which the source imports too
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"\bgrpc\.aio\.", "grpc."),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\bAsyncCalls\b", "SyncCalls"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\basync (def|for|with)\b", r"\1"),
    (r"\bawait ", ""),
    (r"\bfor (\w+) in ([^\n]+):\n\s+yield \1\n", r"yield from \2\n"),  # an async generator cannot `yield from`
)
"""(pattern, replacement) applied in order, each to the whole text (multi-line regular expressions)."""


def header(source: Path) -> str:
    """The comment the generated file starts with."""
    return (
        f"# Generated from {source.as_posix()} by scripts/unasync.py: do not edit.\n"
        "# Edit the source and run: python scripts/unasync.py\n"
    )


def unasync(text: str) -> str:
    """The blocking form of an asyncio module's text."""
    for pattern, replacement in RULES:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    return text


def generated(source: Path, display: Path) -> str:
    """The whole generated file for `source`, whose header names it `display`."""
    return header(display) + unasync(source.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the generated file is stale")
    parser.add_argument("source", nargs="?", type=Path, default=ROOT / SOURCE, help="the asyncio module")
    parser.add_argument("dest", nargs="?", type=Path, default=ROOT / DEST, help="the generated blocking module")
    args = parser.parse_args()
    source = args.source.resolve()
    text = generated(source, source.relative_to(ROOT) if source.is_relative_to(ROOT) else source)
    if not args.check:
        args.dest.write_text(text)
        return 0
    if not args.dest.exists() or args.dest.read_text() != text:
        paths = "" if (source, args.dest.resolve()) == (ROOT / SOURCE, ROOT / DEST) else f" {args.source} {args.dest}"
        print(f"stale generated file: {args.dest}; run: python scripts/unasync.py{paths}", file=sys.stderr)
        return 1
    print(f"{args.dest} is fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
