"""The Redis client a resume store's address names: one server, Sentinel, or Cluster.

Theory of operation
-------------------
``resume_store`` takes one of three address forms (:func:`parse_store_url`
checks each at start-up without importing redis, so a base install refuses a
malformed one with a ConfigError naming the key, as it refuses a missing
client):

* one server: ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]``, ``rediss://``
  (TLS), ``unix:///PATH``: redis-py's own URL, ``Redis.from_url``;
* Sentinel: ``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]``
  (``rediss+sentinel://``: TLS to the sentinels and the master), the
  sentinels' addresses (port 26379 when left out) and the master's name;
  USER/PASSWORD are the master's, ``?sentinel_password=…&sentinel_username=…``
  the sentinels' own where they ask for one. ``Sentinel(...).master_for``: a
  failover breaks the connections to the old master and the next connection
  asks the sentinels again; a demoted master's READONLY is a ConnectionError
  there (redis-py's ``SentinelManagedConnection``), so the store treats it as
  the outage it is;
* Cluster: ``redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]``
  (``rediss+cluster://``), any of its nodes (port 6379 when left out), no
  database (a cluster has only 0). ``RedisCluster``.

What the store sends, on a cluster: a stream's own keys share the hash tag
``{S}`` (one slot); its idempotency claim ``tw:k:…`` and alias ``tw:r:…`` are
named by what a request brings (the key, the response id), not by the stream,
so they hash elsewhere and are only ever sent as single-key commands. The two
multi-key commands, ``DEL`` (a stream's keys with its claim) and ``EXISTS``,
are split per slot by redis-py's cluster client. A pipeline is split per node
by redis-py too, but where one server's pipeline raises when the connection
fails, the cluster's returns a node's failure (connection lost mid-read,
CLUSTERDOWN, a MOVED or ASK left after its redirects) inside the results,
which ``execute(raise_on_error=False)`` hands back as if the round had been
stored: :class:`_Cluster`'s pipelines raise such a result, so a failed round is
marked as a gap on a cluster as it is on one server.

Pub/sub (the cancel relay, ``redis_cancel.py``): a cluster passes a plain
PUBLISH on to every node's subscribers, but its reply counts only the
subscribers of the node it was sent to, and the relay reads that count as
"somebody writes streams". So every process publishes and subscribes on the
same node, the primary of the channel's slot (:func:`channel_node`; asked
again after a failure), through a plain client to that node
(:func:`node_client`); one server or Sentinel uses the store's own client.
Valkey answers every command used here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

from ..core.config import ConfigError

SERVER, SENTINEL, CLUSTER = "server", "sentinel", "cluster"
_FORMS = {
    SERVER: "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] (rediss:// for TLS, unix:///PATH)",
    SENTINEL: "redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER_NAME[/DB]",
    CLUSTER: "redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]",
}
_SCHEMES = {"redis": (SERVER, False), "rediss": (SERVER, True), "unix": (SERVER, False),
            "redis+sentinel": (SENTINEL, False), "rediss+sentinel": (SENTINEL, True),
            "redis+cluster": (CLUSTER, False), "rediss+cluster": (CLUSTER, True)}
_DEFAULT_PORT = {SENTINEL: 26379, CLUSTER: 6379}
_SENTINEL_QUERY = ("sentinel_password", "sentinel_username")
# A sentinel answers small questions (where is the master?): one that does not
# answer in this long is skipped for the next, instead of holding a request.
_SENTINEL_TIMEOUT_S = 1.0

# A command that fails on a cluster (a node gone, CLUSTERDOWN) is tried again
# this many times, each after the slots are read again (which finds a promoted
# replica): redis-py 8's 10 hold a request 1.5-2.7 s on an outage, past the
# header commit deadline, where the store only needs to fail fast (a refused
# request says when to retry; a failed append is marked as a gap).
_CLUSTER_RETRIES = 2

STORE_FORMS = "memory, " + ", ".join(_FORMS.values())
"""Every form ``resume_store`` takes, as an error message lists them."""


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """A parsed ``redis…://`` store address (:func:`parse_store_url`)."""

    topology: str
    """:data:`SERVER`, :data:`SENTINEL` or :data:`CLUSTER`."""
    url: str
    tls: bool = False
    nodes: tuple[tuple[str, int], ...] = ()
    """The sentinels, or the cluster nodes to start from (empty for one server)."""
    master: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def redacted(url: str) -> str:
    """``url`` with its passwords (the user's, ``sentinel_password``) shown as ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # The last @ ends the user's part, wherever a / or ? falls: a raw one in a
    # password (which redis-py would misread as the host's) stays inside it.
    userinfo, at, rest = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if colon or "?" in userinfo:  # a password, or a query whose value held the @
        userinfo = user.partition("/")[0].partition("?")[0] + ":***"
    rest, mark, query = rest.partition("?")
    if mark:
        pairs = (pair.partition("=") for pair in query.split("&"))
        query = "&".join(name + eq + ("***" if "password" in name else value) for name, eq, value in pairs)
    return f"{scheme}://{userinfo}{at}{rest}{mark}{query}"


def parse_store_url(url: str) -> StoreAddress:
    """Check a Redis store address and say what it names; ConfigError
    (``resume_store``) for a malformed one, saying what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ConfigError("resume_store", f"expected {STORE_FORMS}; got {redacted(url)!r}")
    topology, tls = _SCHEMES[scheme]
    if topology == SERVER:
        return StoreAddress(SERVER, url, tls=tls)  # redis-py's own URL (Redis.from_url reads it)

    def refuse(why: str) -> ConfigError:
        return ConfigError("resume_store", f"{why}: expected {_FORMS[topology]}; got {redacted(url)!r}")

    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = unquote(user) or None, (unquote(secret) if colon else None)
    nodes = tuple(_host_port(part, _DEFAULT_PORT[topology], refuse) for part in hosts.split(","))
    options = dict(parse_qsl(query, keep_blank_values=True))
    allowed = _SENTINEL_QUERY if topology == SENTINEL else ()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise refuse(f"unknown option {unknown[0]!r}" + (f" (only {', '.join(allowed)})" if allowed else ""))
    master, db = "", 0
    parts = [unquote(p) for p in path.split("/")] if path else []
    if topology == SENTINEL:
        if not parts or not parts[0]:
            raise refuse("the master's name is missing")
        master = parts[0]
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise refuse("after the master's name, only a database number")
        db = int(parts[1]) if len(parts) == 2 else 0
    elif [p for p in parts if p not in ("", "0")]:
        raise refuse("a Redis Cluster has database 0 only, and no master name")
    return StoreAddress(topology, url, tls=tls, nodes=nodes, master=master, db=db,
                        username=username, password=password,
                        sentinel_username=options.get("sentinel_username") or None,
                        sentinel_password=options.get("sentinel_password") or None)


