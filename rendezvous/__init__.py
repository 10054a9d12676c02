"""kv-rendezvous: a gRPC rendezvous service for push-mode KV-cache transfers.

The distribution's one import name: the engine SDK is `rendezvous.clients` (folder clients/) and the vLLM connector
`rendezvous.connector` (folder connector/), reached through symlinks. Kept import-free so that importing them, or
`rendezvous.v1` (the protocol stubs, used by clients), loads no service code.
"""

__version__ = "0.2.0.dev0"
