"""Imports flow one way: connector -> clients -> protocol (rendezvous.v1, rendezvous.protocol) <- the service.

One import name holds them all: the SDK is `rendezvous.clients` (folder clients/), the vLLM connector
`rendezvous.connector` (folder connector/), the service the rest of `rendezvous`. Each check imports modules in a
fresh interpreter and looks at what got loaded, so a lazy import inside a function does not count but an import at
module level anywhere down the chain does. The `kv-rendezvous` subcommands that live in the SDK and the connector
reach the CLI as entry points, not as imports.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from rendezvous.cli import BUILTIN_COMMANDS, COMMANDS_GROUP, build_parser

REPO = Path(__file__).resolve().parents[1]
PROTOCOL = ("rendezvous.v1", "rendezvous.protocol")
"""What clients, connector and the conformance suite may load from the `rendezvous` distribution's service side."""
SDK = ("rendezvous.clients", "rendezvous.connector")
"""The SDK and the connector, the service's own clients."""
OLD = ("clients", "connector")
"""Their top-level names before 0.1.0, importable from a checkout's root (its folders): nothing may use them."""


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def loaded_by(*modules: str) -> set[str]:
    """The modules of this project that importing `modules` loads."""
    code = (
        "import importlib, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sys.modules))\n"
    )
    return {m for m in _run(code).split() if m.split(".")[0] in ("rendezvous", *OLD)}


def commands(parser: argparse.ArgumentParser) -> list[str]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def under(modules: set[str], *packages: str) -> set[str]:
    return {m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)}


def test_the_service_does_not_import_its_clients() -> None:
    modules = loaded_by(
        "rendezvous",
        "rendezvous.cli",
        "rendezvous.server",
        "rendezvous.coordinator",
        "rendezvous.store",
        "rendezvous.store.factory",
        "rendezvous.wire",
    )
    assert "rendezvous.server.servicer" in modules  # the imports did happen
    assert under(modules, *SDK, *OLD) == set()


def imports_in(folder: str) -> set[tuple[str, str]]:
    """(file, module) for every absolute import in the folder's sources, at any depth (lazy ones too). The symlinks
    rendezvous/clients and rendezvous/connector are not followed: those folders are read under their own names."""
    found = set()
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found |= {(path.relative_to(REPO).as_posix(), name) for name in names}
    return found


def test_no_source_imports_against_the_flow_even_lazily() -> None:
    service = {(f, m) for f, m in imports_in("rendezvous") if under({m}, *SDK, *OLD)}
    assert service == set()
    sdk = {
        (f, m)
        for folder in ("clients", "connector")
        for f, m in imports_in(folder)
        if under({m}, "rendezvous", *OLD) and under({m}, *PROTOCOL, *SDK) == set()
    }
    # The one exception: the SDK's test harness starts a real server, importing it when asked to.
    assert sdk == {("clients/testing.py", "rendezvous.server")}


def test_the_core_imports_neither_store_nor_server() -> None:
    modules = loaded_by(
        *(f"rendezvous.core.{p.stem}" for p in (REPO / "rendezvous" / "core").glob("*.py") if p.stem != "__init__")
    )
    assert "rendezvous.core.transfers" in modules
    assert under(modules, "rendezvous.server", "rendezvous.store", "rendezvous.coordinator", "rendezvous.cli") == set()
    assert under(modules, *SDK, *OLD) == set()


@pytest.mark.parametrize(
    ("modules", "allowed"),
    [
        (
            ("rendezvous.clients", "rendezvous.clients.testing", "rendezvous.clients.demo", "rendezvous.clients._cli"),
            ("rendezvous.clients",),
        ),
        pytest.param(
            ("rendezvous.clients.nixl",),
            ("rendezvous.clients",),
            marks=[pytest.mark.nixl, pytest.mark.skipif(not importlib.util.find_spec("nixl"), reason="needs nixl")],
        ),
        (
            (
                *("rendezvous.connector", "rendezvous.connector.router", "rendezvous.connector.launch"),
                *("rendezvous.connector._loop", "rendezvous.connector._cli"),
            ),
            SDK,
        ),
        (("rendezvous.conformance",), ("rendezvous.conformance",)),
    ],
)
def test_sdk_connector_and_conformance_load_only_the_protocol(
    modules: tuple[str, ...], allowed: tuple[str, ...]
) -> None:
    loaded = loaded_by(*modules)
    assert set(modules) <= loaded
    assert loaded - under(loaded, *PROTOCOL, *allowed) <= {"rendezvous"}  # the package itself is import-free


def test_subcommands_of_clients_and_connector_are_entry_points() -> None:
    registered = {ep.name: ep.value for ep in entry_points(group=COMMANDS_GROUP)}
    assert registered == {
        "demo": "rendezvous.clients._cli:add_demo_parser",
        "router": "rendezvous.connector._cli:add_router_parser",
    }, "the entry points are registered at install time: pip install -e . --no-deps"
    assert commands(build_parser()) == [
        *("serve", "demo", "router", "conformance"),
        *("health", "status", "engines", "transfers"),
    ]
    assert sorted(commands(build_parser(entry_point_commands=False))) == sorted(BUILTIN_COMMANDS)


def test_help_lists_every_subcommand() -> None:
    usage = _run("from rendezvous.cli import main; main(['--help'])")
    assert "{serve,demo,router,conformance,health,status,engines,transfers}" in usage
    assert "move real bytes over NIXL" in usage and "OpenAI-compatible proxy" in usage


def test_entry_point_commands_parse_their_own_flags() -> None:
    code = (
        "import contextlib\n"
        "from rendezvous.cli import main\n"
        "for command in ('demo', 'router'):\n"
        "    with contextlib.suppress(SystemExit):\n"
        "        main([command, '--help'])\n"
    )
    out = _run(code)
    assert "usage: kv-rendezvous demo" in out and "--transfers" in out
    assert "usage: kv-rendezvous router" in out and "--address" in out


def test_a_builtin_command_loads_no_client_code() -> None:
    code = (
        "import sys\n"
        "from rendezvous.cli import main\n"
        "assert main(['health', '--address', '127.0.0.1:1', '--timeout', '0.2']) == 1\n"
        "print('\\n'.join(sys.modules))\n"
    )
    modules = set(_run(code).split())
    assert "rendezvous.cli" in modules
    assert under(modules, *SDK, *OLD) == set()
