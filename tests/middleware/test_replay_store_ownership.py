"""Streams belong to their caller: the owner hash and ``admit``, the rule both drivers use."""

from __future__ import annotations

import asyncio

import pytest
from tokenwire.middleware import ClientError, WireConfig
from tokenwire.middleware.core.errors import WireError
from tokenwire.middleware.core.resume import CallerKey, Idempotent, ResumeFrom, same_caller, scoped_key
from tokenwire.middleware.shared.replay_store import MemoryReplayStore, admit

ALICE = [(b"authorization", b"Bearer sk-alice")]
MALLORY = [(b"authorization", b"Bearer sk-mallory")]


def test_owner_is_a_keyed_hash_of_the_header_never_the_value() -> None:
    key = CallerKey.from_config(WireConfig(resume_owner_secret="s"))
    alice = key.owner(ALICE)
    assert alice == key.owner([(b"authorization", b"Bearer sk-alice ")])  # surrounding space ignored
    assert alice != key.owner(MALLORY) != key.owner([]) != key.owner([(b"authorization", b"")])
    assert b"sk-alice" not in alice.encode() and len(alice) == 64
    # Another secret, another hash: a store's hashes are useless without the secret.
    assert CallerKey.from_config(WireConfig(resume_owner_secret="t")).owner(ALICE) != alice
    # No secret: random per process (two keys disagree).
    one, two = CallerKey.from_config(WireConfig()), CallerKey.from_config(WireConfig())
    assert one.owner(ALICE) != two.owner(ALICE)
    # Another header names the caller.
    by_api_key = CallerKey.from_config(WireConfig(resume_owner_header="X-Api-Key", resume_owner_secret="s"))
    assert by_api_key.owner([*ALICE, (b"x-api-key", b"k")]) == by_api_key.owner([(b"x-api-key", b"k")])


def test_same_caller_and_scoped_key() -> None:
    assert same_caller("a" * 64, "a" * 64) and not same_caller("a" * 64, "b" * 64)
    assert not same_caller(None, "a" * 64)
    assert scoped_key("o1", "k") != scoped_key("o2", "k") != scoped_key("o1", "k2")
    assert scoped_key("o1", "k") == scoped_key("o1", "k")


def test_admit_serves_only_the_owner_and_scopes_keys() -> None:
    async def scenario() -> None:
        store = MemoryReplayStore()
        await store.open("s1", owner="alice")
        assert await store.owner("s1") == "alice" and await store.owner("nope") is None
        assert await admit(store, ResumeFrom("s1", 3), stream_id="new", owner="alice",
                           open_now=False) == ResumeFrom("s1", 3)
        with pytest.raises(ClientError) as refused:
            await admit(store, ResumeFrom("s1", 0), stream_id="new", owner="mallory", open_now=False)
        with pytest.raises(ClientError) as unknown:
            await admit(store, ResumeFrom("never", 0), stream_id="new", owner="mallory", open_now=False)
        # The very error of an unknown stream, naming only the id the caller sent.
        assert refused.value.code == unknown.value.code
        assert refused.value.http_status == unknown.value.http_status == 404
        # Idempotency keys: per owner.
        first = Idempotent("k", "digest-1")
        assert await admit(store, first, stream_id="i1", owner="alice", open_now=False) is None
        assert await admit(store, first, stream_id="i2", owner="alice", open_now=False) == ResumeFrom("i1", 0)
        assert await admit(store, first, stream_id="i3", owner="mallory", open_now=False) is None
        other_body = Idempotent("k", "digest-2")
        assert await admit(store, other_body, stream_id="i4", owner="eve", open_now=False) is None
        with pytest.raises(WireError) as reused:
            await admit(store, other_body, stream_id="i5", owner="alice", open_now=False)
        assert reused.value.http_status == 422
        # An ordinary request opens its stream for its owner when asked to.
        assert await admit(store, None, stream_id="o1", owner="bob", open_now=True) is None
        assert await store.owner("o1") == "bob"

    asyncio.run(scenario())


def test_aliases_count_within_their_owners_streams_only() -> None:
    """The engine names responses, and behind the middleware a client picks
    the name (``resp_{x-request-id}``): two callers' streams of one name each
    stay their own, for a resume and a cancel alike, whoever came last."""
    from tokenwire.middleware.core.events import ReplayAppend
    from tokenwire.middleware.core.resume import CancelStream, ResumeAlias

    async def scenario() -> None:
        store = MemoryReplayStore()
        for stream_id, owner in (("sa", "alice"), ("sm", "mallory")):
            await store.open(stream_id, owner=owner)
            store.append(ReplayAppend(stream_id, 1, (b"data: x\n\n",), alias="resp_same"))
        assert await store.resolve("resp_same", "alice") == "sa"
        assert await store.resolve("resp_same", "mallory") == "sm"
        assert await store.resolve("resp_same", "eve") is None
        assert await admit(store, ResumeAlias("resp_same", 0), stream_id="n1", owner="alice",
                           open_now=False) == ResumeFrom("sa", 0)
        assert await admit(store, CancelStream(alias="resp_same"), stream_id="n2", owner="alice",
                           open_now=False) == CancelStream("sa", "resp_same")
        # Not this caller's name: the engine's to answer (generated as an ordinary request).
        assert await admit(store, CancelStream(alias="resp_same"), stream_id="n3", owner="eve",
                           open_now=False) is None
        await store.discard("sa")
        assert await store.resolve("resp_same", "alice") is None
        assert await store.resolve("resp_same", "mallory") == "sm"

    asyncio.run(scenario())
