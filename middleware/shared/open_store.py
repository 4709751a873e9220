"""The replay store a process's ``resume_store`` names: in memory, or Redis.

Apart from both stores so that neither imports the other: the Redis store
needs the ``redis`` extra, imported only when a Redis address asks (one
server, Sentinel or Cluster: ``redis_client.py`` reads the address).
"""

from __future__ import annotations

from ..core.config import WireConfig
from .redis_client import parse_store_url
from .replay_store import MemoryReplayStore, ReplayStore


def open_replay_store(url: str, config: WireConfig) -> ReplayStore:
    """``memory`` (or empty), or a Redis address: ``redis://HOST:PORT/DB``,
    ``redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]``,
    ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (``redis_client.py``)."""
    if url in ("", "memory"):
        return MemoryReplayStore.from_config(config)
    parse_store_url(url)  # a malformed address is a ConfigError naming resume_store
    from .replay_redis import RedisReplayStore

    return RedisReplayStore(url, ttl_s=config.resume_ttl_s)
