"""Serve an agent function: `python -m gymrpc.servers.agent --entrypoint mypkg.agents:solve [--resources ...]`.

The same flags every server takes (name, bind, registry, ...) plus where its resources and
model are and how a non-deterministic function is treated on replay.
"""

from __future__ import annotations

import argparse
from typing import Any

from gymrpc import auth
from gymrpc.client import Client
from gymrpc.ids import check_service_name
from gymrpc.v1 import agent_service_pb2 as pb
from gymrpc.v1 import agent_service_pb2_grpc as pb_grpc


def build_parser() -> argparse.ArgumentParser:
    """The options of an agent-function server; `gymrpc up` checks stack args against them."""
    from gymrpc.servers.bootstrap import add_common_arguments

    parser = argparse.ArgumentParser(prog="python -m gymrpc.servers.agent --entrypoint", description=__doc__)
    add_common_arguments(parser, default_name="agent/kit")
    parser.add_argument("--entrypoint", required=True, help="module:function, an async function of an Episode")
    parser.add_argument("--resources", default="resources/counter", help="stable name of the resources server")
    parser.add_argument("--model", default="model/policy", help="stable name of the model server")
    parser.add_argument("--call-timeout", type=float, default=300.0, help="seconds one model or tool call may take")
    parser.add_argument(
        "--divergence",
        choices=("fail", "go_live"),
        default="fail",
        help="a retried run that asks something other than the record: fail (default) or go on live "
        "(in a fresh session when the resources role refuses a tool call the earlier run did not make)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    from gymrpc.agentkit.service import AgentKitServicer, load_entrypoint
    from gymrpc.servers.agent.faults import CrashPlan
    from gymrpc.servers.bootstrap import ServiceBinding, config_from_arguments, run, serve

    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_arguments(args)
    if not config.registry:
        parser.error("the agent finds resources and model through a registry: pass --registry or set $GYMRPC_REGISTRY")
    try:
        check_service_name(args.resources, "--resources")
        check_service_name(args.model, "--model")
        function = load_entrypoint(args.entrypoint)
        crash = CrashPlan.from_environ()
    except Exception as exc:  # a usage error: say which flag and why
        parser.error(str(exc))

    async def main_async() -> None:
        # Resources and model get the agent's role token, never the stack token (docs/security.md).
        agent_token = auth.role_token(config.token, "agent") if config.token else None
        client: Any = Client(registry=config.registry, token=agent_token, tls=config.tls)
        servicer = AgentKitServicer(
            function,
            client,
            api_key=agent_token or "gymrpc",
            resources_name=args.resources,
            model_name=args.model,
            call_timeout=args.call_timeout,
            divergence=args.divergence,
            crash=crash,
        )
        binding = ServiceBinding(
            pb.DESCRIPTOR.services_by_name["AgentService"], servicer, pb_grpc.add_AgentServiceServicer_to_server
        )

        async def on_stop() -> None:
            await client.close()

        await serve(config, [binding], on_stop=on_stop)

    run(f"agentkit:{args.name.partition('/')[2]}", main_async, args)