def _host_port(part: str, default_port: int,
               refuse: Callable[[str], ConfigError]) -> tuple[str, int]:
    host, port = part, ""
    if part.startswith("["):  # [IPv6]:PORT
        host, bracket, tail = part[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise refuse(f"a malformed address {part!r}")
        port = tail[1:]
    elif ":" in part:
        host, _, port = part.rpartition(":")
    if not host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
        raise refuse(f"a malformed address {part!r} (HOST:PORT, a port from 1 to 65535)")
    return host, int(port) if port else default_port


def open_client(url: str) -> tuple[Any, tuple[type[BaseException], ...]]:
    """The asyncio client ``url`` names, and the exception types that mean the
    store is out (the store turns them into ``StoreUnavailable``)."""
    address = parse_store_url(url)
    try:
        # Optional: the base install has no Redis client (the redis extra).
        import redis.asyncio as redis_asyncio
        from redis.exceptions import RedisClusterException
    except ImportError:
        raise ConfigError("resume_store", "a redis:// store needs the redis package (the redis extra): "
                                          "pip install '.[redis]' in tokenwire's clone, or the built "
                                          "wheel with [redis] (README: Install)") from None
    # A cluster client that cannot reach a node to start from raises
    # RedisClusterException, which is not a RedisError.
    outages: tuple[type[BaseException], ...] = (redis_asyncio.RedisError, RedisClusterException, OSError)
    auth: dict[str, Any] = {"username": address.username, "password": address.password}
    if address.topology == SENTINEL:
        from redis.asyncio import sentinel as redis_sentinel

        sentinel_kwargs: dict[str, Any] = {
            "username": address.sentinel_username, "password": address.sentinel_password,
            "socket_timeout": _SENTINEL_TIMEOUT_S, "socket_connect_timeout": _SENTINEL_TIMEOUT_S}
        if address.tls:
            sentinel_kwargs["ssl"] = True
        make: Any = redis_sentinel.Sentinel  # untyped in redis-py
        sentinel = make(list(address.nodes), sentinel_kwargs=sentinel_kwargs, db=address.db,
                    **auth, **({"ssl": True} if address.tls else {}))
        return sentinel.master_for(address.master, redis_class=_sentinel_master_class()), outages
    if address.topology == CLUSTER:
        from redis.asyncio.cluster import ClusterNode
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        cluster = _cluster_class()(startup_nodes=[ClusterNode(host, port) for host, port in address.nodes],
                                   retry=Retry(NoBackoff(), _CLUSTER_RETRIES), ssl=address.tls, **auth)
        cluster.node_kwargs = {**auth, "ssl": address.tls}
        return cluster, outages
    return redis_asyncio.Redis.from_url(url), outages


async def channel_node(redis: Any, channel: str, *, refresh: bool = False) -> tuple[str, int] | None:
    """The node a cluster's processes publish and subscribe ``channel`` on: the
    primary of its slot (``refresh``: read the cluster's slots again first, after
    a failure); None for a client of one server or Sentinel (the client itself
    serves pub/sub)."""
    if not isinstance(redis, _cluster_class()):
        return None
    if refresh:
        await redis.nodes_manager.initialize()
    else:
        await redis.initialize()  # at once when done already
    node = redis.get_node_from_key(channel)
    return str(node.host), int(node.port)


def node_client(redis: Any, host: str, port: int) -> Any:
    """A plain client to one node of the cluster ``redis`` (its credentials)."""
    import redis.asyncio as redis_asyncio

    return redis_asyncio.Redis(host=host, port=port, **redis.node_kwargs)


@functools.cache
def _sentinel_master_class() -> type[Any]:
    from redis.asyncio import Redis

    class SentinelMaster(Redis):
        """The master's client, which closes the sentinels' connections with its own."""

        async def aclose(self, close_connection_pool: bool | None = None) -> None:
            await super().aclose(close_connection_pool)
            pool: Any = self.connection_pool  # a SentinelConnectionPool: master_for made it
            for sentinel in pool.sentinel_manager.sentinels:
                await sentinel.aclose()

    return SentinelMaster


@functools.cache
def _cluster_class() -> type[Any]:
    from redis.asyncio.cluster import RedisCluster
    from redis.exceptions import (
        AskError,
        ClusterCrossSlotError,
        ClusterError,
        ConnectionError,
        ReadOnlyError,
        RedisClusterException,
        TimeoutError,
        TryAgainError,
    )

    # A node's failure returned as a command's result (see the module docstring):
    # the command was not stored. Any other error stays a result, as on one server.
    failed = (ConnectionError, TimeoutError, ClusterError, AskError, TryAgainError,
              ClusterCrossSlotError, ReadOnlyError, RedisClusterException)

    class Cluster(RedisCluster):
        """``RedisCluster`` whose pipelines raise a node's failure (:class:`_RaisingPipeline`)."""

        node_kwargs: dict[str, Any]

        def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
            return _RaisingPipeline(super().pipeline(transaction, shard_hint), failed)

    return Cluster


class _RaisingPipeline:
    """A cluster pipeline whose ``execute`` raises the first failure of a node
    among its results; every other attribute is the pipeline's own."""

    def __init__(self, pipe: Any, failed: tuple[type[BaseException], ...]) -> None:
        self._pipe = pipe
        self._failed = failed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __len__(self) -> int:
        return len(self._pipe)

    async def __aenter__(self) -> _RaisingPipeline:
        await self._pipe.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._pipe.__aexit__(*exc)

    async def execute(self, raise_on_error: bool = True, **kwargs: Any) -> list[Any]:
        results: list[Any] = await self._pipe.execute(raise_on_error=raise_on_error, **kwargs)
        for result in results:
            if isinstance(result, self._failed):
                raise result
        return results
