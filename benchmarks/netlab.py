"""The shaped-link lab of scripts/netlab.sh from Python: make one, run commands in its namespaces, remove it.

The script does the work (namespaces, veth pair, tbf, clean-up); this module only runs it and reads the
`NETLAB_*` variables it prints (`up`) or sets (`run`, `exec`).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "netlab.sh"
EXIT_REFUSED = 3
"""The script's exit code when namespaces cannot be made here (it made nothing)."""
COMMAND_TIMEOUT_S = 120.0

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Lab:
    """One lab: two namespaces joined by a veth pair with a link-local address on each end."""

    id: str
    prefill_ns: str
    decode_ns: str
    prefill_dev: str
    decode_dev: str
    prefill_addr: str
    decode_addr: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Lab:
        """The lab described by NETLAB_* variables (KeyError if one is missing)."""
        fields = ("id", "prefill_ns", "decode_ns", "prefill_dev", "decode_dev", "prefill_addr", "decode_addr")
        return cls(**{name: env[f"NETLAB_{name.upper()}"] for name in fields})

    def namespace(self, role: Role) -> str:
        return self.prefill_ns if role == "prefill" else self.decode_ns

    def device(self, role: Role) -> str:
        return self.prefill_dev if role == "prefill" else self.decode_dev

    def address(self, role: Role) -> str:
        return self.prefill_addr if role == "prefill" else self.decode_addr

    def exec_argv(self, role: Role) -> list[str]:
        """The command prefix that runs a command in `role`'s namespace, UCX on its veth over TCP."""
        return [str(SCRIPT), "exec", self.id, role]

    def sent_bytes(self, role: Role) -> int:
        """What `role`'s end of the link has sent so far (its tbf qdisc's counter): what crossed towards the other."""
        argv = ["ip", "netns", "exec", self.namespace(role), "tc", "-s", "qdisc", "show", "dev", self.device(role)]
        shown = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=True).stdout
        match = re.search(r"qdisc tbf .*?Sent (\d+) bytes", shown, re.DOTALL)
        if match is None:
            raise RuntimeError(f"no tbf counter on {self.device(role)}: {shown!r}")
        return int(match.group(1))


def parse_variables(text: str) -> dict[str, str]:
    """`NAME=value` lines (what `netlab.sh up` prints) as a dict."""
    pairs = (line.partition("=") for line in text.splitlines() if "=" in line)
    return {name.strip(): value.strip() for name, _, value in pairs}


def why_not() -> str | None:
    """None if labs can be made here, else the script's reason."""
    result = subprocess.run([str(SCRIPT), "check"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    return None if result.returncode == 0 else (result.stderr.strip() or f"netlab.sh check: {result.returncode}")


def up(rate: str, *, lab_id: str | None = None, env: Mapping[str, str] | None = None) -> Lab:
    """Make a lab shaped at `rate` (tc syntax: 1gbit, 5gbit, 25gbit); raises CalledProcessError if it failed."""
    argv = [str(SCRIPT), "up", "--rate", rate, *(["--id", lab_id] if lab_id else [])]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env, check=True)
    return Lab.from_env(parse_variables(result.stdout))


def down(lab_id: str) -> None:
    """Remove the lab `lab_id` (idempotent)."""
    subprocess.run([str(SCRIPT), "down", lab_id], capture_output=True, timeout=COMMAND_TIMEOUT_S, check=True)
