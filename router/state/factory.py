"""Which ClusterStore a router uses: the embedded one, or Redis behind the resilient wrapper.

Beside the contract (router/state/store.py), not in it: the implementations import the
contract, so a factory inside it would make an import cycle.
"""

from __future__ import annotations

from router.state.memory import InMemoryStore
from router.state.resilient import ResilientStore
from router.state.store import DEFAULT_JOURNAL_TTL_S, ClusterStore, redact_url

__all__ = ["make_store"]


def make_store(redis_url: str | None, namespace: str = "pdcluster",
               journal_ttl_s: float = DEFAULT_JOURNAL_TTL_S,
               require: bool = False) -> ClusterStore:
    """For a ``redis_url`` (``redis://`` or ``rediss://``, password in the URL): a
    ``RedisStore`` behind a ``ResilientStore``, which serves on while Redis is down, at
    start-up too (``require``: raise StoreUnavailableError instead). Without one: the
    embedded ``InMemoryStore``. A malformed URL raises ValueError."""
    if redis_url:
        from router.state.redis_store import RedisStore  # the Redis client only when asked for

        return ResilientStore(
            lambda: RedisStore(redis_url, namespace=namespace, journal_ttl_s=journal_ttl_s),
            f"Redis at {redact_url(redis_url)}", require=require)
    return InMemoryStore(journal_ttl_s=journal_ttl_s)
