"""The grpc.aio server: servicer, health, reflection, metrics, TLS, auth and quotas."""

from rendezvous.server.app import RendezvousServer, ServerConfig
from rendezvous.server.quotas import CallLimits
from rendezvous.server.tls import TLSConfig

__all__ = ["CallLimits", "RendezvousServer", "ServerConfig", "TLSConfig"]
