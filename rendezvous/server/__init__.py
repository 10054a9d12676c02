"""The grpc.aio server: servicer, health, reflection, metrics."""

from rendezvous.server.app import RendezvousServer, ServerConfig

__all__ = ["RendezvousServer", "ServerConfig"]
