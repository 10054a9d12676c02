"""The Redis store: state shared by any number of server replicas, surviving their restarts.

One module per concern, as redis-py splits client, connection and retry:

    url.py       store URLs: RedisOptions, RedisTarget, parse_url
    scripts/     the Lua scripts (.lua files) and the one table of their named arguments
    store.py     RedisStore, the Store interface over Redis
    cache.py     engine and transfer records as last seen (optimistic updates), event peers
    epoch.py     the store's lifetime and the guard every write carries
    pipeliner.py pipelining: one round trip for the commands of one event-loop iteration
    locks.py     per-key queues of this process's updates
    errors.py    which Redis failures mean "unavailable"
"""

from rendezvous.store.redis.store import RedisStore
from rendezvous.store.redis.url import RedisOptions, RedisTarget, parse_url

__all__ = ["RedisOptions", "RedisStore", "RedisTarget", "parse_url"]
