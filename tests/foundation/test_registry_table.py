"""Lease rules of the registry, on the table alone with a hand-moved clock."""

from __future__ import annotations

import asyncio

import pytest

from gymrpc import errors
from gymrpc.servers.registry.table import MAX_TTL, MIN_TTL, Table


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> Table:
    return Table(clock)


def test_register_resolve_and_expire(table: Table, clock: Clock) -> None:
    entry = table.register("agent/simple", "0", "127.0.0.1:5000", 10, {"pid": "1"})
    assert [e.address for e in table.resolve("agent/simple")] == ["127.0.0.1:5000"]
    clock.now += 9.9
    assert table.resolve("agent/simple")[0].lease_id == entry.lease_id
    clock.now += 0.2
    with pytest.raises(errors.NotFound) as info:
        table.resolve("agent/simple")
    assert info.value.reason == "LEASE_EXPIRED"
    assert "agent/simple" in info.value.message


def test_keep_alive_extends_and_expired_lease_is_refused(table: Table, clock: Clock) -> None:
    entry = table.register("agent/simple", "0", "127.0.0.1:5000", 10, {})
    for _ in range(5):
        clock.now += 8
        table.keep_alive(entry.lease_id)
    assert table.resolve("agent/simple")
    clock.now += 10.1
    with pytest.raises(errors.NotFound) as info:
        table.keep_alive(entry.lease_id)
    assert info.value.reason == "LEASE_EXPIRED"


def test_never_registered_name_says_so_and_lists_what_exists(table: Table) -> None:
    table.register("resources/counter", "0", "127.0.0.1:1", 10, {})
    with pytest.raises(errors.NotFound) as info:
        table.resolve("resources/countr")
    assert info.value.reason == "NOT_FOUND"
    assert "'resources/countr' was never registered" in info.value.message
    assert "resources/counter" in info.value.message


def test_restarted_server_replaces_its_entry_and_old_lease_dies(table: Table) -> None:
    old = table.register("model/policy", "0", "127.0.0.1:1", 10, {})
    new = table.register("model/policy", "0", "127.0.0.1:2", 10, {}, lease_id=old.lease_id)
    assert new.lease_id != old.lease_id
    assert [e.address for e in table.resolve("model/policy")] == ["127.0.0.1:2"]
    with pytest.raises(errors.NotFound):
        table.keep_alive(old.lease_id)


def test_a_live_servers_name_is_taken_for_anyone_else_until_its_lease_expires(table: Table, clock: Clock) -> None:
    live = table.register("model/policy", "0", "127.0.0.1:1", 10, {})
    for lease_id in ("", "0" * 24, live.lease_id[:-1]):
        with pytest.raises(errors.AlreadyExists) as taken:
            table.register("model/policy", "0", "127.0.0.1:9", 10, {}, lease_id=lease_id)
        assert taken.value.reason == "NAME_TAKEN"
        assert taken.value.retry_delay == pytest.approx(10)
        assert [(e.address, e.lease_id) for e in table.resolve("model/policy")] == [("127.0.0.1:1", live.lease_id)]
    table.register("model/policy", "1", "127.0.0.1:9", 10, {})  # another replica id is another entry
    clock.now += 11  # the live one stopped renewing: its name is free again
    moved = table.register("model/policy", "0", "127.0.0.1:9", 10, {})
    assert moved.lease_id != live.lease_id


def test_retried_register_is_idempotent(table: Table) -> None:
    first = table.register("model/policy", "0", "127.0.0.1:1", 10, {})
    again = table.register("model/policy", "0", "127.0.0.1:1", 10, {})
    assert again.lease_id == first.lease_id
    assert len(table.list()) == 1


def test_replicas_and_prefix_listing(table: Table) -> None:
    for i in range(3):
        table.register("agent/simple", str(i), f"127.0.0.1:{100 + i}", 10, {})
    table.register("model/policy", "0", "127.0.0.1:9", 10, {})
    assert [e.endpoint_id for e in table.resolve("agent/simple")] == ["0", "1", "2"]
    assert [e.name for e in table.list("agent/")] == ["agent/simple"] * 3
    assert len(table.list()) == 4


def test_deregister_is_idempotent(table: Table) -> None:
    entry = table.register("agent/simple", "0", "127.0.0.1:5000", 10, {})
    assert table.deregister(entry.lease_id) is True
    assert table.deregister(entry.lease_id) is False
    with pytest.raises(errors.NotFound):
        table.resolve("agent/simple")


def test_ttl_is_clamped(table: Table) -> None:
    assert table.register("a/b", "0", "127.0.0.1:1", 0.001, {}).ttl == MIN_TTL
    assert table.register("a/c", "0", "127.0.0.1:1", 1e9, {}).ttl == MAX_TTL


def test_watchers_hear_every_change(table: Table, clock: Clock) -> None:
    async def scenario() -> list[str]:
        queue = table.subscribe()
        entry = table.register("agent/simple", "0", "127.0.0.1:1", 1, {})
        table.register("agent/simple", "0", "127.0.0.1:2", 1, {}, lease_id=entry.lease_id)
        clock.now += 2
        table.expire()
        table.register("model/policy", "0", "127.0.0.1:3", 1, {})
        table.deregister(table.resolve("model/policy")[0].lease_id)
        assert entry.lease_id
        return [f"{c.kind}:{c.entry.address}" for c in [queue.get_nowait() for _ in range(queue.qsize())] if c]

    assert asyncio.run(scenario()) == [
        "added:127.0.0.1:1",
        "added:127.0.0.1:2",
        "expired:127.0.0.1:2",
        "added:127.0.0.1:3",
        "removed:127.0.0.1:3",
    ]
