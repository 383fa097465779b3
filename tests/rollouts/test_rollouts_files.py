"""Task files, episode ids, the results file and the summary: no stack needed."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import gymrpc.envs.counter
from gymrpc.errors import InvalidArgument
from gymrpc.ids import check_id
from gymrpc.rollouts import EpisodeResult, Progress, ResultWriter, Summary, TaskFileError, done_ids, load_tasks
from gymrpc.rollouts.report import percentile
from gymrpc.rollouts.tasks import id_prefix
from gymrpc.v1 import agent_service_pb2 as agent_pb

ROOT = Path(__file__).resolve().parents[2]
GOOD = gymrpc.envs.counter.example_tasks_path().read_text().splitlines()[0]


def test_example_tasks_load_with_deterministic_valid_ids() -> None:
    tasks = load_tasks(gymrpc.envs.counter.example_tasks_path())
    assert [t.index for t in tasks] == [0, 1, 2, 3, 4]
    assert [t.line for t in tasks] == [1, 2, 3, 4, 5]
    assert tasks[3].episode_id(2) == "example-t3-r2"
    assert json.loads(tasks[0].task.env_json)["expected_count"] == 6
    for t in tasks:
        check_id(t.episode_id(99), "episode id")


def test_blank_lines_are_not_rows_and_limit_counts_rows(tmp_path: Path) -> None:
    path = tmp_path / "my tasks (v2).jsonl"
    path.write_text(f"\n{GOOD}\n\n{GOOD}\n{GOOD}\n")
    tasks = load_tasks(path, limit=2)
    assert [(t.index, t.line) for t in tasks] == [(0, 2), (1, 4)]
    assert tasks[1].episode_id(0) == "my-tasks-v2-t1-r0"
    check_id(tasks[1].episode_id(0), "episode id")


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ('{"responses_create_params": ', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"expected_count": 3}', "responses_create_params"),
        ('{"responses_create_params": {"input": [{"role": "user"}]}}', "content"),
    ],
)
def test_a_bad_row_names_its_line(tmp_path: Path, bad: str, expected: str) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(f"{GOOD}\n\n{bad}\n{GOOD}\n")
    with pytest.raises(TaskFileError, match=rf"tasks\.jsonl:3: .*{expected}"):
        load_tasks(path)


def test_missing_or_empty_file_and_bad_prefix(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match="does not exist"):
        load_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TaskFileError, match="no task rows"):
        load_tasks(tmp_path / "empty.jsonl")
    with pytest.raises(TaskFileError, match="id prefix"):
        load_tasks(gymrpc.envs.counter.example_tasks_path(), prefix="../etc")
    assert id_prefix("...") == "tasks"
    assert id_prefix("_x") == "t_x"
    assert len(id_prefix("a" * 300)) == 100


def test_cli_refuses_a_malformed_line_before_running_anything(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(f"{GOOD}\n{{oops\n")
    out = tmp_path / "out.jsonl"
    proc = _cli("rollouts", str(tasks), "--out", str(out), "--run-dir", str(tmp_path / "none"))
    assert proc.returncode == 2
    assert f"{tasks}:2: not valid JSON" in proc.stderr
    assert not out.exists()


def test_cli_without_a_stack_says_so(tmp_path: Path) -> None:
    proc = _cli(
        "rollouts",
        str(gymrpc.envs.counter.example_tasks_path()),
        "--out",
        str(tmp_path / "out.jsonl"),
        "--run-dir",
        str(tmp_path / "none"),
    )
    assert proc.returncode == 3
    assert "no stack found" in proc.stderr


def _result(index: int, repeat: int, reward: float | None, latency: float) -> EpisodeResult:
    task = load_tasks(gymrpc.envs.counter.example_tasks_path())[index]
    result = EpisodeResult(task, repeat, "agent/x", "", 1000.0, latency)
    if reward is None:
        result.error = InvalidArgument("bad task", reason="INVALID_TASK")
    else:
        result.trajectory = agent_pb.Trajectory(reward=reward, steps=3, stop_reason=agent_pb.STOP_REASON_FINAL_ANSWER)
    return result


def test_result_lines_summary_and_resume_ids(tmp_path: Path) -> None:
    results = [_result(0, 0, 1.0, 0.1), _result(0, 1, 0.0, 0.3), _result(1, 0, None, 0.2)]
    line = results[0].to_json()
    assert line["episode_id"] == "example-t0-r0"
    assert (line["reward"], line["steps"], line["stop_reason"], line["ok"]) == (1.0, 3, "final_answer", True)
    assert line["trajectory"]["reward"] == 1.0
    failed = results[2].to_json()
    assert failed["ok"] is False
    assert failed["reward"] is None
    assert failed["error"] == {"code": "INVALID_ARGUMENT", "reason": "INVALID_TASK", "message": "bad task"}

    out = tmp_path / "out.jsonl"
    writer = ResultWriter(out)
    for r in results:
        writer.write(r.to_json())
    writer.close()
    with open(out, "a") as f:
        f.write('{"episode_id": "example-t4-r0", "ok": tr')  # a crash mid-line
    assert done_ids(out) == {"example-t0-r0", "example-t0-r1"}
    writer = ResultWriter(out, append=True)
    writer.write(_result(1, 0, 1.0, 0.1).to_json())
    writer.close()
    lines = [json.loads(x) for x in out.read_text().splitlines()]  # the partial line is gone
    assert [x["episode_id"] for x in lines] == ["example-t0-r0", "example-t0-r1", "example-t1-r0", "example-t1-r0"]

    summary = Summary(results, wall_s=2.0, planned=4)
    data = summary.to_json()
    assert (data["finished"], data["ok"], data["failed"], data["mean_reward"]) == (3, 2, 1, 0.5)
    assert data["mean_reward_by_task"] == {"0": 0.5}
    assert data["latency_p50_s"] == pytest.approx(0.2)
    text = "\n".join(summary.lines())
    assert "3 of 4 finished: 2 ok, 1 failed" in text
    assert "example-t1-r0  INVALID_ARGUMENT INVALID_TASK: bad task" in text


def test_percentile_and_plain_progress_lines() -> None:
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    stream = io.StringIO()
    progress = Progress(2, stream, interval=60.0)
    progress.update(_result(0, 0, 1.0, 0.1))  # first line: due at once
    progress.update(_result(0, 1, None, 0.1))  # last line: always printed
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert "\r" not in stream.getvalue()
    assert "2/2 100%" in lines[1]
    assert "failed 1" in lines[1]
    assert "reward 1.000" in lines[1]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_a_cancel_grpc_swallows_still_stops_the_collection() -> None:
    """grpc.aio returns the reply when a cancel lands as it arrives: the worker must still stop."""
    import asyncio
    import contextlib

    from gymrpc.rollouts import collect

    calls: list[str] = []
    first_call = asyncio.Event()

    class SwallowingAgent:
        async def Run(self, request: agent_pb.RunRequest, *, timeout: float) -> agent_pb.RunResponse:
            calls.append(request.episode_id.rollout_id)
            first_call.set()
            if len(calls) == 1:
                with contextlib.suppress(asyncio.CancelledError):  # what grpc.aio does when the reply won the race
                    await asyncio.Event().wait()
            return agent_pb.RunResponse(trajectory=agent_pb.Trajectory(reward=1.0))

    class FakeClient:
        async def resolve(self, name: str) -> str:
            return "unix:/nowhere"

        def agent(self, name: str) -> SwallowingAgent:
            return SwallowingAgent()

    async def main() -> list[str]:
        tasks = load_tasks(gymrpc.envs.counter.example_tasks_path())
        job = asyncio.ensure_future(collect(FakeClient(), tasks, concurrency=1))  # type: ignore[arg-type]
        await first_call.wait()
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        return calls

    assert asyncio.run(main()) == ["example-t0-r0"]
