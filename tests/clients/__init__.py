"""Tests of the engine SDK (clients): pure parts, and real gRPC against the in-process test server."""
