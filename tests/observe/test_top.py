"""`gymrpc top`'s frame from two scrapes: what a durable agent's row says about its episode store."""

from __future__ import annotations

from pathlib import Path

from gymrpc.top import Row, parse_metrics, render

STATE = {"state": "serving", "launcher": "local"}


def _page(saves: int, batches: int) -> str:
    return (
        "# TYPE gymrpc_store_records_written counter\n"
        f"gymrpc_store_records_written_total {saves}\n"
        "# TYPE gymrpc_store_group_commits counter\n"
        f"gymrpc_store_group_commits_total {batches}\n"
    )


def _cell(frame: str, name: str) -> str:
    line = next(line for line in frame.splitlines() if line.startswith(name))
    header = frame.splitlines()[1]
    start, end = header.index("CHECKPOINT"), header.index("ADDRESS")
    return line[start:end].strip()


def test_a_durable_agent_shows_its_saves_per_second_and_per_sync() -> None:
    durable = Row("agent/durable", "serving", 0, "127.0.0.1:1", "url", parse_metrics(_page(100, 10)))
    durable.after = parse_metrics(_page(340, 30))
    plain = Row("agent/plain", "serving", 0, "127.0.0.1:2", "url", parse_metrics(""), parse_metrics(""))
    idle = Row("agent/idle", "serving", 0, "127.0.0.1:3", "url", parse_metrics(_page(7, 1)), parse_metrics(_page(7, 1)))
    frame = render(Path("/run"), STATE, [durable, plain, idle], elapsed=2.0)
    assert _cell(frame, "agent/durable") == "durable, 120 saves/s, 12.0 per sync"
    assert _cell(frame, "agent/plain") == "-"  # no durable store: no store counters on its page
    assert _cell(frame, "agent/idle") == "durable, 0 saves/s"
