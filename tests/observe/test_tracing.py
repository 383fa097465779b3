"""OpenTelemetry traces: one episode is one trace over agent, model and resources, and a resume links two.

In process, an in-memory exporter sees every span of a stack's servers; as processes (`gymrpc up`),
every server appends its spans to one `GYMRPC_TRACES_FILE`, and the agent is SIGKILLed mid-episode.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gymrpc import tracing
from gymrpc.client import Client
from gymrpc.control import EpisodeKey, Phase
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.agent.fakes import counter_tasks
from tests.agent.test_integration import stack
from tests.control.test_agent_participant import GatedModel, Stack, until
from tests.control.test_controller import E0, deployment
from tests.resume.helpers import POLICY, agent, crash_env, record, task
from tests.resume.helpers import stack as resume_stack

GENERATE = "gymrpc.v1.ModelService/Generate"
CALL_TOOL = "gymrpc.v1.ResourcesService/CallTool"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)
    provider.shutdown()


def test_one_episode_is_one_trace_over_agent_model_and_resources(spans: InMemorySpanExporter) -> None:
    async def scenario() -> agent_pb.Trajectory:
        async with stack() as client:
            request = agent_pb.RunRequest(
                task=counter_tasks()[1], episode_id=common_pb2.EpisodeId(rollout_id="traced", attempt=2)
            )
            reply = await client.agent("agent/simple").Run(request, timeout=30)
            return reply.trajectory

    trajectory = asyncio.run(scenario())
    assert trajectory.reward == 1.0
    finished: tuple[ReadableSpan, ...] = spans.get_finished_spans()
    [episode] = [s for s in finished if s.name == "episode"]
    assert episode.attributes is not None
    assert episode.context is not None
    assert dict(episode.attributes) | {"gymrpc.task_id": "1"} == {
        "gymrpc.rollout_id": "traced",
        "gymrpc.attempt": 2,
        "gymrpc.task_id": "1",
        "gymrpc.resume_count": 0,
        "gymrpc.steps": trajectory.steps,
        "gymrpc.phase": "COMPLETED",
    }
    trace_id = episode.context.trace_id
    ours = [s for s in finished if s.context is not None and s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in ours if s.context is not None}
    names = [s.name for s in ours]
    # The agent's Run is the root; under it the episode, its model and tool calls, and their server spans.
    [root] = [s for s in ours if s.parent is None]
    assert root.name == "gymrpc.v1.AgentService/Run"
    assert episode.parent is not None
    assert episode.parent.span_id == root.context.span_id
    assert names.count("model.generate") == names.count(GENERATE) == trajectory.steps
    assert names.count("tool.call") == names.count(CALL_TOOL) == len(trajectory.tool_calls)
    assert {"seed", "verify", "gymrpc.v1.ResourcesService/SeedSession", "gymrpc.v1.ResourcesService/Verify"} <= set(
        names
    )
    for span in ours:
        if span is not root:
            assert span.parent is not None, f"{span.name} is a second root"
            assert span.parent.span_id in by_id, f"{span.name} has no parent in the trace"
        if span.name == GENERATE:
            assert by_id[span.parent.span_id].name == "model.generate"  # type: ignore[union-attr]
        if span.name == CALL_TOOL:
            assert by_id[span.parent.span_id].name == "tool.call"  # type: ignore[union-attr]
            assert span.attributes is not None
            assert span.attributes["rpc.grpc.status_code"] == 0
    # Nothing of the episode went into another trace, and the registry's lookups are not traced.
    assert not [s for s in finished if s.context is not None and s.context.trace_id != trace_id and "Agent" in s.name]
    assert not [s for s in finished if "RegistryService" in s.name]


def test_tracing_stays_off_without_an_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv(tracing.TRACES_FILE_ENV, raising=False)
    assert not tracing.setup_from_env("resources/x", {"OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.enabled()
    assert tracing.outgoing((("authorization", "Bearer t"),)) == (("authorization", "Bearer t"),)
    with pytest.raises(ValueError, match="unknown exporter 'zipkin'"):
        tracing.setup_from_env("resources/x", {"OTEL_TRACES_EXPORTER": "zipkin"})
    assert not tracing.enabled()


def test_the_exporters_and_service_name_come_from_the_otel_variables() -> None:
    try:
        assert tracing.setup_from_env("resources/x", {"OTEL_TRACES_EXPORTER": "otlp,console"})
        assert tracing.setup_from_env("model/y", {})  # the first call wins: one provider per process
    finally:
        tracing.shutdown()  # no span was made: the OTLP exporter has nothing to send
    assert not tracing.enabled()
    for env, name in (({}, "resources/x"), ({"OTEL_SERVICE_NAME": "mine"}, "mine")):
        assert tracing.setup_from_env("resources/x", {"OTEL_TRACES_EXPORTER": "console", **env})
        try:
            with tracing.span("probe") as span:
                assert span is not None
                assert span.resource.attributes["service.name"] == name  # type: ignore[attr-defined]
        finally:
            tracing.shutdown()
    assert not tracing.enabled()


def _read_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_episode_is_a_new_trace_linked_to_the_killed_run(
    start_stack: Any, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    traces = run_dir / "spans.jsonl"
    monkeypatch.setenv(tracing.TRACES_FILE_ENV, str(traces))
    marker = run_dir / "crashed"
    folder = run_dir / "episodes"
    start_stack(resume_stack(agent("agent/crash", folder, env=crash_env("after_model:0", marker))))

    async def scenario() -> agent_pb.Trajectory:
        async with Client(run_dir=run_dir) as client:
            return await client.run(task(1), episode_id="ep-traced", policy_version=POLICY, agent="agent/crash")

    trajectory = asyncio.run(scenario())
    assert marker.exists(), "the agent never crashed after the first model call"
    assert (trajectory.reward, trajectory.resume_count) == (1.0, 1)
    spans = _read_spans(traces)
    # The killed run's episode span never ended; the resumed run's did, and links to the killed one.
    [episode] = [s for s in spans if s["name"] == "episode"]
    assert episode["attributes"]["gymrpc.rollout_id"] == "ep-traced"
    assert episode["attributes"]["gymrpc.resume_count"] == 1
    [link] = episode["links"]
    first_trace, first_episode = link["context"]["trace_id"], link["context"]["span_id"]
    assert first_trace != episode["context"]["trace_id"]
    assert link["attributes"][tracing.RESUMED_FROM].split("-")[1:3] == [first_trace[2:], first_episode[2:]]
    # What the killed run did before the crash is in its trace, under its episode span.
    first = [s for s in spans if s["context"]["trace_id"] == first_trace]
    assert {s["name"] for s in first if s["parent_id"] == first_episode} >= {"seed", "model.generate"}
    assert {s["resource"]["attributes"]["service.name"] for s in first} == {
        "agent/crash",
        "model/policy",
        "resources/counter",
    }
    # The resumed run: one whole trace from the agent's Run down to the model and resources.
    second = [s for s in spans if s["context"]["trace_id"] == episode["context"]["trace_id"]]
    ids = {s["context"]["span_id"] for s in second}
    [root] = [s for s in second if s["parent_id"] is None]
    assert root["name"] == "gymrpc.v1.AgentService/Run"
    assert all(s["parent_id"] in ids for s in second if s is not root)
    names = {s["name"] for s in second}
    assert {"gymrpc.v1.ResourcesService/RestoreSession", GENERATE, CALL_TOOL, "tool.call", "verify"} <= names
    assert "seed" not in names  # the resumed run continued after the seed; it did not seed again
    assert {s["resource"]["attributes"]["service.name"] for s in second} == {
        "agent/crash",
        "model/policy",
        "resources/counter",
    }
    stored = record(folder, "ep-traced")
    assert stored is not None
    assert stored.traceparent.split("-")[2] == episode["context"]["span_id"][2:]


def test_an_episode_continued_after_a_coordinated_restore_links_to_the_checkpointed_run(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    async def scenario() -> None:
        first = Stack(GatedModel(), tool_delay=0.2)
        running = asyncio.ensure_future(first.run("ep"))
        live = first.participant._live
        await until(lambda: bool(live) and live[EpisodeKey("ep", 0)].state.step >= 1)
        (phase, report), _ = await first.prepare("c1")
        assert phase is Phase.PREPARED, report
        folder = tmp_path / "c1"
        await first.commit("c1", folder, frozenset({EpisodeKey("ep", 0)}))
        running.cancel()  # the process dies
        await asyncio.gather(running, return_exceptions=True)
        await first.resume("c1")
        await first.close()
        second = Stack(GatedModel())
        await second.restore("r1", folder, [EpisodeKey("ep", 0)])
        await second.resume("r1")
        assert (await second.run("ep", 1)).resume_count == 1
        await second.close()

    asyncio.run(scenario())
    first, second = (s for s in spans.get_finished_spans() if s.name == "episode")
    assert first.attributes is not None
    assert second.attributes is not None
    assert (first.attributes["gymrpc.attempt"], second.attributes["gymrpc.attempt"]) == (0, 1)
    assert first.context is not None
    assert second.context is not None
    assert first.context.trace_id != second.context.trace_id
    [link] = second.links
    assert (link.context.trace_id, link.context.span_id) == (first.context.trace_id, first.context.span_id)


def test_a_checkpoint_is_one_trace_of_its_phases(spans: InMemorySpanExporter, tmp_path: Path) -> None:
    async def scenario() -> None:
        controller, _, planes = deployment([])
        await controller.discover()
        assert (await controller.checkpoint(tmp_path, episode_ids=[E0], checkpoint_id="c1")).committed
        for plane in planes.values():
            await plane.close()

    asyncio.run(scenario())
    finished = spans.get_finished_spans()
    [root] = [s for s in finished if s.name == "checkpoint"]
    assert root.context is not None
    assert root.attributes is not None
    assert root.attributes["gymrpc.operation_id"] == "c1"
    phases = [s.name for s in finished if s.parent is not None and s.parent.span_id == root.context.span_id]
    # The commit only captures: the episodes resume before the write is published, each member inside
    # the commit as soon as it and its callers captured.
    assert phases == ["checkpoint.prepare", "checkpoint.commit", "checkpoint.publish"]
    [commit] = [s for s in finished if s.name == "checkpoint.commit"]
    assert commit.context is not None
    resumed = [s for s in finished if s.parent is not None and s.parent.span_id == commit.context.span_id]
    assert resumed
    assert {s.name for s in resumed} == {"checkpoint.resume"}
