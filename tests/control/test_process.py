"""Coordinated checkpoints across real processes (`gymrpc up`), with SIGKILL.

The test process plays the agent (the agent participant comes later): it drives episodes
through `EpisodeLoop` against the real resources and model servers, keeps each episode's
state at its last boundary, and re-dispatches the restored episodes as attempt + 1.
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from gymrpc.client import Client
from gymrpc.control import EpisodeKey, Kind, store
from gymrpc.controller import Controller, CoordinationError
from gymrpc.errors import FailedPrecondition, GymrpcError, NotFound
from gymrpc.servers.agent.loop import EpisodeLoop
from gymrpc.servers.agent.state import EpisodeState, Phase
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as model_pb
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc
from gymrpc.v1 import resources_service_pb2 as res_pb
from tests.agent.fakes import blackjack_tasks, counter_tasks

PARTICIPANTS = ("resources/counter", "resources/blackjack", "model/policy")
LEASE = {"checkpoint_lease_grace": 2}


def config(counter_env: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "restart": {"max_restarts": 5, "window_seconds": 60, "backoff_seconds": 0.05},
        "servers": [
            {
                "name": "resources/counter",
                "role": "resources",
                "args": {"environment": "counter", **LEASE},
                "env": counter_env or {},
            },
            {"name": "resources/blackjack", "role": "resources", "args": {"environment": "blackjack", **LEASE}},
            {
                "name": "model/policy",
                "role": "model",
                "args": {
                    "policy": "counter",
                    "recorded": "env:blackjack",
                    "fallback": "<action>stand</action>",
                    "token_delay": 0.01,
                    **LEASE,
                },
            },
        ],
    }


class Driver:
    """The stand-in agent: one `EpisodeLoop` per environment over the stack's named stubs."""

    def __init__(self, client: Client) -> None:
        model = client.model("model/policy")
        self.loops = {
            "counter": EpisodeLoop(client.resources("resources/counter"), model, call_timeout=30),
            "blackjack": EpisodeLoop(client.resources("resources/blackjack"), model, call_timeout=30),
        }

    @staticmethod
    def episodes(prefix: str) -> list[EpisodeState]:
        counter = [EpisodeState(f"{prefix}-c{i}", 0, t, max_steps=8) for i, t in enumerate(counter_tasks()[:3])]
        jack = [
            EpisodeState(f"{prefix}-b{i}", 0, t, max_steps=8, text_turns=True)
            for i, t in enumerate(blackjack_tasks(seed=11)[:2])
        ]
        return [*counter, *jack]

    def loop(self, state: EpisodeState) -> EpisodeLoop:
        return self.loops["blackjack" if state.text_turns else "counter"]

    async def advance(self, state: EpisodeState, boundaries: int) -> None:
        for _ in range(boundaries):
            if state.phase is not Phase.COMPLETED:
                await self.loop(state).advance(state)

    async def park(self, state: EpisodeState, phase: Phase, step: int) -> None:
        """Advance to the first boundary at `phase` with `step` model calls made (or the end)."""
        while state.phase is not Phase.COMPLETED and not (state.phase is phase and state.step >= step):
            await self.loop(state).advance(state)

    async def finish(self, state: EpisodeState) -> Any:
        return await self.loop(state).run(state)


def outcome(trajectory: Any) -> tuple[Any, ...]:
    """What must equal an uninterrupted run: reward, calls, and every token the model produced."""
    return (
        trajectory.reward,
        len(trajectory.model_calls),
        len(trajectory.tool_calls),
        [list(c.tokens.completion_token_ids) for c in trajectory.model_calls],
        [list(c.tokens.prompt_token_ids) for c in trajectory.model_calls],
    )


def restart_all(stack: Any, names: tuple[str, ...] = PARTICIPANTS) -> None:
    before = {n: stack.server(n)["restarts"] for n in names}
    for name in names:
        stack.kill(name)
    for name in names:
        stack.wait_for(name, lambda s, n=name: s["restarts"] > before[n] and s["state"] == "serving")


