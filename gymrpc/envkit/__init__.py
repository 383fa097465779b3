"""The environment plug-in interface: what an environment implements, free of gRPC.

An environment is a small class in `envs/` that seeds sessions from tasks and a
session object that calls tools, takes text turns, verifies, and (optionally)
exports its state as bytes (a `TableEnvironment`: also as shared table blocks). The
resources host (`servers/resources`) adapts it to `gymrpc.v1.ResourcesService`;
nothing here imports grpc.
"""

from gymrpc.envkit._tables import TableEnvironment, TableSession
from gymrpc.envkit._tasks import task_from_row
from gymrpc.envkit._types import (
    CheckpointMode,
    Environment,
    EnvironmentError,
    InteractionStyle,
    InvalidTask,
    Session,
    SnapshotCorrupt,
    SnapshotFormat,
    SnapshotUnsupported,
    StepResult,
    TaskSpec,
    ToolError,
    ToolResult,
    ToolSpec,
    VerifyResult,
)

__all__ = [
    "CheckpointMode",
    "Environment",
    "EnvironmentError",
    "InteractionStyle",
    "InvalidTask",
    "Session",
    "SnapshotCorrupt",
    "SnapshotFormat",
    "SnapshotUnsupported",
    "StepResult",
    "TableEnvironment",
    "TableSession",
    "TaskSpec",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "VerifyResult",
    "task_from_row",
]
