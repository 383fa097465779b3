"""Workplace Assistant: 27 tools over per-session pandas tables, after NeMo Gym's `workplace_assistant`.

A session holds seven tables (company directory, emails, calendar events, analytics
data, plots, project tasks, CRM) seeded from the bundled CSVs. Tools behave as the
reference's, quirks included (see the toolkit modules); outputs are the reference's
response bodies, `{"output": ...}`. The task row carries `ground_truth` (the reference's
list of `{"name", "arguments": "<json>"}` calls) and optionally `verify_mode`: `replay`
(default, the reference's reward) or `live` (also requires the session's own tables to
match the ground truth; see `_verify`). `LiveVerifyWorkplaceEnvironment` makes `live`
the default for every task of a server.

Snapshots (format `gymrpc.workplace.tables` v1) are `gymrpc.snapshots` session bundles:
one Arrow block per table plus a manifest carrying the task. Tables the session never
changed reuse the block encoded once per process from the seed. It is a `TableEnvironment`,
so coordinated checkpoints store each distinct block once (`export_tables` / `build_session`,
through `gymrpc.snapshots.checkpoint`).
Pandas work is not cheap, so the host runs every method in its thread pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pandas as pd

from gymrpc import safejson
from gymrpc.envkit import (
    CheckpointMode,
    InvalidTask,
    SnapshotCorrupt,
    SnapshotFormat,
    SnapshotUnsupported,
    TableEnvironment,
    TableSession,
    TaskSpec,
    ToolError,
    ToolResult,
    ToolSpec,
    VerifyResult,
)
from gymrpc.envs.workplace_assistant import _verify
from gymrpc.envs.workplace_assistant._data import (
    TABLE_NAMES,
    fresh_tables,
    load_tool_specs,
    seed_frames_by_digest,
    table_columns,
)
from gymrpc.envs.workplace_assistant.tools import ToolBox
from gymrpc.snapshots import (
    PAYLOAD_CONTENT_TYPE,
    BundleCorrupt,
    SessionTables,
    TableSet,
    TableUnsupported,
    decode_session,
    decode_table,
    pack,
    unpack,
)

_META_KEYS = frozenset({"task_id", "ground_truth", "verify_mode"})


class WorkplaceSession(TableSession):
    """One episode's tables and the task's ground truth."""

    def __init__(self, tables: TableSet, task_id: str, ground_truth: list[dict[str, str]], verify_mode: str) -> None:
        self.tables = tables
        self.task_id = task_id
        self.ground_truth = ground_truth
        self.verify_mode = verify_mode
        self._box = ToolBox(tables)
        self._closed = False

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        if self._closed:
            raise ToolError("this session is closed; its tables were freed")
        if name not in self._box.functions:
            raise ToolError(f"unknown tool {name!r}")
        output, is_error = self._box.call(name, arguments)
        return ToolResult(output, is_error=is_error)

    def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
        if self._closed:
            raise ToolError("this session is closed; its tables were freed")
        reward, details = _verify.score(self.tables, messages, self.ground_truth, self.verify_mode)
        return VerifyResult(reward=reward, details=details)

    def meta(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "ground_truth": self.ground_truth, "verify_mode": self.verify_mode}

    def export_tables(self) -> SessionTables:
        """Manifest plus blocks, for checkpoints that store each distinct block once."""
        if self._closed:
            raise SnapshotUnsupported("a closed session has no state to export")
        try:
            return self.tables.export(self.meta())
        except TableUnsupported as exc:
            raise SnapshotUnsupported(f"workplace session cannot be snapshotted exactly: {exc}") from None

    def export(self) -> bytes:
        return pack(self.export_tables())

    def close(self) -> None:
        self._closed = True
        self.tables.clear()


class WorkplaceEnvironment(TableEnvironment):
    """The Workplace Assistant environment (docs/design.md §8)."""

    name = "workplace"
    checkpoint_mode = CheckpointMode.EXPORTED
    snapshot_format = SnapshotFormat("gymrpc.workplace.tables", 1, PAYLOAD_CONTENT_TYPE)
    runs_inline = False  # pandas on per-session tables: run in the host's thread pool
    default_verify_mode: ClassVar[str] = "replay"

    def __init__(self) -> None:
        self._tools = load_tool_specs()

    def tools(self) -> Sequence[ToolSpec]:
        return self._tools

    def seed(self, task: TaskSpec) -> tuple[WorkplaceSession, Sequence[str]]:
        ground_truth = _ground_truth(task.fields.get("ground_truth"), f"task {task.task_id!r}")
        mode = task.fields.get("verify_mode", self.default_verify_mode)
        if mode not in _verify.VERIFY_MODES:
            raise InvalidTask(f"task {task.task_id!r}: verify_mode must be one of {list(_verify.VERIFY_MODES)}")
        return WorkplaceSession(fresh_tables(), task.task_id, ground_truth, mode), ()

    def restore(self, payload: bytes) -> WorkplaceSession:
        try:
            exported = unpack(payload)
            tables = decode_session(exported.manifest, exported.blocks.__getitem__, seed_frames_by_digest())
        except BundleCorrupt as exc:
            raise SnapshotCorrupt(f"workplace snapshot: {exc}") from None
        return self.build_session(exported, tables)

    def build_session(self, exported: SessionTables, tables: dict[str, pd.DataFrame]) -> WorkplaceSession:
        """A session from decoded tables; `SnapshotCorrupt` unless they are a workplace session's.

        Also the `build` step of `gymrpc.snapshots.restore_sessions` (wrap it to drop the session id;
        pass `known=env.known_frames()` to skip decoding the seed tables).
        """
        manifest = exported.manifest
        meta = manifest.meta
        if set(meta) != _META_KEYS or not isinstance(meta["task_id"], str):
            raise SnapshotCorrupt(f"workplace snapshot meta must have exactly {sorted(_META_KEYS)}")
        if meta["verify_mode"] not in _verify.VERIFY_MODES:
            raise SnapshotCorrupt(f"workplace snapshot: unknown verify_mode {meta['verify_mode']!r}")
        try:
            ground_truth = _ground_truth(meta["ground_truth"], "snapshot")
        except InvalidTask as exc:
            raise SnapshotCorrupt(str(exc)) from None
        if set(tables) != set(TABLE_NAMES):
            raise SnapshotCorrupt(f"workplace snapshot must hold exactly the tables {list(TABLE_NAMES)}")
        columns = table_columns()
        for name in TABLE_NAMES:
            labels = list(tables[name].columns)
            if len(set(labels)) != len(labels) or set(labels) != columns[name]:
                raise SnapshotCorrupt(f"workplace snapshot: table {name} has columns {labels}")
        ordered = {name: tables[name] for name in TABLE_NAMES}
        blocks = {name: (digest, exported.blocks[digest]) for name, digest in manifest.tables.items()}
        seeds = seed_frames_by_digest()
        bases = {}  # a table restored from a row delta goes on as deltas of the same base block
        for name, digest in manifest.tables.items():
            base = manifest.bases.get(digest)
            if base is not None:
                frame = seeds[base] if base in seeds else decode_table(exported.blocks[base])
                bases[name] = ((base, exported.blocks[base]), frame)
        tables_set = TableSet(ordered, blocks, bases)
        return WorkplaceSession(tables_set, meta["task_id"], ground_truth, meta["verify_mode"])

    def known_frames(self) -> dict[str, pd.DataFrame]:
        """Seed tables by block digest, for `decode_session` / `restore_sessions` (`known=`)."""
        return seed_frames_by_digest()


class LiveVerifyWorkplaceEnvironment(WorkplaceEnvironment):
    """Workplace Assistant whose tasks verify in `live` mode unless they say otherwise."""

    default_verify_mode = "live"


def _ground_truth(value: Any, where: str) -> list[dict[str, str]]:
    """The reference's ground truth: a list of `{"name": str, "arguments": "<JSON object>"}`."""
    if not isinstance(value, list):
        raise InvalidTask(f"{where} needs 'ground_truth', a list of tool calls")
    calls = []
    for index, call in enumerate(value):
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            raise InvalidTask(f"{where}: ground_truth[{index}] must be an object with 'name' and 'arguments'")
        if not isinstance(call["name"], str) or not isinstance(call["arguments"], str):
            raise InvalidTask(f"{where}: ground_truth[{index}] name and arguments must be strings")
        try:
            arguments = safejson.loads(call["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidTask(f"{where}: ground_truth[{index}].arguments must be a JSON object in text")
        calls.append({"name": call["name"], "arguments": call["arguments"]})
    return calls
