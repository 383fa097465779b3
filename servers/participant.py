"""`gymrpc.v1.ParticipantService` over a `ControlPlane`: message mapping only.

Every method is a control call (bearer token, checked by `gymrpc.servers.guard` before any of
this runs). Each server role builds its `Participant`, wraps it in a `ControlPlane`, and
adds `participant_binding(plane)` to the services it serves.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import grpc

from gymrpc.control import ControlPlane, Participant, Scope, collection
from gymrpc.control.index import manifest_path
from gymrpc.control.plane import DEFAULT_LEASE_GRACE, Placement
from gymrpc.control.scope import PackedScope
from gymrpc.control.types import checked_packed_scope, episode_keys
from gymrpc.errors import InvalidArgument
from gymrpc.pbtime import request_seconds, timestamp
from gymrpc.servers.bootstrap import ServerConfig, ServiceBinding
from gymrpc.v1 import participant_service_pb2 as pb
from gymrpc.v1 import participant_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["ParticipantService"]


def _deadline(
    request: pb.PrepareRequest
    | pb.RenewRequest
    | pb.CommitRequest
    | pb.PersistRequest
    | pb.RestoreRequest
    | pb.RetireRequest,
) -> float:
    if not request.HasField("deadline"):
        raise InvalidArgument("deadline is required (an absolute time)", metadata={"field": "deadline"})
    return request_seconds(request.deadline, "deadline")


def commit_scope(request: pb.CommitRequest) -> Scope:
    """The episodes a Commit continues, from either form; None: every parked one (no explicit scope).

    The packed form is checked here and made a set only when a participant first uses it
    (`PackedScope`), which a capture that takes its state whole leaves to the write."""
    if request.scope_rollout_ids or request.scope_attempts:
        if request.episode_ids:
            raise InvalidArgument(
                "the commit scope is set twice, in episode_ids and in scope_rollout_ids/scope_attempts: "
                "send one form (the packed one to participants whose GetStatus says accepts_packed_scope)",
                metadata={"field": "scope_rollout_ids"},
            )
        listed: Scope = PackedScope(*checked_packed_scope(request.scope_rollout_ids, request.scope_attempts))
    else:
        listed = frozenset(episode_keys(request.episode_ids))
    if request.explicit_scope or request.scope_rollout_ids or request.episode_ids:
        return listed
    return None


class ParticipantServicer(pb_grpc.ParticipantServiceServicer):
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        status = self.plane.status()
        reply = pb.GetStatusResponse(
            kind=int(status.kind),  # type: ignore[arg-type]
            name=status.name,
            phase=int(status.phase),  # type: ignore[arg-type]
            checkpoint_id=status.checkpoint_id,
            report=status.report.to_pb(),
            retired=status.retired,
            pid=status.pid,
            start_time=timestamp(status.started_at),
            details=status.details,
            endpoint_id=status.endpoint_id,
            accepts_packed_scope=True,
        )
        if status.lease_expires_at is not None:
            reply.lease_expire_time.CopyFrom(timestamp(status.lease_expires_at))
        return reply

    async def Prepare(self, request: pb.PrepareRequest, context: grpc.aio.ServicerContext) -> pb.PrepareResponse:
        phase, report = await self.plane.prepare(request.checkpoint_id, _deadline(request))
        return pb.PrepareResponse(phase=int(phase), report=report.to_pb())  # type: ignore[arg-type]

    async def Renew(self, request: pb.RenewRequest, context: grpc.aio.ServicerContext) -> pb.RenewResponse:
        expires = await self.plane.renew(request.checkpoint_id, _deadline(request))
        return pb.RenewResponse(lease_expire_time=timestamp(expires))

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        if background := request.persist_in_background:
            collection.hold(self.plane)  # until the resume: no full collection while the episodes wait
        try:
            scope = commit_scope(request)
            manifest = await self.plane.commit(
                request.checkpoint_id,
                _deadline(request),
                request.checkpoint_dir,
                scope,
                request.stop,
                background=background,
                base_dir=request.base_checkpoint_dir,
            )
        except BaseException:
            collection.release(self.plane)
            raise
        if manifest is None:  # captured; `Persist` reports the manifest once written
            return pb.CommitResponse(phase=pb.PARTICIPANT_PHASE_COMMITTED, persisting=True)
        return pb.CommitResponse(
            phase=pb.PARTICIPANT_PHASE_COMMITTED,
            manifest=manifest,
            manifest_path=manifest_path(manifest.kind, manifest.name, manifest.endpoint_id),
        )

    async def Persist(self, request: pb.PersistRequest, context: grpc.aio.ServicerContext) -> pb.PersistResponse:
        if request.abandon:
            await self.plane.abandon(request.checkpoint_id, _deadline(request))
            return pb.PersistResponse()
        manifest = await self.plane.persist(request.checkpoint_id, _deadline(request))
        return pb.PersistResponse(
            manifest=manifest, manifest_path=manifest_path(manifest.kind, manifest.name, manifest.endpoint_id)
        )

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext) -> pb.ResumeResponse:
        already = await self.plane.resume(request.checkpoint_id, _reply_sent(context))
        return pb.ResumeResponse(phase=pb.PARTICIPANT_PHASE_IDLE, already_resumed=already)

    async def Restore(self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext) -> pb.RestoreResponse:
        placement = Placement(
            sources=tuple(request.source_endpoint_ids),
            replicas=tuple(request.endpoint_ids),
            target=request.endpoint_id,
        )
        source, restored = await self.plane.restore(
            request.checkpoint_id,
            _deadline(request),
            request.checkpoint_dir,
            episode_keys(request.episode_ids),
            placement,
            allow_weight_version_mismatch=request.allow_weight_version_mismatch,
        )
        return pb.RestoreResponse(
            phase=pb.PARTICIPANT_PHASE_RESTORED,
            source_checkpoint_id=source,
            restored=[k.to_pb() for k in restored],
        )

    async def Retire(self, request: pb.RetireRequest, context: grpc.aio.ServicerContext) -> pb.RetireResponse:
        retired = await self.plane.retire(request.checkpoint_id, _deadline(request), episode_keys(request.episode_ids))
        return pb.RetireResponse(retired=[k.to_pb() for k in retired])

    async def Forget(self, request: pb.ForgetRequest, context: grpc.aio.ServicerContext) -> pb.ForgetResponse:
        forgotten = await self.plane.forget(request.checkpoint_id, list(request.rollout_ids))
        return pb.ForgetResponse(forgotten=forgotten)


def _reply_sent(context: grpc.aio.ServicerContext | None) -> collection.ReplySent | None:
    """Calls a function once this RPC's reply went out (its done callback); None without a gRPC context."""
    if context is None or not hasattr(context, "add_done_callback"):
        return None

    def reply_sent(then: Callable[[], None]) -> None:
        # grpc-stubs type the callback as a class; grpc calls any callable with the context
        context.add_done_callback(lambda _: then())  # type: ignore[arg-type]

    return reply_sent


