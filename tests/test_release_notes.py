"""docs/releases/0.1.0.md names every public interface the code has: each CLI flag under its subcommand, each
environment variable, metric, `kv_connector_extra_config` key, protocol name and public SDK name, read from the
code itself (argparse parsers, the metrics registries, ConnectorConfig, the proto descriptors, `__all__`). A rename
or an addition elsewhere fails here until the notes say it."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from prometheus_client import CollectorRegistry

from rendezvous.cli import build_parser
from rendezvous.clients.demo import add_demo_arguments
from rendezvous.clients.nixl.metrics import DataPlaneMetrics
from rendezvous.conformance.runner import add_arguments as add_conformance_arguments
from rendezvous.connector.admission import RouterMetrics
from rendezvous.connector.config import ConnectorConfig
from rendezvous.connector.router import build_parser as router_parser
from rendezvous.server.metrics import Metrics
from rendezvous.v1 import errors_pb2, rendezvous_pb2

REPO = Path(__file__).resolve().parent.parent
NOTES = (REPO / "docs" / "releases" / "0.1.0.md").read_text(encoding="utf-8")
PACKAGES = ("rendezvous", "clients", "connector")
SDK_MODULES = (
    "rendezvous.clients",
    "rendezvous.clients.nixl",
    "rendezvous.clients.testing",
    "rendezvous.connector",
    "rendezvous.protocol",
    "rendezvous.server",
)
_ENV_NAME = re.compile(r"KV_RENDEZVOUS_[A-Z0-9_]+")


def section(heading: str) -> str:
    """The notes from `heading` (a whole heading line) to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    found = re.search(rf"^{re.escape(heading)}$", NOTES, re.MULTILINE)
    assert found is not None, f"the release notes have no section {heading!r}"
    following = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(NOTES, found.end())
    return NOTES[found.end() : following.start() if following else len(NOTES)]


def missing(names: set[str], text: str) -> list[str]:
    """The names that `text` does not mention in backticks."""
    return sorted(n for n in names if f"`{n}`" not in text)


# The CLI


def _own_parser(add: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser


OWN_PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "conformance": lambda: _own_parser(add_conformance_arguments),
    "demo": lambda: _own_parser(add_demo_arguments),
    "router": router_parser,
}
"""Subcommands that parse their own flags when they run: the parser that does."""


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every `kv-rendezvous` subcommand (entry-point ones included) and the parser of its flags."""
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: OWN_PARSERS[name]() if name in OWN_PARSERS else parser for name, parser in sub.choices.items()}


def flags(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The documented flags of parser: not --help, not the hidden (deprecated) spellings."""
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            yield action


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_flag_of_each_subcommand_is_in_its_section(command: str) -> None:
    names = {action.option_strings[-1] for action in flags(subcommands()[command])}
    assert not missing(names, section(f"#### `kv-rendezvous {command}`"))


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_flag_of_each_subcommand_says_what_it_does(command: str) -> None:
    """`conformance --help` listed `--tls` with no word of help (nor its variable)."""
    assert not [a.option_strings[-1] for a in flags(subcommands()[command]) if not a.help]


def test_the_commands_own_parsers_are_subcommands() -> None:
    assert set(OWN_PARSERS) <= set(subcommands())


# Environment variables


def _code_env_names() -> set[str]:
    """KV_RENDEZVOUS_* names the packages' code spells out as string constants."""
    names = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if path.is_relative_to(REPO / "rendezvous" / "v1"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _ENV_NAME.fullmatch(node.value):
                    names.add(node.value)
    return names


def _cli_env_names() -> set[str]:
    """The variables the CLI's flags name in their help ("env KV_RENDEZVOUS_...")."""
    return {
        name
        for parser in subcommands().values()
        for action in flags(parser)
        for name in _ENV_NAME.findall(action.help or "")
    }


def test_the_environment_variables_are_found_in_the_code() -> None:
    assert {"KV_RENDEZVOUS_STORE", "KV_RENDEZVOUS_TRACING", "KV_RENDEZVOUS_ADDRESS"} <= (
        _code_env_names() | _cli_env_names()
    )


def test_every_environment_variable_is_named() -> None:
    assert not missing(_code_env_names() | _cli_env_names(), NOTES)


# Metrics


def _registries() -> dict[str, CollectorRegistry]:
    sdk = CollectorRegistry()
    DataPlaneMetrics(sdk)
    return {"server": Metrics().registry, "sdk": sdk, "router": RouterMetrics().registry}


@pytest.mark.parametrize("owner", ["server", "sdk", "router"])
def test_every_metric_is_in_the_metrics_section_by_its_exposed_name(owner: str) -> None:
    names = {f.name + ("_total" if f.type == "counter" else "") for f in _registries()[owner].collect()}
    assert names and not missing(names, section("## Metrics"))


# The connector's configuration


def test_every_kv_connector_extra_config_key_is_in_its_table() -> None:
    keys = {f"| `{f.name}` |" for f in dataclasses.fields(ConnectorConfig)}
    text = section("## The connector's `kv_connector_extra_config` keys")
    assert sorted(k for k in keys if k not in text) == []


# The protocol


def test_the_protocols_service_rpcs_messages_and_enums_are_named() -> None:
    files = (rendezvous_pb2.DESCRIPTOR, errors_pb2.DESCRIPTOR)
    names = {e for f in files for e in f.enum_types_by_name} | set(rendezvous_pb2.DESCRIPTOR.message_types_by_name)
    for service in rendezvous_pb2.DESCRIPTOR.services_by_name.values():
        names |= {service.name, *service.methods_by_name}
    text = section("## The protocol: package `rendezvous.v1`")
    # Each RPC's own request and response are named in its row of the RPC table.
    assert not missing(names, text)


# The SDK


def _public_names(module_name: str) -> set[str]:
    """A module's `__all__`, or else the public names it defines itself."""
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return set(exported)
    defined = {n: v for n, v in vars(module).items() if getattr(v, "__module__", None) == module_name}
    return {n for n, v in defined.items() if not n.startswith("_") and not isinstance(v, TypeVar)}


@pytest.mark.parametrize("module", SDK_MODULES)
def test_every_public_sdk_name_is_in_its_modules_section(module: str) -> None:
    names = _public_names(module)
    assert names and not missing(names, section(f"#### `{module}`"))
