"""Workplace sessions through the snapshot paths: exact, shared, validated, all or nothing."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gymrpc.envkit import SnapshotCorrupt, SnapshotUnsupported, TaskSpec, ToolError
from gymrpc.envs.workplace_assistant import LiveVerifyWorkplaceEnvironment, WorkplaceEnvironment, WorkplaceSession
from gymrpc.envs.workplace_assistant._data import seed_blocks, seed_frames
from gymrpc.snapshots import (
    BlockStore,
    CheckpointInvalid,
    collect,
    decode_table,
    delta_base,
    digest_of,
    encode_session,
    encode_table,
    frame_differences,
    frame_fingerprint,
    pack,
    parse_records,
    restore_sessions,
    unpack,
    write_checkpoint,
)
from tests.workplace.broken_env import NanLosingWorkplaceEnvironment

ENV = WorkplaceEnvironment()
EMAILS = ["raj.patel@atlas.com", "Leila.Azizi@atlas.com", "nobody", "kofi.mensah@atlas.com"]


def _seed(ground_truth: list[dict[str, str]] | None = None, mode: str = "replay") -> WorkplaceSession:
    return ENV.seed(TaskSpec("t", [], {"ground_truth": ground_truth or [], "verify_mode": mode}))[0]


def _random_call(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """Plausible and implausible calls of every state-changing tool and the state-changing read."""
    pick = rng.choice
    odd = pick([None, 7, "", "Won", "00000014", ["x"]])
    calls = [
        ("email_send_email", {"recipient": pick(EMAILS), "subject": pick(["Hi", odd]), "body": pick(["b", odd])}),
        ("email_delete_email", {"email_id": pick(["00000259", "00000001", "500", odd])}),
        ("email_forward_email", {"email_id": pick(["00000057", "00000499"]), "recipient": pick(EMAILS)}),
        ("email_reply_email", {"email_id": pick(["00000057", "500", odd]), "body": pick(["ok", odd])}),
        (
            "calendar_create_event",
            {
                "event_name": "E",
                "participant_email": pick(EMAILS),
                "event_start": pick(["2023-12-01 10:00:00", "soon"]),
                "duration": pick(["30", 45, "-1", odd]),
            },
        ),
        ("calendar_delete_event", {"event_id": pick(["00000013", "00000300", odd])}),
        (
            "calendar_update_event",
            {
                "event_id": pick(["00000013", "00000252"]),
                "field": pick(["event_name", "duration", "participant_email"]),
                "new_value": pick(["X", "60", 60, odd]),
            },
        ),
        (
            "analytics_create_plot",
            {
                "time_min": "2023-11-01",
                "time_max": pick(["2023-11-30", odd]),
                "value_to_plot": "total_visits",
                "plot_type": pick(["bar", "pie"]),
            },
        ),
        ("analytics_get_average_session_duration", pick([{}, {"time_min": "2023-11-20"}])),
        (
            "project_management_create_task",
            {
                "task_name": "T",
                "assigned_to_email": pick(EMAILS),
                "list_name": pick(["Backlog", "Done"]),
                "due_date": "2023-12-01",
                "board": "Design",
            },
        ),
        ("project_management_delete_task", {"task_id": pick(["00000149", "00000300", odd])}),
        (
            "project_management_update_task",
            {
                "task_id": pick(["00000149", "00000037"]),
                "field": pick(["board", "task_name", "list_name"]),
                "new_value": pick(["Design", "Renamed", odd]),
            },
        ),
        (
            "customer_relationship_manager_add_customer",
            {
                "customer_name": "N",
                "assigned_to_email": pick(EMAILS),
                "status": "Lead",
                "customer_phone": pick([None, "555", odd]),
                "notes": pick([None, "n"]),
            },
        ),
        (
            "customer_relationship_manager_update_customer",
            {
                "customer_id": pick(["00000014", "00000200"]),
                "field": pick(["status", "customer_phone", "notes", "customer_id"]),
                "new_value": pick(["Won", "555", 5, odd]),
            },
        ),
        ("customer_relationship_manager_delete_customer", {"customer_id": pick(["00000009", "00000200", odd])}),
    ]
    return pick(calls)


@pytest.mark.parametrize("seed", range(6))
def test_random_sessions_round_trip_exactly_and_every_change_is_tracked(seed: int) -> None:
    rng = random.Random(seed)
    session = _seed()
    for _ in range(25):
        before = {n: (frame_fingerprint(session.tables.get(n)), session.tables.version(n)) for n in session.tables}
        name, arguments = _random_call(rng)
        session.call_tool(name, arguments)
        for n, (fingerprint, version) in before.items():
            if frame_fingerprint(session.tables.get(n)) != fingerprint:  # changed: its snapshot block must be stale
                assert session.tables.version(n) > version, f"{name} changed {n} without a new version"
        if rng.random() < 0.3:
            restored = ENV.restore(session.export())
            for n in session.tables:
                assert frame_differences(session.tables.get(n), restored.tables.get(n)) == [], (seed, n)
            session = restored  # go on from the restored copy, as a resumed episode would


def test_seed_blocks_decode_to_exactly_the_seed_tables() -> None:
    """What lets restores copy seed tables instead of decoding their blocks."""
    frames = seed_frames()
    for name, (digest, data) in seed_blocks().items():
        assert digest_of(data) == digest
        assert frame_differences(frames[name], decode_table(data)) == [], name
        assert encode_table(frames[name].copy()) == data  # deterministic: every session's copy encodes alike


def test_untouched_tables_reuse_the_seed_blocks() -> None:
    a, b = _seed(), _seed()
    a.call_tool("email_send_email", {"recipient": "x@y.com", "subject": "s", "body": "b"})
    blocks_a, blocks_b = a.export_tables().blocks, b.export_tables().blocks
    shared = set(blocks_a) & set(blocks_b)
    assert len(shared) == 7, "six untouched tables, and the seed block the changed table's row delta applies to"
    assert all(blocks_a[d] is blocks_b[d] for d in shared)
    assert a.tables.changed() == []  # the export cached the changed table's block too
    (changed,) = set(blocks_a) - shared
    assert delta_base(blocks_a[changed]) in shared
    assert len(blocks_a[changed]) < 2000, "one sent email costs about its row, not the 27 KB table"


def test_a_hundred_untouched_sessions_cost_almost_nothing_in_a_checkpoint() -> None:
    sessions = {f"s{i}": _seed() for i in range(100)}
    full = sum(len(s.export()) for s in sessions.values())
    manifests, blocks = collect({sid: s.export_tables() for sid, s in sessions.items()}).size()
    assert blocks == len(next(iter(sessions.values())).export()) - _manifest_overhead(sessions["s0"])
    assert manifests / 100 < 1200  # bytes per untouched session
    assert manifests + blocks < full / 40, (manifests, blocks, full)  # 100 manifests + one copy of the seed blocks


def _manifest_overhead(session: WorkplaceSession) -> int:
    payload = session.export()
    return len(payload) - sum(len(b) for b in unpack(payload).blocks.values())


def test_corrupt_or_foreign_payloads_are_refused() -> None:
    payload = _seed().export()
    for bad in (payload[:-1], payload[:10], b"", payload.replace(b"GRTB", b"XXXX", 1)):
        with pytest.raises(SnapshotCorrupt):
            ENV.restore(bad)
    exported = unpack(payload)
    tables = {n: f for n, f in ENV.restore(payload).tables.frames().items() if n != "analytics._plots_data"}
    with pytest.raises(SnapshotCorrupt, match="exactly the tables"):
        ENV.restore(pack(encode_session(tables, exported.manifest.meta)))
    with pytest.raises(SnapshotCorrupt, match="meta"):
        ENV.restore(pack(encode_session(ENV.restore(payload).tables.frames(), {"task_id": "t"})))


def test_two_sessions_one_invalid_restores_neither(tmp_path: Path) -> None:
    store = BlockStore(tmp_path, durable=False)
    good, bad = _seed(), _seed()
    good.call_tool(
        "calendar_create_event",
        {"event_name": "E", "participant_email": "a@b.c", "event_start": "2023-12-01 10:00:00", "duration": "5"},
    )
    exports = {"good": good.export_tables(), "bad": bad.export_tables()}
    records = write_checkpoint(store, exports)
    manifest = json.loads(records["bad"])
    manifest["meta"]["verify_mode"] = "whatever"
    records["bad"] = json.dumps(manifest).encode()
    installed: dict[str, WorkplaceSession] = {}
    with pytest.raises(CheckpointInvalid) as caught:
        installed.update(
            restore_sessions(parse_records(records), store.get, lambda _sid, e, t: ENV.build_session(e, t))
        )
    assert set(caught.value.problems) == {"bad"}
    assert installed == {}
    records["bad"] = exports["bad"].manifest.to_json()
    restored = restore_sessions(
        parse_records(records), store.get, lambda _sid, e, t: ENV.build_session(e, t), ENV.known_frames()
    )
    assert (
        frame_differences(
            restored["good"].tables.get("calendar._calendar_events"), good.tables.get("calendar._calendar_events")
        )
        == []
    )


def test_closed_sessions_free_their_tables_and_refuse_work() -> None:
    session = _seed()
    session.close()
    assert list(session.tables) == []
    with pytest.raises(ToolError):
        session.call_tool("email_delete_email", {"email_id": "00000001"})
    with pytest.raises(SnapshotUnsupported):
        session.export()


def test_live_mode_notices_a_restore_that_lost_nan_where_the_reference_reward_does_not() -> None:
    truth = [
        {"name": "customer_relationship_manager_delete_customer", "arguments": json.dumps({"customer_id": "00000009"})}
    ]
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": truth[0]}]}
    ]
    for mode, expected in (("replay", 1.0), ("live", 0.0)):
        session = _seed(truth, mode)
        session.call_tool(truth[0]["name"], json.loads(truth[0]["arguments"]))
        assert session.verify(messages).reward == 1.0
        damaged = NanLosingWorkplaceEnvironment().restore(session.export())
        result = damaged.verify(messages)
        assert result.reward == expected, result.details
    assert "customer_relationship_manager._crm_data" in result.details["live_differences"]


def test_live_mode_is_the_default_of_the_live_variant_and_wrong_calls_score_zero() -> None:
    session = LiveVerifyWorkplaceEnvironment().seed(TaskSpec("t", [], {"ground_truth": []}))[0]
    assert session.verify_mode == "live"
    assert session.verify([]).reward == 1.0
    session.call_tool("email_delete_email", {"email_id": "00000001"})
    result = session.verify([])  # the model's call is missing from the conversation: replay agrees, live does not
    assert result.reward == 0.0
    assert result.details["replay_match"] is True
    assert result.details["live_match"] is False
    bad_json = [{"role": "assistant", "tool_calls": [{"function": {"name": "email_delete_email", "arguments": "{"}}]}]
    assert _seed().verify(bad_json).reward == 1.0  # an unparsable call is skipped, as the reference skips it
