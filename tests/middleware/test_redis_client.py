"""The resume store's Redis addresses (``redis_client.py``): each topology's form,
what a malformed one is told (a ConfigError naming ``resume_store``, its
password never shown), the client each opens (no connection is made), and the
request path's store failures counted and logged once a while
(``store_outages.py``). No server: the topologies themselves are
tests/sidecar/test_resume_redis_topologies.py."""

from __future__ import annotations

import asyncio
import logging

import pytest
from tokenwire.middleware import ConfigError, WireConfig
from tokenwire.middleware.shared.open_store import open_replay_store
from tokenwire.middleware.shared.redis_client import (
    CLUSTER,
    SENTINEL,
    SERVER,
    open_client,
    parse_store_url,
    redacted,
)
from tokenwire.middleware.shared.replay_store import StoreUnavailable
from tokenwire.middleware.shared.store_outages import StoreOutages

from tokenwire.tools.cli import load_sidecar_config


def test_one_server_is_redis_pys_own_url() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://:pw@cache:6380/2", "unix:///run/redis.sock"):
        address = parse_store_url(url)
        assert (address.topology, address.url) == (SERVER, url)
    assert parse_store_url("rediss://h").tls


def test_sentinel_names_its_sentinels_and_the_master() -> None:
    address = parse_store_url("redis+sentinel://alice:p%40ss@10.0.0.1:26380,[::1],s3:26381/mymaster/3"
                              "?sentinel_password=sp")
    assert address.topology == SENTINEL and not address.tls
    assert address.nodes == (("10.0.0.1", 26380), ("::1", 26379), ("s3", 26381))
    assert (address.master, address.db) == ("mymaster", 3)
    assert (address.username, address.password) == ("alice", "p@ss")
    assert address.sentinel_password == "sp" and address.sentinel_username is None
    plain = parse_store_url("rediss+sentinel://:pw@s1/m")
    assert plain.tls and (plain.username, plain.password, plain.db) == (None, "pw", 0)


def test_cluster_names_nodes_to_start_from() -> None:
    address = parse_store_url("redis+cluster://:secret@n1:7000,n2,n3:7002")
    assert address.topology == CLUSTER
    assert address.nodes == (("n1", 7000), ("n2", 6379), ("n3", 7002))
    assert address.password == "secret" and address.db == 0
    assert parse_store_url("rediss+cluster://n1:7000/0").tls


