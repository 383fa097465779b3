"""Run an agent: `python -m gymrpc.servers.agent --resources resources/counter --model model/policy`.

The agent reaches resources and model by their stable names through the registry, so it
follows them when they restart on new ports. `--resume-dir PATH` turns on durable resume:
every episode is checkpointed at each boundary under PATH (by default appended to this
process's group-committed log; `--resume-store files` keeps one file per episode), and a
retried `Run` (after the agent itself was killed, say) continues it. Otherwise the agent serves `ParticipantService`
(coordinated checkpoints: `gymrpc.servers.agent.participant`) unless `--no-participant`.
`--entrypoint module:function` serves an agent function instead (`gymrpc.agentkit`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import resource
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gymrpc import auth
from gymrpc.client import Client
from gymrpc.control.types import RECOVERY_DURABLE, RECOVERY_LABEL
from gymrpc.errors import GymrpcError
from gymrpc.ids import check_service_name
from gymrpc.launch.storage import CheckpointDirError, check_checkpoint_dir
from gymrpc.servers.agent.durable import ResumeConfig
from gymrpc.servers.agent.faults import CrashingResources, CrashPlan
from gymrpc.servers.agent.participant import AgentParticipant
from gymrpc.servers.agent.service import AgentConfig, AgentServicer
from gymrpc.servers.agent.state import EpisodeState
from gymrpc.servers.bootstrap import (
    RunningServer,
    ServiceBinding,
    add_common_arguments,
    config_from_arguments,
    run,
    serve,
)
from gymrpc.servers.participant import add_participant_arguments, start_plane, wants_participant
from gymrpc.store import EpisodeStore, FilesystemEpisodeStore, LogEpisodeStore
from gymrpc.store.log import DEFAULT_COMMIT_DELAY, DEFAULT_ZERO_AHEAD, MAX_COMMIT_DELAY, MAX_ZERO_AHEAD
from gymrpc.v1 import agent_service_pb2 as pb
from gymrpc.v1 import agent_service_pb2_grpc as pb_grpc

log = logging.getLogger("gymrpc.servers.agent")
MIB = 1 << 20
SWEEP_INTERVAL = 600.0
"""Seconds between deletions of expired completed episodes."""


def build_parser() -> argparse.ArgumentParser:
    """The server's options; `gymrpc up` checks stack args against them before starting anything."""
    parser = argparse.ArgumentParser(prog="python -m gymrpc.servers.agent", description=__doc__)
    add_common_arguments(parser, default_name="agent/simple")
    defaults = AgentConfig()
    parser.add_argument(
        "--resources",
        default=defaults.resources_name,
        help="stable name of the resources server (default %(default)s)",
    )
    parser.add_argument(
        "--model", default=defaults.model_name, help="stable name of the model server (default %(default)s)"
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=defaults.max_steps,
        help="model calls per episode unless the request says (default %(default)s)",
    )
    parser.add_argument(
        "--max-steps-limit",
        type=int,
        default=defaults.max_steps_limit,
        help="largest max_steps a request may ask for (default %(default)s)",
    )
    parser.add_argument(
        "--episode-timeout",
        type=float,
        default=defaults.episode_timeout,
        help="seconds an episode may run unless the request says (default %(default)s)",
    )
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=defaults.call_timeout,
        help="seconds one resources or model call may take, retries included (default %(default)s)",
    )
    resume = parser.add_argument_group("durable resume (docs/design.md §6)")
    resume.add_argument("--resume-dir", type=Path, help="checkpoint every episode under this folder; off when unset")
    resume.add_argument(
        "--completed-ttl",
        type=float,
        default=ResumeConfig.completed_ttl,
        help="seconds a completed episode's result is kept for retries (default %(default)s)",
    )
    resume.add_argument(
        "--require-policy-version",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run must name policy_version (default on)",
    )
    resume.add_argument(
        "--resume-store",
        choices=("log", "files"),
        default="log",
        help="log: one group-committed append-only log per agent process (default); files: one atomically "
        "replaced file per episode",
    )
    resume.add_argument(
        "--resume-sync",
        choices=("file", "filesystem"),
        default="file",
        help="with --resume-store files: fsync per file (default) or syncfs per batch",
    )
    resume.add_argument(
        "--resume-commit-delay",
        type=float,
        metavar="MS",
        help=f"with --resume-store log: milliseconds a batch of saves waits for more to join before its one sync "
        f"(default {DEFAULT_COMMIT_DELAY * 1000:g}; 0: at once); it never waits while every episode in flight "
        "has a save waiting",
    )
    resume.add_argument(
        "--resume-zero-ahead",
        type=float,
        metavar="MIB",
        help=f"with --resume-store log: MiB of zeros kept written and synced past the log's end, so a batch's sync "
        f"changes no file size (default {DEFAULT_ZERO_AHEAD / MIB:g}; 0: none, as on copy-on-write filesystems, "
        "where overwriting allocates anyway)",
    )
    add_participant_arguments(parser)
    return parser


