"""Store backends behind one interface: memory (default) and Redis."""

from rendezvous.store.base import EventPage, Store, StoreCounts, StoreUnavailableError
from rendezvous.store.memory import MemoryStore

__all__ = ["EventPage", "MemoryStore", "Store", "StoreCounts", "StoreUnavailableError"]
