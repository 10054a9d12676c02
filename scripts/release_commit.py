"""The newest release's commit, as CHANGELOG.md records it: prints it (nothing before the first release).

A release's section in CHANGELOG.md (a `## [X.Y.Z]` heading; `## [Unreleased]` is not one) names the commit the
release was cut from on a line `Release commit: <40 hex digits>` (a list item or in backticks is fine). The file
travels with every clone, so `make breaking` (scripts/buf_breaking.sh) and the mixed-version test
(tests/upgrade/) find the previous release without tags or a remote. The newest release is the first such section
in the file (Keep a Changelog puts the newest on top). A newest section without that line is an error, never a
silent fallback to an older release.

Usage: python3 scripts/release_commit.py [CHANGELOG]   (default: CHANGELOG.md at the repository root)
Exit status: 0 and the commit (or nothing: no release yet) on stdout; 1 and the reason on stderr.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"

_SECTION = re.compile(r"^## \[(?P<name>[^\]]+)\]", re.MULTILINE)
_COMMIT = re.compile(r"^\s*(?:[-*]\s+)?Release commit:\s*`?(?P<sha>[^`\s]*)`?\s*$", re.MULTILINE)
_SHA = re.compile(r"[0-9a-f]{40}")


class ChangelogError(ValueError):
    """CHANGELOG.md's newest release does not name its commit (or names it in a form that is not a full sha)."""


def release_commit(changelog: str) -> tuple[str, str] | None:
    """(version, commit) of the newest release section in changelog's text; None when there is no release yet."""
    sections = [m for m in _SECTION.finditer(changelog) if m.group("name").lower() != "unreleased"]
    if not sections:
        return None
    newest = sections[0]
    following = _SECTION.search(changelog, newest.end())
    body = changelog[newest.end() : following.start() if following else len(changelog)]
    version = newest.group("name")
    lines = list(_COMMIT.finditer(body))
    if len(lines) != 1:
        found = "no" if not lines else f"{len(lines)}"
        raise ChangelogError(f"the [{version}] section has {found} 'Release commit: <sha>' lines (needs exactly one)")
    sha = lines[0].group("sha")
    if not _SHA.fullmatch(sha):
        raise ChangelogError(f"the [{version}] section's release commit {sha!r} is not 40 lowercase hex digits")
    return version, sha


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else CHANGELOG
    try:
        found = release_commit(path.read_text(encoding="utf-8"))
    except (OSError, ChangelogError) as err:
        print(f"release_commit: {path}: {err}", file=sys.stderr)
        return 1
    if found is not None:
        print(found[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