def main() -> None:
    if any(a == "--entrypoint" or a.startswith("--entrypoint=") for a in sys.argv[1:]):
        from gymrpc.agentkit.serve import main as serve_function

        return serve_function()  # an agent function (gymrpc.agentkit) instead of the built-in loop
    parser = build_parser()
    args = parser.parse_args()
    if args.resume_commit_delay is not None:
        if args.resume_store != "log":
            parser.error("--resume-commit-delay applies to --resume-store log only")
        if not 0 <= args.resume_commit_delay <= MAX_COMMIT_DELAY * 1000:
            parser.error(f"--resume-commit-delay must be 0-{MAX_COMMIT_DELAY * 1000:g} ms")
    if args.resume_zero_ahead is not None:
        if args.resume_store != "log":
            parser.error("--resume-zero-ahead applies to --resume-store log only")
        if not 0 <= args.resume_zero_ahead <= MAX_ZERO_AHEAD / MIB:
            parser.error(f"--resume-zero-ahead must be 0-{MAX_ZERO_AHEAD / MIB:g} MiB")
    server_config = dataclasses.replace(config_from_arguments(args), depends_on=(args.resources, args.model))
    if args.resume_dir is not None:
        # Controllers read it in the registry: this agent is no participant, so they refuse the stack.
        server_config.labels[RECOVERY_LABEL] = RECOVERY_DURABLE
    if not server_config.registry:
        parser.error("the agent finds resources and model through a registry: pass --registry or set $GYMRPC_REGISTRY")
    try:
        check_service_name(args.resources, "--resources")
        check_service_name(args.model, "--model")
        config = AgentConfig(
            resources_name=args.resources,
            model_name=args.model,
            max_steps=args.max_steps,
            max_steps_limit=args.max_steps_limit,
            episode_timeout=args.episode_timeout,
            call_timeout=args.call_timeout,
            resume=None
            if args.resume_dir is None
            else ResumeConfig(completed_ttl=args.completed_ttl, require_policy_version=args.require_policy_version),
        )
        crash = CrashPlan.from_environ()
        store: EpisodeStore | None = None
        filesystem = ""
        if args.resume_dir is not None:
            # Every operation the store relies on, tried once here: a folder that cannot hold
            # checkpoints fails now, with the step, rather than at an episode's first boundary.
            filesystem = check_checkpoint_dir(args.resume_dir, ofd=args.resume_store == "log")
            _raise_open_file_limit()  # files store: one lock file per running episode
            if args.resume_store == "log":
                delay = DEFAULT_COMMIT_DELAY if args.resume_commit_delay is None else args.resume_commit_delay / 1000
                zeros = DEFAULT_ZERO_AHEAD if args.resume_zero_ahead is None else int(args.resume_zero_ahead * MIB)
                store = LogEpisodeStore(args.resume_dir, commit_delay=delay, zero_ahead=zeros)
            else:
                store = FilesystemEpisodeStore(args.resume_dir, sync=args.resume_sync)
    except CheckpointDirError as exc:
        parser.exit(2, f"{parser.prog}: --resume-dir: {exc}\n")  # a usage error, as argparse's
    except GymrpcError as exc:
        parser.error(exc.message)
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"--resume-dir {args.resume_dir}: {exc}")

    async def main_async() -> None:
        # Resources and model get the agent's role token, never the stack token (docs/security.md).
        agent_token = auth.role_token(server_config.token, "agent") if server_config.token else None
        client = Client(registry=server_config.registry, token=agent_token, tls=server_config.tls)
        resources: Any = client.resources(config.resources_name)
        if crash is not None:
            resources = CrashingResources(resources, crash)
        sweeper = None
        if store is not None:
            sweeper = asyncio.get_running_loop().create_task(_sweep(store))
            log.info(
                "durable resume on",
                extra={
                    "resume_dir": str(args.resume_dir.absolute()),
                    "store": args.resume_store,
                    "sync": args.resume_sync,
                    "commit_delay_ms": store.commit_delay * 1000 if isinstance(store, LogEpisodeStore) else None,
                    "zero_ahead_bytes": store.zero_ahead if isinstance(store, LogEpisodeStore) else None,
                    "filesystem": filesystem,
                },
            )
        participant, plane, bindings = None, None, []
        if store is None and wants_participant(args, server_config):

            async def refresh() -> None:
                for name in (config.resources_name, config.model_name):
                    await client.refresh(name)

            participant = AgentParticipant(refresh)
            plane, control = start_plane(participant, server_config.name, args)
            bindings.append(control)

        def failovers(state: EpisodeState) -> int:
            moved = client.balancer.failovers
            return moved(config.resources_name, state.session_id) + moved(config.model_name, state.rollout_id)

        servicer = AgentServicer(
            config,
            resources,
            client.model(config.model_name),
            store=store,
            crash=crash,
            participant=participant,
            failovers=failovers,
        )
        bindings.insert(
            0,
            ServiceBinding(
                pb.DESCRIPTOR.services_by_name["AgentService"], servicer, pb_grpc.add_AgentServiceServicer_to_server
            ),
        )

        async def on_stop() -> None:
            if plane is not None:
                await plane.close()
            await client.close()
            if store is not None and sweeper is not None:
                sweeper.cancel()
                await store.close()
                log.info("episode store stats", extra=asdict(store.stats))

        def on_start(running: RunningServer) -> None:
            if running.metrics is not None and store is not None:
                running.metrics.watch_store(lambda: store.stats)

        await serve(server_config, bindings, on_stop=on_stop, on_start=on_start)

    run(f"agent:{args.name.partition('/')[2]}", main_async, args)


async def _sweep(store: EpisodeStore) -> None:
    """Delete expired completed episodes now and then; a failure is logged, never fatal."""
    while True:
        try:
            deleted = await store.delete_expired()
            if deleted:
                log.info("expired episodes deleted", extra={"deleted": deleted})
        except Exception:
            log.exception("expiry sweep failed")
        await asyncio.sleep(SWEEP_INTERVAL)


def _raise_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


if __name__ == "__main__":
    main()
