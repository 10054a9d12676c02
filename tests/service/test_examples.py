"""The README's examples run as written against a real server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from rendezvous.server import RendezvousServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def test_quickstart_completes_a_push_transfer(server: RendezvousServer) -> None:
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(EXAMPLES / "quickstart.py"), server.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "write into decode-0 blocks [7, 8, 9]" in done.stdout
    assert "committed generation 1" in done.stdout
