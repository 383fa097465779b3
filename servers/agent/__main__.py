"""Run an agent: `python -m servers.agent --resources resources/counter --model model/policy`.

The agent reaches resources and model by their stable names through the registry, so it
follows them when they restart on new ports.
"""

from __future__ import annotations

import argparse

from gymrpc.client import Client
from gymrpc.errors import GymrpcError
from gymrpc.ids import check_service_name
from gymrpc.v1 import agent_service_pb2 as pb
from gymrpc.v1 import agent_service_pb2_grpc as pb_grpc
from servers.agent.service import AgentConfig, AgentServicer
from servers.bootstrap import ServiceBinding, add_common_arguments, config_from_arguments, run, serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m servers.agent", description=__doc__)
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
    args = parser.parse_args()
    server_config = config_from_arguments(args)
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
        )
    except GymrpcError as exc:
        parser.error(exc.message)
    except ValueError as exc:
        parser.error(str(exc))

    async def main_async() -> None:
        client = Client(registry=server_config.registry, token=server_config.token)
        servicer = AgentServicer(config, client.resources(config.resources_name), client.model(config.model_name))
        binding = ServiceBinding(
            pb.DESCRIPTOR.services_by_name["AgentService"],
            servicer,
            pb_grpc.add_AgentServiceServicer_to_server,
        )
        await serve(server_config, [binding], on_stop=client.close)

    run(f"agent:{args.name.partition('/')[2]}", main_async, args.log_level)


if __name__ == "__main__":
    main()
