#!/usr/bin/env bash
# `buf breaking`: the protocol in the working tree against its last release.
#
# The base is the newest release's commit as CHANGELOG.md records it (scripts/release_commit.py: the newest
# release section's `Release commit:` line), so it survives any clone; else the newest release tag reachable from
# HEAD (`git describe --tags --abbrev=0`). Before the first release there is neither; the base is then the commit
# that created proto/buf.yaml, the protocol as first published, so every change since v1 appeared must be one a
# client of v1 survives. (Not origin/main's merge-base: there may be no remote, and a change merged earlier would
# then never be compared with v1.) BUF_BREAKING_AGAINST=<git ref> overrides the base. Needs the git history back to
# the base (no shallow clone).
set -euo pipefail
cd "$(dirname "$0")/.."

base=${BUF_BREAKING_AGAINST:-$(python3 scripts/release_commit.py)}
if [ -z "$base" ]; then
    base=$(git describe --tags --abbrev=0 2>/dev/null || git log --diff-filter=A --format=%H -- proto/buf.yaml | tail -n 1)
fi
if [ -z "$base" ]; then
    echo "buf breaking: no release in CHANGELOG.md, no release tag and no commit that added proto/buf.yaml (a shallow clone?)" >&2
    exit 1
fi
against=$(mktemp -d)
trap 'rm -rf "$against"' EXIT
# The base's proto/ as files: works for any ref, whatever the clone depth buf would use for a git input.
git archive "$base" proto | tar -x -C "$against"
echo "buf breaking against $(git rev-parse --short "$base^{commit}") ($base)"
cd proto && buf breaking --against "$against/proto"
