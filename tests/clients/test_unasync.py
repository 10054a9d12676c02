"""The sync client's unary calls are generated from the asyncio ones (scripts/unasync.py): fresh, checked,
and the same public API on both clients."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path

from rendezvous.clients import AsyncRendezvousClient, RendezvousClient

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "scripts" / "unasync.py"
SOURCE = REPO / "clients" / "_async_calls.py"


def unasync(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run the generator with `args`."""
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_the_committed_sync_calls_are_fresh() -> None:
    done = unasync("--check")
    assert done.returncode == 0, done.stderr
    assert "is fresh" in done.stdout


def test_an_edited_generated_file_is_reported_stale(tmp_path: Path) -> None:
    source, dest = tmp_path / "calls.py", tmp_path / "sync_calls.py"
    shutil.copy(SOURCE, source)
    assert unasync(source, dest).returncode == 0
    assert unasync("--check", source, dest).returncode == 0
    dest.write_text(dest.read_text().replace("time.sleep(delay)", "time.sleep(2 * delay)"))
    done = unasync("--check", source, dest)
    assert done.returncode == 1
    assert f"stale generated file: {dest}" in done.stderr


def test_an_edited_source_makes_the_generated_file_stale(tmp_path: Path) -> None:
    source, dest = tmp_path / "calls.py", tmp_path / "sync_calls.py"
    shutil.copy(SOURCE, source)
    assert unasync(source, dest).returncode == 0
    source.write_text(source.read_text() + "\n\nasync def extra() -> None:\n    await asyncio.sleep(0)\n")
    assert unasync("--check", source, dest).returncode == 1
    assert unasync("--check", tmp_path / "calls.py", tmp_path / "missing.py").returncode == 1


def test_the_generated_file_says_what_generated_it() -> None:
    text = (REPO / "clients" / "_sync_calls.py").read_text()
    assert text.startswith(
        "# Generated from clients/_async_calls.py by scripts/unasync.py: do not edit.\n"
        "# Edit the source and run: python scripts/unasync.py\n"
    )
    assert "async " not in text and "await " not in text and "import asyncio" not in text


SYNC_NAMES = (
    ("AsyncIterator", "Iterator"),
    ("AsyncWatchStream", "WatchStream"),
    ("AsyncKeepAliveStream", "KeepAliveStream"),
)
OWN_DOCSTRINGS = {"watch"}
"""Methods written in each client: the asyncio `watch` says who resumes it (`EngineSession`)."""


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in inspect.getmembers(cls, callable) if not n.startswith("_")}


def test_both_clients_have_the_same_public_methods_signatures_and_docstrings() -> None:
    aio, sync = public_methods(AsyncRendezvousClient), public_methods(RendezvousClient)
    assert set(aio) == set(sync)
    assert {"register_engine", "iter_engines", "list_engines", "iter_transfers", "get_status", "close"} <= set(sync)
    for name, signature in aio.items():
        expected = str(signature)
        for old, new in SYNC_NAMES:
            expected = expected.replace(old, new)
        assert str(sync[name]) == expected, name
        if name not in OWN_DOCSTRINGS:
            assert getattr(RendezvousClient, name).__doc__ == getattr(AsyncRendezvousClient, name).__doc__, name
    assert inspect.isasyncgenfunction(AsyncRendezvousClient.iter_engines)
    assert inspect.isgeneratorfunction(RendezvousClient.iter_engines)
    assert inspect.iscoroutinefunction(AsyncRendezvousClient.get_status)
    assert not inspect.iscoroutinefunction(RendezvousClient.get_status)
