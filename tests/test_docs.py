"""The user documentation names only flags and environment variables the code has (the other direction of
tests/test_release_notes.py, which checks that the release notes name everything the code has).

- Every `--flag` in a row of a flag table (README's `serve` table, docs/vllm.md's router table,
  docs/conformance.md's table) is a flag of that subcommand.
- Every `kv-rendezvous SUBCOMMAND ...` command line in README.md, docs/ and examples/ (in a code span or a code
  block) passes only flags that subcommand has.
- Every `KV_RENDEZVOUS_*` variable the docs name is read by the code or named by a flag's help.
- docs/engines.md's registration step names every `KvLayout` field an engine is to state; every `Message.field` it
  names is a field of that message, and every reason it gives a code (`CODE / REASON`, a row of a table) has it.
- docs/conformance.md's sample run has as many checks as the suite, and names checks it has.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import grpc
import pytest

from rendezvous.conformance import CHECKS
from rendezvous.protocol.errors import REASON_CODES
from rendezvous.v1 import index_pb2, rendezvous_pb2
from tests.test_release_notes import REPO, _cli_env_names, _code_env_names, subcommands

DOCS = sorted(
    [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").rglob("*.md")],
)
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w-])")
"""A whole long option: `--max-` (a prefix written for several flags) is not one."""
_COMMAND = re.compile(r"kv-rendezvous (" + "|".join(sorted(subcommands(), key=len, reverse=True)) + r")\b")


def _options(command: str) -> set[str]:
    return {option for action in subcommands()[command]._actions for option in action.option_strings}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _table_rows(path: Path, heading: str) -> list[tuple[int, str]]:
    """(line number, first cell) of each row of the first table after `heading` (a line of the file)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    rows: list[tuple[int, str]] = []
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if line.startswith("|"):
            rows.append((number, line.split("|")[1]))
        elif rows:
            break
    assert len(rows) > 2, f"{_rel(path)}: no table after {heading!r}"
    return rows[2:]  # past the header and the |---| line


FLAG_TABLES = [
    ("README.md", "## Configuration", "serve"),
    ("docs/vllm.md", "## The router (`connector/router.py`)", "router"),
    ("docs/conformance.md", "## Running it", "conformance"),
]


@pytest.mark.parametrize(("doc", "heading", "command"), FLAG_TABLES)
def test_every_flag_of_a_flag_table_is_the_subcommands(doc: str, heading: str, command: str) -> None:
    options = _options(command)
    unknown = [
        f"{doc}:{number}: {flag}"
        for number, cell in _table_rows(REPO / doc, heading)
        for flag in _FLAG.findall(cell)
        if flag not in options
    ]
    assert not unknown, f"flags `kv-rendezvous {command}` does not have: {unknown}"