@pytest.mark.parametrize(("url", "said"), [
    ("redis+sentinel://s1:26379", "the master's name is missing"),
    ("redis+sentinel://s1:26379/", "the master's name is missing"),
    ("redis+sentinel://s1:26379/m/x", "only a database number"),
    ("redis+sentinel://s1:26379/m/1/2", "only a database number"),
    ("redis+sentinel://s1:99999/m", "a port from 1 to 65535"),
    ("redis+sentinel://s1:26379,/m", "malformed address ''"),
    ("redis+sentinel://[::1/m", "malformed address"),
    ("redis+sentinel://s1/m?socket_timeout=1", "unknown option 'socket_timeout'"),
    ("redis+cluster://n1:7000/1", "database 0 only"),
    ("redis+cluster://n1:port", "a port from 1 to 65535"),
    ("redis+cluster://n1?sentinel_password=x", "unknown option"),
    ("sentinel://s1/m", "expected memory, redis://"),
    ("redis+sentinal://s1/m", "expected memory, redis://"),
])
def test_a_malformed_address_is_refused_naming_the_key(url: str, said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_store_url(url)
    assert refused.value.key == "resume_store"
    assert said in refused.value.reason, refused.value.reason


def test_a_refusal_never_shows_a_password() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_store_url("redis+cluster://admin:hunter2@n1:7000/5?sentinel_password=hunter3")
    assert "hunter" not in str(refused.value) and "admin:***@n1:7000" in str(refused.value)
    assert redacted("redis://:pw@h:1/0?password=x&db=1") == "redis://:***@h:1/0?password=***&db=1"
    assert redacted("redis+sentinel://s1/m") == "redis+sentinel://s1/m"
    # A raw / or ? in a password (a URL redis-py misreads) is hidden all the same.
    assert redacted("redis://u:p/ss@h:1/0") == "redis://u:***@h:1/0"
    assert redacted("redis://u:p?ss@h/0") == "redis://u:***@h/0"
    assert redacted("redis://h/0?sentinel_password=a@b") == "redis://h:***@b"
    assert redacted("redis://user@h:1/0") == "redis://user@h:1/0"


def test_the_sidecar_refuses_a_malformed_store_at_start_up_and_takes_each_form() -> None:
    base = ["--upstream", "http://127.0.0.1:1", "--resume", "--resume-owner-secret", "s"]
    with pytest.raises(ConfigError) as refused:
        load_sidecar_config([*base, "--resume-store", "redis+sentinel://s1:26379"], {})
    assert refused.value.key == "resume_store"
    for url in ("redis+sentinel://s1:26379,s2:26379/mymaster/0", "redis+cluster://n1:7000,n2:7001"):
        assert load_sidecar_config([*base, "--resume-store", url], {}).resume_store == url


def test_each_form_opens_its_client_without_connecting() -> None:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.exceptions import RedisClusterException, RedisError

    async def scenario() -> None:
        server, outages = open_client("redis://127.0.0.1:1/0")
        assert isinstance(server, Redis) and {RedisError, RedisClusterException, OSError} <= set(outages)
        sentinel, _ = open_client("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/m/4")
        assert isinstance(sentinel, Redis)
        pool = sentinel.connection_pool
        assert pool.service_name == "m" and pool.connection_kwargs["db"] == 4
        assert pool.connection_kwargs["password"] == "pw"
        sentinels = pool.sentinel_manager.sentinels
        assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
        cluster, _ = open_client("redis+cluster://:pw@127.0.0.1:1,127.0.0.1:2")
        assert isinstance(cluster, RedisCluster) and cluster.node_kwargs == {
            "username": None, "password": "pw", "ssl": False}
        for client in (server, sentinel, cluster):
            await client.aclose()

    asyncio.run(scenario())


def test_open_replay_store_opens_every_form() -> None:
    from tokenwire.middleware.shared.replay_redis import RedisReplayStore

    async def scenario() -> None:
        config = WireConfig(resume=True)
        for url in ("redis://127.0.0.1:1/0", "redis+sentinel://127.0.0.1:1/m", "redis+cluster://127.0.0.1:1"):
            store = open_replay_store(url, config)
            assert isinstance(store, RedisReplayStore)
            await store.aclose()
        with pytest.raises(ConfigError):
            open_replay_store("redis+cluster://n1/7", config)

    asyncio.run(scenario())


def test_store_failures_on_the_request_path_are_counted_and_logged_once_a_while(
        caplog: pytest.LogCaptureFixture) -> None:
    class MovedError(Exception):  # named as redis-py names it: the log's hint reads the name
        pass

    outages = StoreOutages()
    with caplog.at_level(logging.ERROR, logger="tokenwire.resume"):
        for _ in range(50):
            try:
                raise StoreUnavailable("redis: 6091 127.0.0.1:7001") from MovedError("6091 127.0.0.1:7001")
            except StoreUnavailable as error:
                outages.note(error)
    assert outages.count == 50
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenwire.resume"]
    assert len(lines) == 1 and "(requests so far: 1)" in lines[0], lines
    assert "MovedError" in lines[0] and "redis+cluster://" in lines[0]


@pytest.mark.parametrize(("kind", "message", "hint"), [
    ("ClusterCrossSlotError", "CROSSSLOT Keys in request don't hash to the same slot", "redis+cluster://"),
    ("RedisClusterException", "Redis Cluster cannot be connected. Please provide at least one reachable "
                              "node: Cluster mode is not enabled on this node", "not a Redis Cluster"),
    ("ResponseError", "unknown command 'SENTINEL', with args beginning with: 'MASTERS'", "not a sentinel"),
    ("ConnectionError", "Error 111 connecting to 127.0.0.1:6379. Connection refused.", ""),
])
def test_a_misnamed_store_is_told_what_to_name_it(kind: str, message: str, hint: str) -> None:
    from tokenwire.middleware.shared.store_outages import _hint

    assert hint in _hint(kind, message) and bool(_hint(kind, message)) == bool(hint)
