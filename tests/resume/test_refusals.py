"""Durable resume in-process (real store on disk, real resources servicer): refusals and what they leave.

Each refusal is checked against the store's files before and after: a refused run changes
nothing on disk, except a policy change, which moves the old record to the archive
byte for byte and starts a new one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gymrpc.errors import AlreadyExists, DataLoss, FailedPrecondition, GymrpcError, InvalidArgument
from gymrpc.servers.agent.durable import ResumeConfig
from gymrpc.servers.agent.service import AgentConfig, AgentServicer
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.store import FilesystemEpisodeStore
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import DirectStub, counter_resources, fake_model
from tests.resume.helpers import POLICY, files, record, record_path, task
from tests.resume.nosnap_env import NoSnapshotEnvironment

T = TypeVar("T")


def _servicer(root: Path, resources: Any = None, model: Any = None, **resume: Any) -> AgentServicer:
    config = AgentConfig(resume=ResumeConfig(**resume))
    return AgentServicer(
        config, resources or counter_resources(), model or fake_model(), store=FilesystemEpisodeStore(root)
    )


def _request(rollout_id: str = "ep", policy: str = POLICY, i: int = 1, attempt: int = 0) -> agent_pb.RunRequest:
    return agent_pb.RunRequest(
        task=task(i), policy_version=policy, episode_id=common_pb2.EpisodeId(rollout_id=rollout_id, attempt=attempt)
    )


def _run(servicer: AgentServicer, request: agent_pb.RunRequest) -> agent_pb.Trajectory:
    return asyncio.run(servicer.Run(request, None)).trajectory  # type: ignore[arg-type]


def _refused(root: Path, error: type[GymrpcError], call: Callable[[], Any]) -> GymrpcError:
    """Run `call`, expect `error`, and check the store's files did not change."""
    before = files(root)

    def invoke() -> None:
        result = call()
        if asyncio.iscoroutine(result):
            asyncio.run(result)

    with pytest.raises(error) as caught:
        invoke()
    assert files(root) == before, "a refused run changed the store"
    return caught.value


def test_resume_needs_an_episode_id_and_a_policy_version(tmp_path: Path) -> None:
    servicer = _servicer(tmp_path)
    err = _refused(tmp_path, InvalidArgument, lambda: _run(servicer, _request(rollout_id="")))
    assert "episode_id.rollout_id is required" in err.message
    err = _refused(tmp_path, InvalidArgument, lambda: _run(servicer, _request(policy="")))
    assert "policy_version is required" in err.message
    relaxed = _servicer(tmp_path, require_policy_version=False)
    assert _run(relaxed, _request(policy="")).reward == 1.0


def test_completed_episode_returns_its_cached_result_without_calling_anything(tmp_path: Path) -> None:
    resources, model = counter_resources(), fake_model()
    servicer = _servicer(tmp_path, resources, model)
    first = _run(servicer, _request())
    calls = (len(resources.calls), len(model.calls))
    before = files(tmp_path)
    again = _run(_servicer(tmp_path, resources, model), _request())  # a new agent process on the same store
    assert again == first
    assert (len(resources.calls), len(model.calls)) == (calls[0] + 2, calls[1])  # ListTools and the probe only
    assert files(tmp_path) == before
    stored = record(tmp_path, "ep")
    assert stored is not None
    assert stored.phase == agent_pb.EPISODE_PHASE_COMPLETED


def test_same_id_with_another_task_is_fingerprint_mismatch(tmp_path: Path) -> None:
    servicer = _servicer(tmp_path)
    _run(servicer, _request(i=1))
    err = _refused(tmp_path, AlreadyExists, lambda: _run(servicer, _request(i=2)))
    assert err.reason == "FINGERPRINT_MISMATCH"
    assert "already used for another task" in err.message


