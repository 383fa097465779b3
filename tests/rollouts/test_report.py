"""Every outcome in the results lines and the summary; `gymrpc report` rebuilds it from the file.

Also: the task row's own `id` is kept, and output piped into a reader that leaves (`| head`)
ends quietly instead of with a BrokenPipeError traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gymrpc.rollouts import EpisodeResult, ResultWriter, Summary, tasks_from_rows
from gymrpc.rollouts.report import report
from gymrpc.v1 import agent_service_pb2 as agent_pb

ROOT = Path(__file__).resolve().parents[2]
ROW = {
    "id": "row-7",
    "responses_create_params": {"input": [{"role": "user", "content": "add 1"}]},
    "expected_count": 1,
}


def _results() -> list[EpisodeResult]:
    task = tasks_from_rows([ROW], prefix="ex")[0]
    shapes = [  # (resume_count, restart_count, session_recoveries, checkpoint outcome)
        (0, 0, 0, None),
        (1, 0, 2, "continued"),
        (0, 1, 0, "restarted"),
        (0, 0, 1, "not_in_checkpoint"),
    ]
    out = []
    for repeat, (resumed, restarted, recoveries, checkpoint) in enumerate(shapes):
        result = EpisodeResult(task, repeat, "agent/a", "v0", 1000.0 + repeat, 0.5, checkpoint=checkpoint)
        result.trajectory = agent_pb.Trajectory(
            reward=1.0,
            steps=2,
            resume_count=resumed,
            restart_count=restarted,
            session_recoveries=recoveries,
        )
        out.append(result)
    return out


def test_every_outcome_is_in_the_lines_and_the_summary_and_report_rebuilds_it(tmp_path: Path) -> None:
    results = _results()
    lines = [r.to_json() for r in results]
    assert {line["id"] for line in lines} == {"row-7"}
    assert [line["session_recoveries"] for line in lines] == [0, 2, 0, 1]
    assert [line.get("checkpoint") for line in lines] == [None, "continued", "restarted", "not_in_checkpoint"]

    summary = Summary(results, wall_s=3.5, planned=4)
    assert summary.to_json()["outcomes"] == {
        "resumed": 1,
        "restarted": 1,
        "session_recoveries": 3,
        "episodes_with_session_recoveries": 2,
        "checkpoint_continued": 1,
        "checkpoint_restarted": 1,
        "checkpoint_not_in_checkpoint": 1,
    }
    outcome = next(line for line in summary.lines() if line.startswith("outcomes"))
    assert outcome == (
        "outcomes  1 resumed, 1 restarted, 3 session recoveries in 2 episodes; from the checkpoint: "
        "1 continued, 1 restarted, 1 run from the start (not in it)"
    )
    # Without a checkpoint the counts are there all the same.
    plain = Summary([r for r in _results() if not setattr(r, "checkpoint", None)], wall_s=1.0, planned=4)
    assert "outcomes  1 resumed, 1 restarted, 3 session recoveries in 2 episodes" in plain.lines()

    out = tmp_path / "results.jsonl"
    writer = ResultWriter(out)
    for line in lines:
        writer.write(line)
    writer.close()
    with open(out, "a") as f:
        f.write('{"episode_id": "ex-t0-r9", "ok": tr')  # a killed collector's partial line
    rebuilt = report(out)
    assert rebuilt.to_json()["outcomes"] == summary.to_json()["outcomes"]
    assert rebuilt.lines()[0] == "episodes  4 of 4 finished: 4 ok, 0 failed, in 3.50 s = 1.1 episodes/s"
    assert [line for line in rebuilt.lines() if line.startswith(("outcomes", "reward"))] == [
        line for line in summary.lines() if line.startswith(("outcomes", "reward"))
    ]

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "report", str(out)], capture_output=True, text=True, env=env, timeout=60
    )
    assert cli.returncode == 0, cli.stderr
    assert outcome in cli.stdout
    assert "skipped   1 lines that are not results" in cli.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", "report", str(out), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert json.loads(as_json.stdout)["outcomes"]["checkpoint_continued"] == 1


def test_output_into_a_reader_that_left_ends_without_a_traceback(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    out.write_text("".join(json.dumps(r.to_json()) + "\n" for r in _results()))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write is EPIPE
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv in (["report", str(out)], ["status", "--run-dir", str(tmp_path / "none")]):
        done = subprocess.run(
            [sys.executable, "-m", "gymrpc.cli", *argv], stdout=write, stderr=subprocess.PIPE, env=env, timeout=60
        )
        assert "Traceback" not in done.stderr.decode(), done.stderr.decode()
        assert "BrokenPipeError" not in done.stderr.decode()
    os.close(write)
