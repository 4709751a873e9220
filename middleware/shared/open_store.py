"""The replay store a process's ``resume_store`` names: in memory, or Redis.

Apart from both stores so that neither imports the other: the Redis store
needs the ``redis`` extra, imported only when a ``redis://`` address asks.
"""

from __future__ import annotations

from ..core.config import ConfigError, WireConfig
from .replay_store import MemoryReplayStore, ReplayStore


def open_replay_store(url: str, config: WireConfig) -> ReplayStore:
    """``memory`` (or empty) or ``redis://host:port/db``."""
    if url in ("", "memory"):
        return MemoryReplayStore.from_config(config)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .replay_redis import RedisReplayStore

        return RedisReplayStore(url, ttl_s=config.resume_ttl_s)
    raise ConfigError("resume_store", f"expected memory or redis://HOST:PORT/DB, got {url!r}")
