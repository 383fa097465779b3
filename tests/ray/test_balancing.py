"""`gymrpc.balancing`: which replica a call goes to, pure Python (no sockets, no Ray)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from gymrpc.balancing import Balancer, affinity_key, place
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import resources_service_pb2 as resources_pb

NAME = "resources/counter"
EPISODE = common_pb2.EpisodeId(rollout_id="ep")


@dataclass
class Ep:
    endpoint_id: str
    address: str


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replicas(n: int, generation: int = 0) -> list[Ep]:
    return [Ep(str(i), f"10.0.{generation}.{i}:1") for i in range(n)]


def endpoint(balancer: Balancer, key: str | None) -> str:
    return balancer.pick(NAME, key).rpartition(".")[2].removesuffix(":1")


def test_every_call_of_a_session_goes_to_one_replica_and_sessions_spread_over_all() -> None:
    balancer = Balancer()
    balancer.update(NAME, replicas(4))
    placed = {f"session-{i}": endpoint(balancer, f"session-{i}") for i in range(400)}
    for _ in range(3):
        assert all(endpoint(balancer, key) == where for key, where in placed.items())
    spread = Counter(placed.values())
    assert set(spread) == {"0", "1", "2", "3"}
    assert min(spread.values()) > 60  # 100 each in expectation
    assert all(balancer.failovers(NAME, key) == 0 for key in placed)


def test_two_clients_place_a_session_on_the_same_replica_without_talking() -> None:
    first, second = Balancer(), Balancer()
    first.update(NAME, replicas(4))
    second.update(NAME, list(reversed(replicas(4))))
    assert all(first.pick(NAME, f"s{i}") == second.pick(NAME, f"s{i}") for i in range(200))


def test_place_is_what_a_fresh_client_picks_so_a_restore_can_put_sessions_where_calls_go() -> None:
    balancer = Balancer()
    balancer.update(NAME, replicas(3))
    assert all(balancer.pick(NAME, f"s{i}") == f"10.0.0.{place(f's{i}', ['0', '1', '2'])}:1" for i in range(50))


def test_a_failed_replica_moves_its_sessions_once_and_counts_the_failover() -> None:
    clock = Clock()
    balancer = Balancer(clock=clock)
    balancer.update(NAME, replicas(3))
    keys = [f"s{i}" for i in range(90)]
    before = {k: endpoint(balancer, k) for k in keys}
    balancer.failed(NAME, "10.0.0.1:1")
    after = {k: endpoint(balancer, k) for k in keys}
    moved = {k for k in keys if before[k] == "1"}
    assert moved
    assert all(after[k] != "1" for k in moved)
    assert all(after[k] == before[k] for k in keys if k not in moved)  # the others never move
    assert {k for k in keys if balancer.failovers(NAME, k)} == moved
    assert [(e.key, e.from_endpoint, e.to_endpoint) for e in balancer.events] == [
        (k, "1", after[k]) for k in keys if k in moved
    ]
    # The replica restarts (a new address under its endpoint id): moved sessions stay where they went,
    # new sessions may be placed on it again.
    balancer.update(NAME, [Ep("0", "10.0.0.0:1"), Ep("1", "10.0.1.1:1"), Ep("2", "10.0.0.2:1")])
    assert all(balancer.pick(NAME, k).endswith(f".{after[k]}:1") for k in moved)
    assert any(endpoint(balancer, f"new-{i}") == "1" for i in range(30))


def test_a_second_client_agrees_where_a_failed_over_session_went() -> None:
    first, second = Balancer(), Balancer()
    for b in (first, second):
        b.update(NAME, replicas(4))
    key = next(f"s{i}" for i in range(100) if first.pick(NAME, f"s{i}") == "10.0.0.2:1")
    first.failed(NAME, "10.0.0.2:1")
    second.failed(NAME, "10.0.0.2:1")
    assert first.pick(NAME, key) == second.pick(NAME, key) != "10.0.0.2:1"


def test_a_down_mark_expires_and_with_every_replica_down_calls_wait_for_their_own() -> None:
    clock = Clock()
    balancer = Balancer(clock=clock, down_seconds=5)
    balancer.update(NAME, replicas(2))
    key = next(f"s{i}" for i in range(50) if endpoint(balancer, f"s{i}") == "0")
    balancer.failed(NAME, "10.0.0.0:1")
    balancer.failed(NAME, "10.0.0.1:1")
    assert endpoint(balancer, key) == "0"  # nothing healthy: stay put, like a single endpoint
    assert balancer.failovers(NAME, key) == 0
    balancer.update(NAME, [Ep("0", "10.0.0.0:1"), Ep("1", "10.0.9.1:1")])  # replica 1 came back
    assert endpoint(balancer, key) == "1"
    assert balancer.failovers(NAME, key) == 1
    clock.now += 6
    assert endpoint(balancer, key) == "1"  # sticky: it does not go back
    assert {endpoint(balancer, None) for _ in range(4)} == {"0", "1"}  # replica 0's mark expired


def test_a_replica_that_left_the_registry_moves_its_sessions() -> None:
    balancer = Balancer()
    balancer.update(NAME, replicas(3))
    key = next(f"s{i}" for i in range(60) if endpoint(balancer, f"s{i}") == "2")
    gone = balancer.update(NAME, replicas(2))
    assert gone == {"10.0.0.2:1"}
    assert endpoint(balancer, key) in {"0", "1"}
    assert balancer.failovers(NAME, key) == 1


def test_a_single_endpoint_is_always_chosen_even_when_marked_down() -> None:
    balancer = Balancer()
    balancer.update(NAME, replicas(1))
    balancer.failed(NAME, "10.0.0.0:1")
    assert balancer.pick(NAME, "s") == balancer.pick(NAME, None) == "10.0.0.0:1"
    assert balancer.failovers(NAME, "s") == 0


def test_calls_without_a_session_go_round_robin_over_healthy_replicas() -> None:
    balancer = Balancer()
    balancer.update(NAME, replicas(3))
    assert Counter(endpoint(balancer, None) for _ in range(30)) == {"0": 10, "1": 10, "2": 10}
    balancer.failed(NAME, "10.0.0.1:1")
    assert set(endpoint(balancer, None) for _ in range(10)) == {"0", "2"}


def test_the_affinity_table_is_bounded() -> None:
    balancer = Balancer(max_sessions=10)
    balancer.update(NAME, replicas(2))
    for i in range(100):
        balancer.pick(NAME, f"s{i}")
    assert len(balancer.placements(NAME)) == 10
    assert balancer.endpoint_of(NAME, "s0") is None
    assert balancer.endpoint_of(NAME, "s99") is not None


@pytest.mark.parametrize(
    ("request_", "key"),
    [
        (resources_pb.CallToolRequest(session_id="sess", episode_id=common_pb2.EpisodeId(rollout_id="ep")), "sess"),
        (resources_pb.SeedSessionRequest(session_id="sess"), "sess"),
        (resources_pb.ListToolsRequest(), None),
        (agent_pb.RunRequest(episode_id=common_pb2.EpisodeId(rollout_id="ep", attempt=2)), "ep"),
        (
            agent_pb.RunStreamRequest(request=agent_pb.RunRequest(episode_id=common_pb2.EpisodeId(rollout_id="ep"))),
            "ep",
        ),
        (model_pb.GenerateRequest(request_id="r", episode_id=common_pb2.EpisodeId(rollout_id="ep")), "ep"),
        (model_pb.GenerateRequest(request_id="r"), None),
    ],
)
def test_affinity_key_is_the_session_else_the_episode(request_: object, key: str | None) -> None:
    assert affinity_key(request_) == key  # type: ignore[arg-type]


def test_only_a_name_with_replicas_says_its_sessions_move(caplog: pytest.LogCaptureFixture) -> None:
    balancer = Balancer()
    balancer.update(NAME, replicas(1))
    with caplog.at_level("WARNING", logger="gymrpc.balancing"):
        balancer.failed(NAME, "10.0.0.0:1")
    assert [r.getMessage() for r in caplog.records] == [
        "server unavailable (restarting?); calls wait for it under the same name"
    ]
    caplog.clear()
    balancer.update("resources/two", replicas(2))
    with caplog.at_level("WARNING", logger="gymrpc.balancing"):
        balancer.failed("resources/two", "10.0.0.1:1")
    assert [r.getMessage() for r in caplog.records] == ["replica unavailable; its sessions move to other replicas"]
