"""The state of one episode, kept explicit so it can be checkpointed at every boundary (docs/design.md §6).

Everything the loop needs to continue an episode lives in `EpisodeState`: the phase, the
step counter, the conversation so far, the pending tool calls with the index of the next
one, and every record the trajectory reports. All of it is protocol messages or plain
numbers, so a later checkpoint store can serialise it without knowing the loop.
Derived names (session id, model request ids, Step turn ids) are pure functions of the
episode id and the step, so a continued episode repeats them exactly and every
downstream idempotency key matches the first attempt's.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import secrets
from dataclasses import dataclass, field

import grpc

from gymrpc.errors import GymrpcError
from gymrpc.ids import ROLLOUT_ID
from gymrpc.pbtime import duration
from gymrpc.v1 import agent_service_pb2 as agent_pb
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as resources_pb

MAX_ID_LEN = 128
"""Longest id `gymrpc.ids.check_id` accepts."""


class Phase(enum.IntEnum):
    """Where an episode stands; values are `gymrpc.v1.EpisodePhase`'s, so conversion is free."""

    NEW = agent_pb.EPISODE_PHASE_UNSPECIFIED
    """Not seeded yet: the next transition seeds the resources session."""
    READY_FOR_MODEL = agent_pb.EPISODE_PHASE_READY_FOR_MODEL
    READY_FOR_TOOL = agent_pb.EPISODE_PHASE_READY_FOR_TOOL
    READY_FOR_VERIFY = agent_pb.EPISODE_PHASE_READY_FOR_VERIFY
    COMPLETED = agent_pb.EPISODE_PHASE_COMPLETED


def caller_retries(exc: BaseException) -> bool:
    """Whether a `Run` that ended with `exc` will be sent again with the same episode id: the caller
    went away (its call was cancelled) or saw UNAVAILABLE (`Client.run` retries both)."""
    return isinstance(exc, asyncio.CancelledError) or (
        isinstance(exc, GymrpcError) and exc.code is grpc.StatusCode.UNAVAILABLE
    )


def session_id_for(rollout_id: str, attempt: int) -> str:
    """`<rollout_id>-a<attempt>`, shortened with a digest when that would exceed the id length limit.

    Each attempt gets its own session, so a fenced attempt can never touch its successor's.
    """
    suffix = f"-a{attempt}"
    if len(rollout_id) + len(suffix) <= MAX_ID_LEN:
        return rollout_id + suffix
    digest = hashlib.sha256(rollout_id.encode()).hexdigest()[:16]
    return f"{rollout_id[: MAX_ID_LEN - len(suffix) - 17]}-{digest}{suffix}"