def test_policy_change_archives_the_record_and_restarts_the_episode(tmp_path: Path) -> None:
    resources = counter_resources()
    servicer = _servicer(tmp_path, resources)
    old = _run(servicer, _request(policy="iteration:1"))
    original = record_path(tmp_path, "ep").read_bytes()
    new = _run(servicer, _request(policy="iteration:2"))
    assert (new.reward, new.restart_count, new.resume_count) == (1.0, 1, 0)
    assert new.messages == old.messages
    archived = list((tmp_path / "archive").iterdir())
    assert len(archived) == 1
    assert archived[0].name.endswith(".policy_mismatch.ckpt")
    assert archived[0].read_bytes() == original, "the archive must hold the old record unchanged"
    stored = record(tmp_path, "ep")
    assert stored is not None
    assert stored.policy_version == "iteration:2"
    assert stored.restart_count == 1
    assert "DiscardSession" in resources.methods(), "the old session must not be reused by the fresh seed"
    # the new policy's result is now the cached one
    assert _run(servicer, _request(policy="iteration:2")) == new


def test_lease_contention_is_aborted_with_retry_info_and_changes_nothing(tmp_path: Path) -> None:
    store = FilesystemEpisodeStore(tmp_path)
    resources = counter_resources()
    servicer = AgentServicer(AgentConfig(resume=ResumeConfig()), resources, fake_model(), store=store)

    async def scenario() -> GymrpcError:
        async with store.lease("ep"):
            before = files(tmp_path)
            with pytest.raises(GymrpcError) as caught:
                await servicer.Run(_request(), None)  # type: ignore[arg-type]
            assert files(tmp_path) == before
        return caught.value

    err = asyncio.run(scenario())
    assert (err.code.name, err.reason) == ("ABORTED", "LEASE_HELD")
    assert err.retry_delay
    assert err.retry_delay > 0
    assert "SeedSession" not in resources.methods()


def test_concurrent_runs_of_one_episode_never_interleave(tmp_path: Path) -> None:
    from tests.agent.fakes import ScriptedModel, reply

    slow = ScriptedModel(reply("done"), delay=0.3)
    servicer = _servicer(tmp_path, model=slow)

    async def scenario() -> list[Any]:
        return await asyncio.gather(*(servicer.Run(_request(), None) for _ in range(2)), return_exceptions=True)  # type: ignore[arg-type]

    results = asyncio.run(scenario())
    errors = [r for r in results if isinstance(r, GymrpcError)]
    assert len(errors) == 1
    assert errors[0].reason == "LEASE_HELD"
    assert len(slow.requests) == 1


def test_resources_server_without_snapshots_is_refused_up_front(tmp_path: Path) -> None:
    resources = DirectStub(ResourcesServicer(NoSnapshotEnvironment()))
    servicer = _servicer(tmp_path, resources)
    err = _refused(tmp_path, FailedPrecondition, lambda: _run(servicer, _request()))
    assert err.reason == "SNAPSHOT_UNSUPPORTED"
    assert "cannot snapshot sessions" in err.message
    assert resources.methods() == ["ListTools", "GetSessionCheckpointing"]
    assert not list((tmp_path / "episodes").rglob("*.ckpt"))


def test_stale_attempt_is_refused_and_a_newer_attempt_starts_over(tmp_path: Path) -> None:
    servicer = _servicer(tmp_path)
    _run(servicer, _request(attempt=1))
    err = _refused(tmp_path, FailedPrecondition, lambda: _run(servicer, _request(attempt=0)))
    assert err.reason == "STALE_ATTEMPT"
    newer = _run(servicer, _request(attempt=2))
    assert (newer.reward, newer.restart_count, newer.episode_id.attempt) == (1.0, 1, 2)
    assert [p.name.rsplit(".", 2)[1] for p in (tmp_path / "archive").iterdir()] == ["superseded_attempt"]


def test_corrupt_record_is_data_loss_and_is_left_for_an_operator(tmp_path: Path) -> None:
    servicer = _servicer(tmp_path)
    _run(servicer, _request())
    path = record_path(tmp_path, "ep")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    err = _refused(tmp_path, DataLoss, lambda: _run(servicer, _request()))
    assert str(path) in err.message
    assert "sha256" in err.message


