"""`gymrpc.v1.ResourcesService` over a `SessionHost`: validation and message mapping only."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import grpc

from gymrpc import safejson
from gymrpc.envkit import CheckpointMode, Environment, InteractionStyle, SnapshotFormat
from gymrpc.errors import DataLoss, FailedPrecondition, InvalidArgument
from gymrpc.ids import check_attempt, check_id
from gymrpc.messages import messages_to_dicts, task_spec, tool_definition
from gymrpc.servers.resources.sessions import EpisodeKey, SessionHost, request_digest
from gymrpc.v1 import common_pb2
from gymrpc.v1 import resources_service_pb2 as pb
from gymrpc.v1 import resources_service_pb2_grpc as pb_grpc

SNAPSHOT_PROTOCOL_VERSION = 1


def session_snapshot(fmt: SnapshotFormat, payload: bytes) -> common_pb2.SessionSnapshot:
    """An exported session as the protocol carries it (CheckpointSession and checkpoint records alike)."""
    return common_pb2.SessionSnapshot(
        protocol_version=SNAPSHOT_PROTOCOL_VERSION,
        format_name=fmt.name,
        format_version=fmt.version,
        content_type=fmt.content_type,
        payload=payload,
        sha256=hashlib.sha256(payload).hexdigest(),
    )


_MODES = {
    CheckpointMode.EXPORTED: pb.CHECKPOINT_MODE_EXPORTED,
    CheckpointMode.STATELESS: pb.CHECKPOINT_MODE_STATELESS,
    CheckpointMode.RESTART_ONLY: pb.CHECKPOINT_MODE_RESTART_ONLY,
}
_STYLES = {
    InteractionStyle.TOOL_CALLS: pb.INTERACTION_STYLE_TOOL_CALLS,
    InteractionStyle.TEXT_TURNS: pb.INTERACTION_STYLE_TEXT_TURNS,
}


def episode_key(episode_id: common_pb2.EpisodeId) -> EpisodeKey:
    return EpisodeKey(
        check_id(episode_id.rollout_id, "episode_id.rollout_id"),
        check_attempt(episode_id.attempt, "episode_id.attempt"),
    )


class ResourcesServicer(pb_grpc.ResourcesServiceServicer):
    def __init__(self, environment: Environment, *, workers: int = 8) -> None:
        self.environment = environment
        self.host = SessionHost(environment, workers=workers)
        self._tools = [tool_definition(t) for t in environment.tools()]
        self._tool_names = {t.name for t in self._tools}
        self.checkpoint_verify = pb.CHECKPOINT_VERIFY_WAIT
        """Reported by ListTools; the checkpoint participant sets it (`gymrpc.servers.resources.participant`)."""

    async def ListTools(self, request: pb.ListToolsRequest, context: grpc.aio.ServicerContext) -> pb.ListToolsResponse:
        return pb.ListToolsResponse(
            environment=self.environment.name,
            tools=self._tools,
            checkpoint_mode=_MODES[self.environment.checkpoint_mode],
            checkpoint_verify=self.checkpoint_verify,
            interaction_style=_STYLES[self.environment.interaction_style],
        )

    async def SeedSession(
        self, request: pb.SeedSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SeedSessionResponse:
        session_id = check_id(request.session_id, "session_id")
        episode = episode_key(request.episode_id)
        spec = task_spec(request.task)

        def reply(observations: Sequence[str]) -> pb.SeedSessionResponse:
            return pb.SeedSessionResponse(
                tools=self._tools,
                observations=[common_pb2.Message(role=common_pb2.ROLE_USER, content=o) for o in observations],
            )

        # The fingerprint covers the whole request: a seed retried with `return_snapshot` flipped is the same seed.
        flag, request.return_snapshot = request.return_snapshot, False
        try:
            fingerprint = "sha256:" + hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()
        finally:
            request.return_snapshot = flag
        seeded = await self.host.seed(session_id, episode, spec, fingerprint, reply)
        if not flag:
            return seeded
        fmt = self.host.require_snapshots()
        payload = await self.host.export_after_seed(session_id, episode)
        return pb.SeedSessionResponse(
            tools=seeded.tools, observations=seeded.observations, snapshot=session_snapshot(fmt, payload)
        )

    async def CallTool(self, request: pb.CallToolRequest, context: grpc.aio.ServicerContext) -> pb.CallToolResponse:
        session_id = check_id(request.session_id, "session_id")
        episode = episode_key(request.episode_id)
        call = request.call
        if not call.name:
            raise InvalidArgument("call.name is empty", metadata={"field": "call.name"})
        arguments, problem = None, None
        if call.name not in self._tool_names:
            problem = f"Error: unknown tool {call.name!r}; available tools: {', '.join(sorted(self._tool_names))}"
        else:
            try:
                arguments = safejson.loads(call.arguments_json or "{}")
                if not isinstance(arguments, dict):
                    problem = f"Error: arguments of {call.name} must be a JSON object, got {type(arguments).__name__}"
            except safejson.JsonLimit as exc:
                problem = f"Error: arguments of {call.name} are refused: {exc}"
            except ValueError as exc:
                problem = f"Error: arguments of {call.name} are not valid JSON: {exc}"
        export = request.return_snapshot
        digest = request_digest(call.name, call.arguments_json)
        result, payload = await self.host.call_tool(
            session_id, episode, call.id, call.name, arguments, problem, digest=digest, export=export
        )
        reply = pb.CallToolResponse(output=result.output, is_error=result.is_error)
        if payload is not None:
            reply.snapshot.CopyFrom(session_snapshot(self.host.require_snapshots(), payload))
        return reply

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        session_id = check_id(request.session_id, "session_id")
        episode = episode_key(request.episode_id)
        if self.environment.interaction_style is not InteractionStyle.TEXT_TURNS:
            raise FailedPrecondition(f"environment {self.environment.name!r} takes tool calls, not text turns")
        if request.message.role != common_pb2.ROLE_ASSISTANT:
            raise InvalidArgument("Step takes the assistant's message", metadata={"field": "message.role"})
        result, payload = await self.host.step(
            session_id, episode, request.turn_id, request.message.content, export=request.return_snapshot
        )
        reply = pb.StepResponse(
            observations=[common_pb2.Message(role=common_pb2.ROLE_USER, content=o) for o in result.observations],
            terminated=result.terminated,
            truncated=result.truncated,
        )
        if payload is not None:
            reply.snapshot.CopyFrom(session_snapshot(self.host.require_snapshots(), payload))
        return reply

    async def Verify(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.VerifyResponse:
        session_id = check_id(request.session_id, "session_id")
        episode = episode_key(request.episode_id)
        result = await self.host.verify(session_id, episode, messages_to_dicts(request.messages))
        return pb.VerifyResponse(
            reward=result.reward,
            mask_sample=result.mask_sample,
            details_json=json.dumps(dict(result.details), sort_keys=True, default=str),
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        await self.host.close(check_id(request.session_id, "session_id"), episode_key(request.episode_id))
        return pb.CloseSessionResponse()

    async def GetSessionCheckpointing(
        self, request: pb.GetSessionCheckpointingRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetSessionCheckpointingResponse:
        fmt = self.environment.snapshot_format
        if fmt is None:
            return pb.GetSessionCheckpointingResponse(supported=False, protocol_version=SNAPSHOT_PROTOCOL_VERSION)
        return pb.GetSessionCheckpointingResponse(
            supported=True,
            protocol_version=SNAPSHOT_PROTOCOL_VERSION,
            format_name=fmt.name,
            format_version=fmt.version,
            snapshot_in_replies=True,
        )

    async def CheckpointSession(
        self, request: pb.CheckpointSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointSessionResponse:
        fmt = self.host.require_snapshots()
        payload = await self.host.export(check_id(request.session_id, "session_id"), episode_key(request.episode_id))
        return pb.CheckpointSessionResponse(snapshot=session_snapshot(fmt, payload))

    async def RestoreSession(
        self, request: pb.RestoreSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.RestoreSessionResponse:
        session_id = check_id(request.session_id, "session_id")
        episode = episode_key(request.episode_id)
        fmt = self.host.require_snapshots()
        snap = request.snapshot
        if snap.protocol_version != SNAPSHOT_PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"snapshot protocol_version {snap.protocol_version} is not supported (expected "
                f"{SNAPSHOT_PROTOCOL_VERSION})",
                reason="SNAPSHOT_FORMAT_MISMATCH",
            )
        if (snap.format_name, snap.format_version) != (fmt.name, fmt.version):
            raise FailedPrecondition(
                f"snapshot format {snap.format_name} v{snap.format_version} cannot be read by this server "
                f"({fmt.name} v{fmt.version})",
                reason="SNAPSHOT_FORMAT_MISMATCH",
                metadata={"format_name": snap.format_name[:100], "format_version": str(snap.format_version)},
            )
        if hashlib.sha256(snap.payload).hexdigest() != snap.sha256:
            raise DataLoss(
                f"snapshot for session {session_id!r} fails its sha256 check; nothing was restored",
                metadata={"session_id": session_id},
            )
        reply = pb.SeedSessionResponse(tools=self._tools)
        await self.host.restore(session_id, episode, snap.payload, reply)
        return pb.RestoreSessionResponse()

    async def DiscardSession(
        self, request: pb.DiscardSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DiscardSessionResponse:
        discarded = await self.host.discard(check_id(request.session_id, "session_id"), episode_key(request.episode_id))
        return pb.DiscardSessionResponse(discarded=discarded)
