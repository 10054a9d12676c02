"""kv-rendezvous: a gRPC rendezvous service for push-mode KV-cache transfers.

Kept import-free so that `import rendezvous.v1` (the protocol stubs, used by clients) stays light.
"""

__version__ = "0.1.0"