def restore_and_finish(stack: Any, folder: Path, boundary: list[EpisodeState], reference: list[Any]) -> None:
    """Restore the good checkpoint `folder` into the (fresh) stack, continue every episode from its
    boundary as attempt 1, and check each ends as the uninterrupted run did."""

    async def main() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            driver, controller = Driver(client), Controller(client)
            await controller.restore("restore-good", folder, [EpisodeKey(s.rollout_id, 0) for s in boundary])
            await controller.resume("restore-good")
            for state in boundary:
                state.attempt = 1
            trajectories = await asyncio.gather(*(driver.finish(s) for s in boundary))
            assert [outcome(t) for t in trajectories] == reference

    asyncio.run(main())


def test_control_calls_need_the_token_and_a_vanished_controller_is_aborted(start_stack: Any) -> None:
    stack = start_stack(config())

    async def main() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            controller = Controller(client)
            members = await controller.discover()
            assert [(m.name, m.kind) for m in members] == [
                ("model/policy", Kind.MODEL),
                ("resources/blackjack", Kind.RESOURCES),
                ("resources/counter", Kind.RESOURCES),
            ]
            address = await client.resolve("resources/counter")
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb_grpc.ParticipantServiceStub(channel)
                for metadata in ((), (("authorization", "Bearer wrong"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=5)
                    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # The controller prepares, then vanishes: the participants abort by themselves.
            result = await controller.prepare("orphan", timeout=0.5)
            assert result.prepared
            deadline = time.monotonic() + 10
            while True:
                status = await controller.status()
                if all(s.phase == pb.PARTICIPANT_PHASE_IDLE for s in status.values()):
                    break
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.1)
            assert all("expired" in s.details["last_abort"] for s in status.values())
            seed = res_pb.SeedSessionRequest(
                session_id="s0", episode_id=common_pb2.EpisodeId(rollout_id="s0"), task=counter_tasks()[0]
            )
            await client.resources("resources/counter").SeedSession(seed, timeout=5)  # admission is open again

    asyncio.run(main())


def test_checkpoint_sigkill_everything_restore_and_continue(start_stack: Any, tmp_path: Path) -> None:
    stack = start_stack(config())
    root = tmp_path / "checkpoints"

    async def before_crash() -> tuple[list[Any], list[EpisodeState], Path]:
        async with Client(run_dir=stack.run_dir) as client:
            driver = Driver(client)
            reference = [outcome(t) for t in await asyncio.gather(*(driver.finish(s) for s in driver.episodes("ref")))]
            states = driver.episodes("ep")
            # Park at boundaries a stand-in agent may checkpoint at: before a model call (step 0 or 1)
            # or before a tool call. Episodes before a model call make it now; the model cuts or holds it.
            targets = [(Phase.READY_FOR_MODEL, 0), (Phase.READY_FOR_MODEL, 1), (Phase.READY_FOR_TOOL, 1)]
            await asyncio.gather(*(driver.park(s, *targets[i % 3]) for i, s in enumerate(states)))
            before_call = [copy.deepcopy(s) for s in states]
            calling = {
                i: asyncio.ensure_future(driver.advance(s, 1))
                for i, s in enumerate(states)
                if s.phase is Phase.READY_FOR_MODEL
            }
            assert len(calling) >= 3
            await asyncio.sleep(0.05)
            controller = Controller(client)
            scope = [EpisodeKey(s.rollout_id, 0) for s in states]
            result = await controller.checkpoint(root, episode_ids=scope, checkpoint_id="ckpt-1", stop=True)
            assert result.committed
            assert result.continued == scope
            # What the agent would have exported: a call still open was cut or held, so its episode is at
            # the boundary before the call; a delivered one moved the episode on.
            undelivered = [i for i, task in calling.items() if not task.done()]
            boundary = [before_call[i] if i in undelivered else copy.deepcopy(s) for i, s in enumerate(states)]
            model_records = store.read_checkpoint(result.checkpoint_dir, Kind.MODEL, "model/policy")[1]
            assert sum(len(r.model_episode.cuts) for r in model_records) == len(undelivered) > 0
            running = list(calling.values())
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return reference, boundary, result.checkpoint_dir

    reference, boundary, folder = asyncio.run(before_crash())
    restart_all(stack)

    async def after_crash() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            controller, driver = Controller(client), Driver(client)
            scope = [EpisodeKey(s.rollout_id, 0) for s in boundary]
            replies = await controller.restore("restore-1", folder, scope)
            assert {EpisodeKey.of(e) for e in replies["model/policy"].restored} == {e.next() for e in scope}
            await controller.resume("restore-1")
            # A second checkpoint of the restored state, before anything runs, holds the same state.
            again = await controller.checkpoint(root, episode_ids=[e.next() for e in scope], checkpoint_id="ckpt-2")
            for member in controller.members:
                kind, name = member.kind, member.name
                first = store.read_checkpoint(folder, kind, name)[1]
                second = store.read_checkpoint(again.checkpoint_dir, kind, name)[1]
                assert [r.WhichOneof("body") and getattr(r, r.WhichOneof("body")) for r in first] == [
                    r.WhichOneof("body") and getattr(r, r.WhichOneof("body")) for r in second
                ], name
            # Attempt 0 is fenced everywhere.
            old = boundary[0]
            with pytest.raises(GymrpcError) as caught:
                await client.resources("resources/counter").Verify(
                    res_pb.VerifyRequest(session_id=old.session_id, episode_id=old.episode_id), timeout=5
                )
            assert caught.value.reason == "STALE_ATTEMPT"
            request = model_pb.GenerateRequest(request_id="stale", episode_id=old.episode_id, messages=old.task.input)
            with pytest.raises(GymrpcError) as caught:
                await client.model("model/policy").Generate(request, timeout=5)
            assert caught.value.reason == "STALE_ATTEMPT"
            # Re-dispatch every episode as attempt 1 from its boundary.
            continued = []
            for state in boundary:
                state.attempt, state.resume_count = 1, state.resume_count + 1
                continued.append(state)
            trajectories = await asyncio.gather(*(driver.finish(s) for s in continued))
            assert [outcome(t) for t in trajectories] == reference
            status = await controller.status()
            assert status["model/policy"].report.counts["restored_cuts"] == 0  # every cut was continued

    asyncio.run(after_crash())


def test_a_crash_during_commit_leaves_the_previous_checkpoint_intact(start_stack: Any, tmp_path: Path) -> None:
    marker = tmp_path / "crashed"
    marker.touch()  # armed later: the first commit must not crash
    stack = start_stack(
        config({"GYMRPC_CONTROL_CRASH_AT": "commit_before_manifest", "GYMRPC_CONTROL_CRASH_MARKER": str(marker)})
    )
    root = tmp_path / "checkpoints"

    async def main() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            driver, controller = Driver(client), Controller(client)
            reference = [outcome(t) for t in await asyncio.gather(*(driver.finish(s) for s in driver.episodes("ref")))]
            states = driver.episodes("ep")
            await asyncio.gather(*(driver.advance(s, 2) for s in states))
            boundary = [copy.deepcopy(s) for s in states]
            scope = [EpisodeKey(s.rollout_id, 0) for s in states]
            good = await controller.checkpoint(root, episode_ids=scope, checkpoint_id="ckpt-good")
            await asyncio.gather(*(driver.advance(s, 1) for s in states))
            marker.unlink()
            # By hand, as `checkpoint` does but without its discard, which would remove the torn folder.
            assert (await controller.prepare("ckpt-torn", timeout=10)).prepared
            captured = await controller.capture("ckpt-torn", root / "ckpt-torn", scope, timeout=10)
            await controller.resume("ckpt-torn")
            with pytest.raises(CoordinationError):
                await controller.publish(captured)
            assert marker.exists()  # resources/counter died between its records and its manifest
            torn = root / "ckpt-torn" / "resources" / "counter"
            assert list(torn.glob("records-*.bin"))
            assert not (torn / "manifest.json").exists()
            return reference, boundary, good.checkpoint_dir

    reference, boundary, folder = asyncio.run(main())
    stack.wait_for("resources/counter", lambda s: s["restarts"] >= 1 and s["state"] == "serving")
    restart_all(stack, ("resources/blackjack", "model/policy"))

    async def restore_torn() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            controller = Controller(client)
            scope = [EpisodeKey(s.rollout_id, 0) for s in boundary]
            # No checkpoint.json (a member never committed): refused before any participant is asked.
            with pytest.raises(FailedPrecondition) as refused:
                await controller.restore("restore-torn", root / "ckpt-torn", scope)
            assert refused.value.reason == "CHECKPOINT_INCOMPLETE"
            # Forced past the index (sources named by hand), the participants refuse it all or nothing.
            torn = {"resources/counter": ["0"]}
            with pytest.raises(CoordinationError) as caught:
                await controller.restore("restore-torn", root / "ckpt-torn", scope, sources=torn)
            assert caught.value.failures["resources/counter"].code.name == "NOT_FOUND"
            status = await controller.status()  # all or nothing: everyone open, nothing restored
            assert all(s.phase == pb.PARTICIPANT_PHASE_IDLE for s in status.values())
            assert status["resources/counter"].report.counts["sessions"] == 0

    asyncio.run(restore_torn())
    restart_all(stack)  # a restore goes into fresh processes only

    restore_and_finish(stack, folder, boundary, reference)


def test_a_member_killed_between_its_capture_and_its_write_publishes_nothing(start_stack: Any, tmp_path: Path) -> None:
    """Non-stop checkpoints: resources/counter SIGKILLs itself after its capture, once the controller resumed
    on it and before it wrote anything. That checkpoint gets no index; the previous one restores."""
    marker = tmp_path / "crashed"
    marker.touch()  # armed later: the first checkpoint must not crash
    stack = start_stack(
        config({"GYMRPC_CONTROL_CRASH_AT": "persist_before_write", "GYMRPC_CONTROL_CRASH_MARKER": str(marker)})
    )
    root = tmp_path / "checkpoints"

    async def main() -> tuple[list[Any], list[EpisodeState], Path]:
        async with Client(run_dir=stack.run_dir) as client:
            driver, controller = Driver(client), Controller(client)
            reference = [outcome(t) for t in await asyncio.gather(*(driver.finish(s) for s in driver.episodes("ref")))]
            states = driver.episodes("ep")
            await asyncio.gather(*(driver.advance(s, 2) for s in states))
            boundary = [copy.deepcopy(s) for s in states]
            scope = [EpisodeKey(s.rollout_id, 0) for s in states]
            good = await controller.checkpoint(root, episode_ids=scope, checkpoint_id="ckpt-good")
            assert good.committed
            await asyncio.gather(*(driver.advance(s, 1) for s in states))
            marker.unlink()
            with pytest.raises(CoordinationError) as caught:
                await controller.checkpoint(root, episode_ids=scope, checkpoint_id="ckpt-lost", timeout=10)
            assert caught.value.operation == "persist"  # captured everywhere, then not persisted
            assert list(caught.value.failures) == ["resources/counter"]
            assert marker.exists()  # it died after the resume reached it, before its write
            lost = root / "ckpt-lost"
            assert not (lost / "checkpoint.json").exists()
            # The others persisted and were resumed, then the checkpoint was discarded: once every member
            # confirmed that nothing of it is written any more (the killed one came back without the capture),
            # the folder is removed. Had it stayed unreachable, the folder would stay, index-less, for `ctl gc`.
            if caught.value.failures["resources/counter"].reason == "CHECKPOINT_INCOMPLETE":
                assert not lost.exists()
            assert not list((lost / "resources" / "counter").glob("*"))
            status = await controller.status()
            assert {s.phase for s in status.values()} == {pb.PARTICIPANT_PHASE_IDLE}
            return reference, boundary, good.checkpoint_dir

    reference, boundary, folder = asyncio.run(main())
    stack.wait_for("resources/counter", lambda s: s["restarts"] >= 1 and s["state"] == "serving")

    async def refuse_lost() -> None:
        async with Client(run_dir=stack.run_dir) as client:
            scope = [EpisodeKey(s.rollout_id, 0) for s in boundary]
            with pytest.raises((FailedPrecondition, NotFound)) as refused:  # index-less, or removed
                await Controller(client).restore("restore-lost", root / "ckpt-lost", scope)
            assert refused.value.reason in ("CHECKPOINT_INCOMPLETE", "NOT_FOUND") or not (root / "ckpt-lost").exists()

    asyncio.run(refuse_lost())
    restart_all(stack)  # a restore goes into fresh processes only

    restore_and_finish(stack, folder, boundary, reference)