def participant_binding(plane: ControlPlane) -> ServiceBinding:
    """The ParticipantService binding; every method needs the control token."""
    return ServiceBinding(
        SERVICE,
        ParticipantServicer(plane),
        pb_grpc.add_ParticipantServiceServicer_to_server,
        control_methods=[m.name for m in SERVICE.methods],
    )


def add_participant_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every participant server takes."""
    group = parser.add_argument_group("coordinated checkpoints")
    group.add_argument(
        "--checkpoint-lease-grace",
        type=float,
        default=DEFAULT_LEASE_GRACE,
        help="seconds past a control call's deadline before an open checkpoint aborts by itself (default %(default)s)",
    )
    group.add_argument(
        "--await-restore",
        action="store_true",
        help="start with admission closed: data-plane calls wait until a Restore (and its Resume) or a Resume",
    )
    group.add_argument(
        "--no-participant",
        action="store_true",
        help="do not serve ParticipantService (no admission bookkeeping on the data plane)",
    )


def wants_participant(args: argparse.Namespace, config: ServerConfig) -> bool:
    """Serve ParticipantService unless disabled; it needs the control token, so not without one."""
    if args.no_participant:
        return False
    if not config.token:
        log.warning("no control token: ParticipantService is not served", extra={"service": config.name})
        return False
    return True


def start_plane(participant: Participant, name: str, args: argparse.Namespace) -> tuple[ControlPlane, ServiceBinding]:
    """A started control plane for `participant` (from `add_participant_arguments` flags) and its binding.

    The plane takes the server's replica id (`--endpoint-id`): it names the replica's checkpoint folder.
    """
    plane = ControlPlane(
        participant,
        name=name,
        endpoint_id=getattr(args, "endpoint_id", "0"),
        lease_grace=args.checkpoint_lease_grace,
    )
    if getattr(args, "await_restore", False):
        plane.await_restore()
    plane.start()
    return plane, participant_binding(plane)
