"""Shared fixtures. Test environment: loopback only for UCX (NIXL)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_TLS", "shm,tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hypothesis import settings

# CI runs a fixed, reproducible sample; developers get fresh random ones each run.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
