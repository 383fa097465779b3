"""Types of the environment plug-in interface (see the package docstring)."""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


class EnvironmentError(Exception):
    """Base of the errors an environment raises; the host maps each to a gRPC status."""


class InvalidTask(EnvironmentError):
    """The task lacks fields the environment needs or has wrong types (INVALID_ARGUMENT)."""


class ToolError(EnvironmentError):
    """A tool failed in a way the model should see as the tool's result (not an RPC error)."""


class SnapshotUnsupported(EnvironmentError):
    """The environment cannot export or restore sessions (FAILED_PRECONDITION)."""


class SnapshotCorrupt(EnvironmentError):
    """A snapshot payload does not decode or fails validation (DATA_LOSS); nothing was installed."""


class CheckpointMode(enum.Enum):
    """How the environment takes part in coordinated checkpoints (docs/design.md §7)."""

    EXPORTED = "exported"
    STATELESS = "stateless"
    RESTART_ONLY = "restart_only"


class InteractionStyle(enum.Enum):
    """Whether the model acts through tool calls or through its text (`Session.step`)."""

    TOOL_CALLS = "tool_calls"
    TEXT_TURNS = "text_turns"


@dataclass(frozen=True)
class ToolSpec:
    """One tool in the OpenAI function-tool shape."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object."""
    strict: bool = False


@dataclass(frozen=True)
class TaskSpec:
    """A task as an environment sees it: the reference's JSONL row, split in parts."""

    task_id: str
    input: Sequence[Mapping[str, Any]]
    """The opening conversation, as `{"role": ..., "content": ...}` dicts."""
    fields: Mapping[str, Any]
    """Environment-specific fields of the row (for example `initial_count`)."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool call returns to the model."""

    output: str
    """JSON text or plain text, exactly as the model will see it."""
    is_error: bool = False


@dataclass(frozen=True)
class StepResult:
    """Outcome of one text turn."""

    observations: Sequence[str]
    """User-role messages to append (for example the new hand)."""
    terminated: bool = False
    truncated: bool = False


@dataclass(frozen=True)
class VerifyResult:
    """The reward of an episode and what explains it."""

    reward: float
    mask_sample: bool = False
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SnapshotFormat:
    """Label of a session snapshot codec: stable name, version, and payload type."""

    name: str
    version: int
    content_type: str = "application/json"


class Session(abc.ABC):
    """State of one episode inside an environment.

    The host serialises calls of one session, so implementations need no locks;
    calls of different sessions may run at the same time in different threads.
    """

    @abc.abstractmethod
    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        """Run a tool. Raise `ToolError` for failures the model should read."""

    def step(self, text: str) -> StepResult:
        """Act on the assistant's text (only for `InteractionStyle.TEXT_TURNS`)."""
        raise ToolError("this environment takes tool calls, not text turns")

    @abc.abstractmethod
    def verify(self, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
        """Compute the reward from the session's state (and the conversation, if needed)."""

    def export(self) -> bytes:
        """Encode the whole session state; `Environment.restore` must invert it exactly."""
        raise SnapshotUnsupported(f"{type(self).__name__} cannot export its state")

    def capture(self) -> Callable[[], bytes]:
        """The state as it is now, encoded later: a function that returns what `export()` returns now.

        A coordinated checkpoint that does not stop the world calls `capture` while the episodes
        are parked, and the function only once they run again (in a worker thread, perhaps more
        than once), so the function must not read the session (it may have changed, or closed).
        The default encodes at once (`export`, in the host's thread pool unless `runs_inline`).
        Override it when taking the state costs less than encoding it (copy a few numbers, keep
        an immutable value): the override runs on the server's event loop and must not block.
        With an override, the capture is copy-on-write: `capture` is called after the episodes
        resume, just before the first call that changes the session, or later while nothing has
        (`gymrpc.servers.resources.frozen`), and a failure there fails the checkpoint's write,
        not that call.
        """
        payload = self.export()
        return lambda: payload

    def close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Free resources held by the session."""


class Environment(abc.ABC):
    """A plug-in: one instance per resources server, creating one `Session` per episode."""

    name: ClassVar[str]
    """Short name, used in service names (`resources/<name>`) and logs."""
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.RESTART_ONLY
    interaction_style: ClassVar[InteractionStyle] = InteractionStyle.TOOL_CALLS
    snapshot_format: ClassVar[SnapshotFormat | None] = None
    """Codec label of `Session.export`; None when sessions cannot be snapshotted."""
    runs_inline: ClassVar[bool] = False
    """True when every method is cheap and never blocks (pure Python on small state): the host then
    calls it on the event loop, saving a thread hop per call (about 9 % of a tool call's cost).
    Leave False for anything that does I/O, sleeps or crunches tables."""

    @abc.abstractmethod
    def tools(self) -> Sequence[ToolSpec]:
        """The tools every session offers."""

    @abc.abstractmethod
    def seed(self, task: TaskSpec) -> tuple[Session, Sequence[str]]:
        """Create a session for a task; also return opening observations (often none).

        Raise `InvalidTask` when the task lacks what the environment needs.
        """

    def restore(self, payload: bytes) -> Session:
        """Decode a payload written by `Session.export`; raise `SnapshotCorrupt` if invalid."""
        raise SnapshotUnsupported(f"{self.name} cannot restore sessions")
