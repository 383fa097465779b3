"""Run a resources server: `python -m gymrpc.servers.resources --environment counter --name resources/counter`."""

from __future__ import annotations

import argparse

from gymrpc.servers.bootstrap import ServiceBinding, add_common_arguments, config_from_arguments, run, serve
from gymrpc.servers.participant import add_participant_arguments, start_plane, wants_participant
from gymrpc.servers.resources.participant import VERIFY_MODES, ResourcesParticipant, gate_servicer
from gymrpc.servers.resources.plugins import BUILTIN, load_environment
from gymrpc.servers.resources.service import ResourcesServicer
from gymrpc.v1 import resources_service_pb2 as pb
from gymrpc.v1 import resources_service_pb2_grpc as pb_grpc


def build_parser() -> argparse.ArgumentParser:
    """The server's options; `gymrpc up` checks stack args against them before starting anything."""
    parser = argparse.ArgumentParser(prog="python -m gymrpc.servers.resources", description=__doc__)
    add_common_arguments(parser, default_name="resources/counter")
    parser.add_argument(
        "--environment", default="counter", help=f"{', '.join(sorted(BUILTIN))}, or module:Class (default counter)"
    )
    parser.add_argument("--workers", type=int, default=8, help="threads running environment code")
    add_participant_arguments(parser)
    parser.add_argument(
        "--checkpoint-verify",
        choices=sorted(VERIFY_MODES),
        help="Verify during a checkpoint: wait, or replay after a crash (default: the environment's, else wait)",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    config = config_from_arguments(args)
    environment = load_environment(args.environment)()

    async def main_async() -> None:
        servicer = ResourcesServicer(environment, workers=args.workers)
        binding = ServiceBinding(
            pb.DESCRIPTOR.services_by_name["ResourcesService"],
            servicer,
            pb_grpc.add_ResourcesServiceServicer_to_server,
        )
        bindings, plane = [binding], None
        if wants_participant(args, config):
            verify = args.checkpoint_verify or getattr(environment, "checkpoint_verify", "wait")
            participant = ResourcesParticipant(servicer, verify=verify)
            gate_servicer(servicer, participant)
            plane, control = start_plane(participant, config.name, args)
            bindings.append(control)

        async def stop() -> None:
            if plane is not None:
                await plane.close()
            servicer.host.shutdown()

        await serve(config, bindings, on_stop=stop)

    run(f"resources:{args.environment}", main_async, args)


if __name__ == "__main__":
    main()