@dataclass
class EpisodeState:
    """One episode between two boundaries. Mutated only by `gymrpc.servers.agent.loop.EpisodeLoop`.

    Phase invariants (what a checkpoint reader may rely on):
    - NEW: nothing has happened; `messages` is empty.
    - READY_FOR_MODEL: `messages` ends with task input, observations or tool results;
      `pending_tool_calls` is empty; the next model call is step `step`.
    - READY_FOR_TOOL: `messages[-1 - next_tool_index]` is the assistant message of step
      `step - 1`. Tool envs: `pending_tool_calls[next_tool_index]` runs next. Text-turn
      envs: that assistant message goes to `Step` next (`pending_tool_calls` stays empty).
    - READY_FOR_VERIFY: the loop has ended; `stop_reason` says why.
    - COMPLETED: verified and the session closed; `verify` holds the result.
    """

    rollout_id: str
    attempt: int
    task: common_pb2.Task
    max_steps: int
    text_turns: bool = False
    """The environment acts on the assistant's text (`Step`) rather than on tool calls."""
    policy_version: str = ""
    session_id: str = ""
    phase: Phase = Phase.NEW
    step: int = 0
    """Model calls made so far; the next one is step `step` (zero-based)."""
    tools: list[common_pb2.ToolDefinition] = field(default_factory=list)
    messages: list[common_pb2.Message] = field(default_factory=list)
    pending_tool_calls: list[common_pb2.ToolCall] = field(default_factory=list)
    next_tool_index: int = 0
    stop_reason: int = agent_pb.STOP_REASON_UNSPECIFIED
    model_calls: list[agent_pb.ModelCallRecord] = field(default_factory=list)
    tool_calls: list[agent_pb.ToolCallRecord] = field(default_factory=list)
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)
    verify: resources_pb.VerifyResponse | None = None
    resume_count: int = 0
    restart_count: int = 0
    elapsed_s: float = 0.0
    """Wall-clock seconds spent on the episode so far, across every process that ran it."""
    parked_s: float = 0.0
    """Seconds parked at a boundary for a checkpoint (coordinated checkpoints; 0 for now)."""
    failovers: int = 0
    """Calls of the episode that moved to another replica after one failed, across every process
    that ran it (checkpointed): this process adds what its client counts (`EpisodeLoop.failovers`)."""
    session_recoveries: int = 0
    """Times this process went back to the last durable save after losing the resources session."""
    traceparent: str = ""
    """W3C `traceparent` of this run's episode span (empty with tracing off); checkpointed, so the run
    that continues the episode links to it. Restoring a record never overwrites it."""
    failovers_seen: int | None = None
    """This process's client count for the episode when last added to `failovers`; None until this
    process first looks (not checkpointed: counts of another process mean nothing here)."""
    keeps_session_for_retry: bool = False
    """Continued from a restored record: a `Run` the caller will retry (`caller_retries`) leaves the
    session open and the record in place, so the retry continues the episode (not checkpointed)."""
    session_snapshot: common_pb2.SessionSnapshot | None = None
    """The resources session's snapshot that the last `SeedSession`, `CallTool` or `Step` reply carried
    (`EpisodeLoop.snapshots_in_replies`), None if it carried none; durable resume saves it with the
    boundary instead of calling `CheckpointSession` (not checkpointed itself)."""
    run_nonce: str = ""
    """Set once this run started the episode over (`start_over`): its model calls get request ids of
    their own, so no generation of an earlier run is replayed into the fresh session."""

    def __post_init__(self) -> None:
        if not ROLLOUT_ID.fullmatch(self.rollout_id):
            raise ValueError(f"rollout_id {self.rollout_id!r} is not a valid id")
        if not self.session_id:
            self.session_id = session_id_for(self.rollout_id, self.attempt)

    # -- derived names ---------------------------------------------------------------------

    @property
    def episode_id(self) -> common_pb2.EpisodeId:
        return common_pb2.EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt)

    @property
    def label(self) -> str:
        """`<rollout_id>/a<attempt>`, the episode's name in logs and error messages."""
        return f"{self.rollout_id}/a{self.attempt}"

    def request_id(self, step: int) -> str:
        """Model de-duplication key of `step`: a repeated call returns the first generation."""
        return f"{self.label}/step{step}/{self.run_nonce}" if self.run_nonce else f"{self.label}/step{step}"

    def start_over(self) -> None:
        """Back to NEW, for a fresh session: what the runs so far did is dropped; `restart_count` grows."""
        self.phase, self.step, self.next_tool_index = Phase.NEW, 0, 0
        self.tools, self.messages, self.pending_tool_calls = [], [], []
        self.model_calls, self.tool_calls = [], []
        self.usage = common_pb2.Usage()
        self.stop_reason = agent_pb.STOP_REASON_UNSPECIFIED
        self.verify = self.session_snapshot = None
        self.restart_count += 1
        self.run_nonce = secrets.token_hex(4)

    @staticmethod
    def turn_id(step: int) -> str:
        """`Step` de-duplication key of the text turn answering model call `step`."""
        return f"turn_{step}"

    # -- results ---------------------------------------------------------------------------

    def progress(self, message: common_pb2.Message | None) -> agent_pb.EpisodeProgress:
        """The streamed event for the boundary just reached."""
        event = agent_pb.EpisodeProgress(
            phase=int(self.phase),  # type: ignore[arg-type]
            step=self.step,
            next_tool_index=self.next_tool_index,
        )
        if message is not None:
            event.message.CopyFrom(message)
        return event

    def trajectory(self, into: agent_pb.Trajectory | None = None) -> agent_pb.Trajectory:
        """Everything the episode produced; final once `phase` is COMPLETED.

        `into` (an empty message, such as a record's `final_result`) is filled in place: the
        conversation is copied once where it is kept, not built and then copied again.
        """
        verify = self.verify or resources_pb.VerifyResponse()
        policy_version = self.policy_version or (self.model_calls[-1].weight_version if self.model_calls else "")
        versions = [s.weight_version for c in self.model_calls for s in c.weight_versions] or [
            c.weight_version for c in self.model_calls if c.weight_version
        ]
        oldest, newest = (versions[0], versions[-1]) if versions else ("", "")
        out = agent_pb.Trajectory() if into is None else into
        out.episode_id.CopyFrom(self.episode_id)
        out.task_id = self.task.task_id
        out.messages.extend(self.messages)
        out.model_calls.extend(self.model_calls)
        out.tool_calls.extend(self.tool_calls)
        out.reward, out.verify_details_json, out.mask_sample = verify.reward, verify.details_json, verify.mask_sample
        out.steps, out.stop_reason = self.step, self.stop_reason  # type: ignore[assignment]
        out.resume_count, out.restart_count = self.resume_count, self.restart_count
        out.policy_version = policy_version
        out.usage.CopyFrom(self.usage)
        out.timing.CopyFrom(common_pb2.Timing(total=duration(self.elapsed_s), parked=duration(self.parked_s)))
        out.failovers, out.session_recoveries = self.failovers, self.session_recoveries
        out.oldest_weight_version, out.newest_weight_version = oldest, newest
        return out
