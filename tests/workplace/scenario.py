"""The crash-equivalence scenario, shared by the per-session and the coordinated-checkpoint tests.

Seed one Workplace session, make `BEFORE` (three state-changing calls), checkpoint, crash,
restore, make `AFTER` (four calls), verify in `live` mode. `run_episode` takes the
checkpoint-crash-restore step as a callable, so each recovery mode plugs in its own; it
returns the episode to continue as (a coordinated restore continues as the next attempt):

    record = await run_episode(resources, "s1", episode, between=my_checkpoint_kill_restore)
    assert differences(uninterrupted, record) == []

The reward's details carry a strict fingerprint of every live table, computed inside the
resources process without the snapshot codec, so a codec that loses NaN cannot hide its
damage by decoding both runs the same wrong way.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gymrpc.messages import task_from_row
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb

Call = tuple[str, dict[str, Any]]

BEFORE: list[Call] = [
    (
        "calendar_create_event",
        {
            "event_name": "Risk review",
            "participant_email": "Raj.Patel@atlas.com",
            "event_start": "2023-12-04 10:00:00",
            "duration": "45",
        },
    ),
    (
        "customer_relationship_manager_add_customer",
        {"customer_name": "Ada Lovelace", "assigned_to_email": "raj.patel@atlas.com", "status": "Lead"},
    ),
    ("email_send_email", {"recipient": "kofi.mensah@atlas.com", "subject": "Plan", "body": "See you Monday."}),
]
"""Three state-changing calls: a repeated index label, a row of None next to CSV NaN, an unpadded id."""

AFTER: list[Call] = [
    ("customer_relationship_manager_search_customers", {"customer_name": "Casey Wilson"}),
    (
        "customer_relationship_manager_update_customer",
        {"customer_id": "00000014", "field": "status", "new_value": "Won"},
    ),
    (
        "analytics_create_plot",
        {"time_min": "2023-11-01", "time_max": "2023-11-30", "value_to_plot": "total_visits", "plot_type": "line"},
    ),
    ("email_search_emails", {"query": "plan", "page_size": 2}),
]
"""Four more: reads that show NaN cells, an update of a NaN-holding table, a plot (index labels are state)."""

STATE_CHANGING = {
    "calendar_create_event",
    "customer_relationship_manager_add_customer",
    "email_send_email",
    "customer_relationship_manager_update_customer",
    "analytics_create_plot",
}


def task(verify_mode: str = "live", task_id: str = "crash-scenario") -> common_pb2.Task:
    """A task whose ground truth is exactly the scenario's state-changing calls."""
    truth = [{"name": n, "arguments": json.dumps(a)} for n, a in [*BEFORE, *AFTER] if n in STATE_CHANGING]
    row = {
        "responses_create_params": {"input": [{"role": "user", "content": "Run the crash scenario."}]},
        "ground_truth": truth,
        "verify_mode": verify_mode,
    }
    return task_from_row(row, task_id)


@dataclass
class EpisodeRecord:
    outputs: list[str] = field(default_factory=list)
    reward: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def tables(self) -> dict[str, str]:
        return dict(self.details.get("tables", {}))


async def call_tools(
    resources: Any, session_id: str, episode: common_pb2.EpisodeId, calls: list[Call], first: int
) -> list[str]:
    outputs = []
    for offset, (name, arguments) in enumerate(calls):
        call = common_pb2.ToolCall(id=f"call-{first + offset}", name=name, arguments_json=json.dumps(arguments))
        reply = await resources.CallTool(pb.CallToolRequest(session_id=session_id, episode_id=episode, call=call))
        outputs.append(reply.output)
    return outputs


async def run_episode(
    resources: Any,
    session_id: str,
    episode: common_pb2.EpisodeId,
    between: Callable[[], Awaitable[common_pb2.EpisodeId]] | None = None,
) -> EpisodeRecord:
    """Seed, BEFORE, `between()` (checkpoint, crash, restore; nothing when None), AFTER, verify.

    `between` returns the episode the rest runs as (the same, or the restored next attempt).
    """
    record = EpisodeRecord()
    await resources.SeedSession(pb.SeedSessionRequest(session_id=session_id, episode_id=episode, task=task()))
    record.outputs += await call_tools(resources, session_id, episode, BEFORE, 0)
    if between is not None:
        episode = await between()
    record.outputs += await call_tools(resources, session_id, episode, AFTER, len(BEFORE))
    messages = [common_pb2.Message(role=common_pb2.ROLE_USER, content="Run the crash scenario.")]
    for index, (name, arguments) in enumerate([*BEFORE, *AFTER]):
        message = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT)
        message.tool_calls.add(id=f"call-{index}", name=name, arguments_json=json.dumps(arguments))
        messages.append(message)
    verify = await resources.Verify(pb.VerifyRequest(session_id=session_id, episode_id=episode, messages=messages))
    record.reward, record.details = verify.reward, json.loads(verify.details_json)
    return record


def differences(expected: EpisodeRecord, actual: EpisodeRecord) -> list[str]:
    """Everything that differs between two runs: tool outputs, table fingerprints, reward."""
    out = [
        f"output of call {i} ({name}) differs: {a[:120]!r} vs {b[:120]!r}"
        for i, ((name, _), a, b) in enumerate(zip([*BEFORE, *AFTER], expected.outputs, actual.outputs, strict=True))
        if a != b
    ]
    out += [f"table {n} differs" for n in sorted(expected.tables) if expected.tables[n] != actual.tables.get(n)]
    if expected.reward != actual.reward:
        out.append(f"reward {expected.reward} vs {actual.reward}")
    return out