def _command_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each code span and each code-block line of path."""
    found: list[tuple[int, str]] = []
    in_block = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block or line.startswith("    "):
            found.append((number, line.split(" #")[0]))  # a shell comment is prose
        else:
            found.extend((number, span) for span in re.findall(r"`([^`]+)`", line))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_command_line_passes_flags_its_subcommand_has(doc: Path) -> None:
    unknown = []
    for number, text in _command_lines(doc):
        commands = list(_COMMAND.finditer(text))
        for i, found in enumerate(commands):
            # A command's arguments run to the next command, a pipe or the end of the span.
            end = commands[i + 1].start() if i + 1 < len(commands) else len(text)
            arguments = re.split(r"[|;&]", text[found.end() : end])[0]
            options = _options(found.group(1))
            unknown += [f"{_rel(doc)}:{number}: {flag}" for flag in _FLAG.findall(arguments) if flag not in options]
    assert not unknown, f"flags their subcommand does not have: {unknown}"


def test_the_command_lines_are_found() -> None:
    """The scan above sees the commands it is meant to check (a change of format must not empty it)."""
    seen = {found.group(1) for doc in DOCS for _, text in _command_lines(doc) for found in _COMMAND.finditer(text)}
    assert {"serve", "status", "transfers", "router", "conformance"} <= seen


def test_every_named_environment_variable_exists() -> None:
    known = _code_env_names() | _cli_env_names()
    named = {
        f"{_rel(doc)}: {name}"
        for doc in DOCS
        for name in re.findall(r"KV_RENDEZVOUS_[A-Z0-9_]*[A-Z0-9]", doc.read_text(encoding="utf-8"))
        if name not in known
    }
    assert not named, f"variables no code reads: {sorted(named)}"


def test_a_flag_the_parser_lacks_is_caught() -> None:
    """The checks are not vacuous: a made-up flag is not an option of `serve`."""
    assert "--no-such-flag" not in _options("serve")
    assert isinstance(subcommands()["serve"], argparse.ArgumentParser)


def test_the_engine_guide_names_every_layout_field() -> None:
    """An engine without the SDK states the layout fields docs/engines.md lists: a field it leaves out is left 0,
    which can keep it from pairing (data_plane_version 0 is version 1)."""
    text = (REPO / "docs" / "engines.md").read_text(encoding="utf-8")
    bullet = text.split("   - `layout` (`KvLayout`)", 1)[1].split("\n   - ", 1)[0]
    named = set(re.findall(r"`(\w+)`", bullet))
    missing = [field.name for field in rendezvous_pb2.KvLayout.DESCRIPTOR.fields if field.name not in named]
    assert not missing, f"docs/engines.md, RegisterEngine's layout: fields not named: {missing}"


ENGINE_GUIDE = REPO / "docs" / "engines.md"


def test_the_engine_guide_names_fields_the_messages_have() -> None:
    """`TargetSpec.binding` and the like: an engine author fills in what the guide names."""
    messages = {**rendezvous_pb2.DESCRIPTOR.message_types_by_name, **index_pb2.DESCRIPTOR.message_types_by_name}
    named = re.findall(r"`([A-Z]\w+)\.(\w+)`", ENGINE_GUIDE.read_text(encoding="utf-8"))
    assert ("TargetSpec", "binding") in named
    unknown = [f"{m}.{f}" for m, f in named if m in messages and f not in messages[m].fields_by_name]
    assert not unknown, f"docs/engines.md names fields their messages do not have: {unknown}"


def _reasons_with_codes(text: str) -> list[tuple[str, str]]:
    """(reason, code) of each `CODE / REASON` in text and of each reason in a table row whose second cell is a code."""
    codes = set(grpc.StatusCode.__members__)
    pairs = [(reason, code) for code, reason in re.findall(r"\b([A-Z_]+) /\s+([A-Z_]+)\b", text) if code in codes]
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:3]] if line.startswith("| ") else []
        if len(cells) == 2 and cells[1] in codes:
            pairs += [(reason, cells[1]) for reason in re.findall(r"`([A-Z_]+)`", cells[0])]
    return pairs


def test_the_engine_guide_gives_each_reason_its_code() -> None:
    pairs = _reasons_with_codes(ENGINE_GUIDE.read_text(encoding="utf-8"))
    assert ("BINDING_REQUIRED", "PERMISSION_DENIED") in pairs and ("LEASE_EXPIRED", "FAILED_PRECONDITION") in pairs
    codes = {str(reason): code.name for reason, code in REASON_CODES.items()}
    wrong = sorted(
        f"{reason}: {code}, not {codes[reason]}" if reason in codes else f"{reason}: no such reason"
        for reason, code in set(pairs)
        if codes.get(reason) != code
    )
    assert not wrong, f"docs/engines.md: {wrong}"


def test_the_conformance_sample_run_matches_the_suite() -> None:
    text = (REPO / "docs" / "conformance.md").read_text(encoding="utf-8")
    sample = re.findall(r"```\n(kv-rendezvous conformance: .*?)```", text, re.DOTALL)[0]
    counts = re.findall(r"(\d+) checks against|(\d+) total", sample)
    assert counts and all(int(a or b) == len(CHECKS) for a, b in counts), f"{counts}: the suite has {len(CHECKS)}"
    named = set(re.findall(r"^(?:PASS|FAIL)  (\S+)", sample, re.MULTILINE))
    assert named and named <= {check.full_name for check in CHECKS}, named