class HitThenStand:
    """FAKE model for blackjack, a function of the conversation only: hit on the first turn, then stand."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def Generate(self, request: Any, *, timeout: float | None = None) -> Any:
        from tests.agent.fakes import reply

        self.requests.append(request)
        turn = sum(1 for m in request.messages if m.role == common_pb2.ROLE_ASSISTANT)
        return reply("<action>hit</action>" if turn == 0 else "<action>stand</action>")


def test_text_turn_episode_resumes_with_the_same_cards(tmp_path: Path) -> None:
    from tests.agent.fakes import blackjack_resources, blackjack_tasks

    game = blackjack_tasks(seed=4)[0]  # hit, no bust, stand: the dealer draws after the resume
    resources = blackjack_resources()

    def request(rollout_id: str) -> agent_pb.RunRequest:
        return agent_pb.RunRequest(
            task=game, policy_version=POLICY, episode_id=common_pb2.EpisodeId(rollout_id=rollout_id)
        )

    baseline = _run(_servicer(tmp_path / "a", resources, HitThenStand()), request("whole"))

    async def interrupted() -> None:  # stop right after the first text turn was saved, as a crash would
        servicer = _servicer(tmp_path / "b", resources, HitThenStand())
        state, _ = await servicer._prepare(request("cut"))
        assert servicer.durable is not None
        events = servicer.durable.run(state)
        async for event in events:
            if (
                isinstance(event, agent_pb.EpisodeProgress)
                and event.phase == agent_pb.EPISODE_PHASE_READY_FOR_MODEL
                and event.step == 1
            ):
                break
        await events.aclose()

    asyncio.run(interrupted())
    saved = record(tmp_path / "b", "cut")
    assert saved is not None
    assert saved.phase == agent_pb.EPISODE_PHASE_READY_FOR_MODEL
    assert saved.text_turns
    resumed = _run(_servicer(tmp_path / "b", resources, HitThenStand()), request("cut"))
    assert resumed.resume_count == 1
    assert [m.content for m in resumed.messages] == [m.content for m in baseline.messages]
    assert (resumed.reward, json.loads(resumed.verify_details_json)) == (
        baseline.reward,
        json.loads(baseline.verify_details_json),
    )


def test_agent_process_refuses_a_resources_server_without_snapshots(start_stack: Any, run_dir: Path) -> None:
    from gymrpc.client import Client
    from tests.resume.helpers import agent, stack

    store = run_dir / "store"
    nosnap = {
        "name": "resources/nosnap",
        "role": "resources",
        "args": {"environment": "tests.resume.nosnap_env:NoSnapshotEnvironment"},
    }
    start_stack(stack(nosnap, agent("agent/nosnap", store, resources="resources/nosnap")))

    async def scenario() -> None:
        async with Client(run_dir=run_dir) as client:
            await client.run(task(0), episode_id="refused", policy_version=POLICY, agent="agent/nosnap", timeout=30)

    err = _refused(store, FailedPrecondition, scenario)
    assert err.reason == "SNAPSHOT_UNSUPPORTED"
    assert "resources server 'resources/nosnap' cannot snapshot sessions" in err.message
    assert not list((store / "episodes").rglob("*.ckpt"))
    assert record(store, "refused") is None, "nothing was saved in the log either"


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({}, ["--resume-dir", "/proc/no-such-folder"], "--resume-dir: checkpoint folder /proc/no-such-folder"),
        ({"GYMRPC_CRASH_AT": "after_lunch"}, [], "GYMRPC_CRASH_AT='after_lunch'"),
        ({"GYMRPC_CRASH_AT": "after_tool:1"}, [], "needs GYMRPC_CRASH_MARKER"),
        ({}, ["--resume-commit-delay", "5000"], "--resume-commit-delay must be 0-1000 ms"),
        ({}, ["--resume-commit-delay", "-1"], "--resume-commit-delay must be 0-1000 ms"),
        ({}, ["--resume-store", "files", "--resume-commit-delay", "2"], "applies to --resume-store log only"),
        ({}, ["--resume-zero-ahead", "-1"], "--resume-zero-ahead must be 0-1024 MiB"),
        ({}, ["--resume-zero-ahead", "2048"], "--resume-zero-ahead must be 0-1024 MiB"),
        ({}, ["--resume-store", "files", "--resume-zero-ahead", "2"], "--resume-zero-ahead applies to --resume-store"),
    ],
)
def test_agent_cli_refuses_bad_resume_settings(env: dict[str, str], argv: list[str], message: str) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "gymrpc.servers.agent", "--registry", "unix:/nonexistent", *argv],
        capture_output=True,
        text=True,
        cwd=root,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), **env},
        timeout=30,
    )
    assert result.returncode == 2
    assert message in result.stderr
