"""Counter and workplace episodes through `gymrpc up`, the model server pointed at real loopback upstreams.

Two fake OpenAI-compatible servers run in this process (`tests.model.upstreams`): a chat-only
one with tool calling, and a vLLM-style token-level one. The stack's model servers are the real
`python -m gymrpc.servers.model --backend openai` processes: one probes the chat-only upstream (mode
auto, which must pick chat), one is told `--upstream-mode tokens`. Each serves an agent for the
counter environment and one for the workplace environment; every episode must earn its reward.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gymrpc.client import Client
from gymrpc.envs.workplace_assistant import example_tasks_path
from gymrpc.messages import task_from_row
from gymrpc.servers.model.backends.sources import CounterSolver, ScriptFile
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from tests.model.upstreams import FakeUpstream, RunningUpstream

ROOT = Path(__file__).resolve().parents[2]
MODES = ("chat", "tokens")


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _first_user(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user")


@pytest.fixture
def upstreams(run_dir: Path) -> Iterator[dict[str, RunningUpstream]]:
    """The "model" replays each workplace task's ground-truth calls then answers; it solves counter tasks."""
    script = run_dir / "ground_truth.jsonl"
    lines = []
    for row in _rows(example_tasks_path()):
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in row["ground_truth"]]
        lines.append({"first_user": _first_user(row), "replies": [{"tool_calls": calls}, {"content": "Done."}]})
    script.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    sources = [ScriptFile(script), CounterSolver()]
    running = {
        "chat": RunningUpstream(FakeUpstream(completions=False, sources=sources)),
        "tokens": RunningUpstream(FakeUpstream(chat=False, sources=sources)),
    }
    yield running
    for upstream in running.values():
        upstream.stop()


def _config(upstreams: dict[str, RunningUpstream]) -> dict[str, Any]:
    servers: list[dict[str, Any]] = [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        {"name": "resources/workplace", "role": "resources", "args": {"environment": "workplace"}},
    ]
    for mode in MODES:
        args = {"backend": "openai", "upstream_url": upstreams[mode].url, "default_max_tokens": 4096}
        if mode == "tokens":
            args["upstream_mode"] = "tokens"  # the chat server is found by the default probe (auto)
        servers.append({"name": f"model/{mode}", "role": "model", "args": args})
        for env in ("counter", "workplace"):
            agent_args = {"resources": f"resources/{env}", "model": f"model/{mode}", "max_steps": 8}
            servers.append({"name": f"agent/{env}-{mode}", "role": "agent", "args": agent_args})
    return {"servers": servers}


async def _run(run_dir: Path, jobs: list[tuple[str, str, dict[str, Any]]]) -> list[agent_pb.Trajectory]:
    async with Client(run_dir=run_dir) as client:
        replies = await asyncio.gather(
            *(
                client.agent(agent).Run(
                    agent_pb.RunRequest(
                        task=task_from_row(row, rollout_id), episode_id=common_pb2.EpisodeId(rollout_id=rollout_id)
                    ),
                    timeout=120,
                )
                for agent, rollout_id, row in jobs
            )
        )
        return [reply.trajectory for reply in replies]


def test_counter_and_workplace_episodes_earn_their_rewards_in_both_modes(
    start_stack: Any, run_dir: Path, upstreams: dict[str, RunningUpstream]
) -> None:
    stack = start_stack(_config(upstreams))
    counter_rows = _rows(ROOT / "envs" / "counter" / "data" / "example.jsonl")[:3]
    workplace_rows = _rows(example_tasks_path())[:3]
    jobs = []
    for mode in MODES:
        jobs += [(f"agent/counter-{mode}", f"counter-{mode}-{i}", row) for i, row in enumerate(counter_rows)]
        jobs += [(f"agent/workplace-{mode}", f"work-{mode}-{i}", row) for i, row in enumerate(workplace_rows)]
    trajectories = asyncio.run(_run(stack.run_dir, jobs))

    source = {"chat": common_pb2.TOKEN_SOURCE_RETOKENIZED, "tokens": common_pb2.TOKEN_SOURCE_SAMPLER}
    for (agent, rollout_id, row), trajectory in zip(jobs, trajectories, strict=True):
        mode = agent.rsplit("-", 1)[1]
        assert trajectory.reward == 1.0, (rollout_id, trajectory.verify_details_json)
        assert trajectory.tool_calls, rollout_id
        assert not any(c.is_error for c in trajectory.tool_calls), rollout_id
        assert {c.tokens.token_source for c in trajectory.model_calls} == {source[mode]}, rollout_id
        if "ground_truth" in row:
            assert [c.call.name for c in trajectory.tool_calls] == [c["name"] for c in row["ground_truth"]]
    # Each upstream saw only its own route's calls (after the probe).
    assert {p for p, _ in upstreams["chat"].fake.requests} == {"/v1/completions", "/v1/chat/completions"}
    assert {p for p, _ in upstreams["tokens"].fake.requests} == {"/v1/completions"}

    # The mode each model server settled on, as `gymrpc ctl status` shows it (GetStatus details).
    shown = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "--run-dir", str(stack.run_dir), "ctl", "status"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = {line.split()[0]: line for line in shown.stdout.splitlines() if line.strip()}
    assert "upstream_mode=chat" in lines["model/chat"], shown.stdout + shown.stderr
    assert "upstream_mode=tokens" in lines["model/tokens"], shown.stdout + shown.stderr
    # ... and as `gymrpc status` shows it, in its NOTES column.
    shown = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "--run-dir", str(stack.run_dir), "status"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = {line.split()[0]: line for line in shown.stdout.splitlines()[1:] if line.strip()}
    assert "NOTES" in lines["NAME"]
    assert lines["model/chat"].rstrip().endswith("upstream_mode=chat"), shown.stdout
    assert lines["model/tokens"].rstrip().endswith("upstream_mode=tokens"), shown.stdout
    # The one line each model server logged at start about what its upstream can do.
    logs = "\n".join(p.read_text(errors="replace") for p in stack.run_dir.rglob("*.log"))
    assert "mode chat; token-id completions: NO" in logs
    assert "mode tokens; token-id completions: yes" in logs
