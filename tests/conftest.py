"""Shared fixtures. Test environment: loopback only for UCX (NIXL)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "shm,tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# Required suites and hypothesis profiles under CI.
pytest_plugins = ["tests.ci"]
